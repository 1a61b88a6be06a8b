"""Linear cross-entropy problems: hidden rows, an output weight and targets (some ignored), the whole-logits
F.cross_entropy reference, and a loss with its gradients (test_loss.py, test_loss_gpu.py)."""

import math

import torch
import torch.nn.functional as F

from k3train.models.common.loss import IGNORE_INDEX


def problem(n: int, d: int, v: int, ignored: float = 0.0, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g) / math.sqrt(d) * 3).to(dtype).requires_grad_()  # logits of std ~3
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.rand(n, generator=g) < ignored] = IGNORE_INDEX
    return hidden, weight, targets


def reference(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets)


def loss_and_grads(loss_fn, hidden, weight, targets, grad_scale=1.0, **kwargs):
    """The loss and d(grad_scale * loss)/d(hidden, weight): a grad_output other than 1 checks backward's scaling."""
    loss = loss_fn(hidden, weight, targets, **kwargs)
    return (loss, *torch.autograd.grad(loss * grad_scale, (hidden, weight)))
