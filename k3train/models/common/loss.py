"""The LM head and its cross-entropy in one pass over row chunks, never holding the whole [N, V] logits.

    linear_cross_entropy(hidden [N, d], weight [V, d], targets [N])
        == F.cross_entropy(F.linear(hidden, weight).float(), targets)     (within fp32 rounding)

With a gradient wanted, the forward pass also computes the gradients, chunk by chunk, while each chunk's logits
are at hand: g = (softmax(logits) - one_hot(target)) / count, grad_hidden[chunk] = g @ W, grad_weight += g^T h[chunk].
Backward only scales them by the incoming gradient. This is the approach of Liger-Kernel's fused linear
cross-entropy, in plain torch ops:
https://github.com/linkedin/Liger-Kernel/blob/ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c/src/liger_kernel/ops/fused_linear_cross_entropy.py
What it saves is memory traffic, not FLOPs (the same three matmuls): the fp32 logits, the log-softmax and its
backward each stream [N, V] floats through memory; a chunk of them stays in cache.

Targets equal to IGNORE_INDEX (-100, F.cross_entropy's default) count neither in the sum nor in the mean. When
every target is ignored the loss is NaN (0 / 0) and the gradients are zero, as F.cross_entropy gives.

Per-target losses for figures (a mixture's train loss per source): a call handed `target_losses` (a TargetLosses,
passed down by the model's forward from the caller that wants them: k3train/train/step.py) also adds (losses [N],
kept [N] bool), detached, to it. On the chunked path they come out of the same pass, and the mean and its gradients
are the same bits as without them. FLA's kernel gives only the mean, so there the mean and gradients stay FLA's and
the per-target losses come from one more chunked pass without gradients (the LM head's forward matmul again: a
third of the head's training FLOPs, under 1% of a K3 step's).

Under torch.autocast the matmuls run in the autocast dtype, as the nn.Linear they replace would; the softmax and
the loss are fp32, and the gradients reach hidden and weight in their own dtypes (through autograd's casts).

implementation: "chunked", the above in torch ops; "fla", flash-linear-attention's fused_linear_cross_entropy_loss
(the same chunked algorithm, with the softmax, the loss and the logits' gradient in Triton kernels, in place: fewer
passes over each [chunk, V] block on a GPU); "auto", fla for a CUDA tensor when flash-linear-attention is installed
and no chunk_size was given, chunked otherwise. Without a gradient wanted it is always chunked (FLA's always computes
the gradients). FLA's kernel:
(fla-core 0.6.0) https://github.com/fla-org/flash-linear-attention/blob/b256266820c476c752acdb6b0e2eb9471eb72641/fla/modules/fused_linear_cross_entropy/ops.py
"""

from __future__ import annotations

import torch

from k3train.models.common.fla import FLA_INSTALLED, fla_runs_on

IGNORE_INDEX = -100
IMPLEMENTATIONS = ("auto", "chunked", "fla")
# The default chunk: as many rows as fill a logits block of this many fp32 values, so the block is the same size
# whatever the vocabulary. On CPU 64 MiB (512 rows at V=32768; at k3_tiny's V=257 one block holds a whole batch,
# as each chunk's ~10 small ops cost more than its rows there); on a GPU 1.25 GiB (2048 rows at V=163840), which
# takes most of the gain over whole logits at a twentieth of their memory.
# Timings: docs/decisions/linear-cross-entropy.md.
LOGITS_BLOCK_VALUES = 512 * 32768
GPU_LOGITS_BLOCK_VALUES = 2048 * 163840


class TargetLosses:
    """Each target's loss, collected from the forwards it is handed to (as `target_losses=`), in the order they run:
    `parts`, a list of (losses [N] fp32 (fp64 kept), kept [N] bool), detached, 0 where the target is ignored. Not a
    list itself: a pipeline's schedule hands a non-tensor keyword to every micro-batch as it is (a list would be
    rebuilt per micro-batch)."""

    def __init__(self) -> None:
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, losses: torch.Tensor, targets: torch.Tensor) -> None:
        """losses [N] (e.g. F.cross_entropy's with reduction="none"), targets [N]. Call it outside any
        autograd.Function: torch.compile replays an append only out there."""
        kept = targets != IGNORE_INDEX
        losses = losses.detach().to(torch.promote_types(losses.dtype, torch.float32))  # bf16 up, fp64 kept
        self.parts.append((torch.where(kept, losses, 0.0), kept))


def default_chunk_size(vocab_size: int, device_type: str = "cpu") -> int:
    block = LOGITS_BLOCK_VALUES if device_type == "cpu" else GPU_LOGITS_BLOCK_VALUES
    return max(1, block // vocab_size)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int | None = None,
    implementation: str = "auto",
    target_losses: TargetLosses | None = None,
) -> torch.Tensor:
    """hidden [N, d], weight [V, d], targets [N] int64 -> the mean cross-entropy over the targets that are not
    IGNORE_INDEX, a fp32 scalar. chunk_size: rows per chunk; None: default_chunk_size(V, device).
    implementation: "auto" | "chunked" | "fla"; target_losses: each target's loss added to it (module docstring)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"linear_cross_entropy implementation={implementation!r} must be one of {IMPLEMENTATIONS}")
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1] or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"linear_cross_entropy wants hidden [N, d], weight [V, d], targets [N]; got hidden "
            f"{list(hidden.shape)}, weight {list(weight.shape)}, targets {list(targets.shape)}"
        )
    chunk_size_given = chunk_size
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0], hidden.device.type)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # the casts nn.Linear would get; autograd carries the grads back
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    record = target_losses is not None
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        fla_wanted = implementation == "fla" or (implementation == "auto" and chunk_size_given is None)
        if fla_wanted and (implementation == "fla" or _fla_fits(hidden)):
            with torch.autocast(device_type, enabled=False):
                loss = _fla_linear_cross_entropy(hidden, weight, targets)
                if record:  # FLA's kernel gives only the mean: the per-target losses from a pass without gradients
                    with torch.no_grad():
                        per_target = _chunked(hidden.detach(), weight.detach(), targets, chunk_size, False, True)[3]
                    target_losses.add(per_target, targets)
            return loss
        loss, per_target = _LinearCrossEntropy.apply(hidden, weight, targets, chunk_size, record)
    else:
        with torch.autocast(device_type, enabled=False):
            loss, _, _, per_target = _chunked(hidden, weight, targets, chunk_size, False, record)
    if record:
        target_losses.add(per_target, targets)
    return loss


def _fla_fits(hidden: torch.Tensor) -> bool:
    return hidden.is_cuda and FLA_INSTALLED


def _fla_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """FLA's fused linear cross-entropy, its mean over the kept targets; NaN when every target is ignored, as the
    chunked path and F.cross_entropy give (FLA's divides by at least 1: 0)."""
    try:
        from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss
    except ImportError as err:
        raise ImportError(
            "linear_cross_entropy implementation='fla' needs flash-linear-attention (and triton) on a CUDA machine: "
            "pip install 'k3train[gpu]'; or use implementation='chunked'"
        ) from err
    if not fla_runs_on(hidden):
        raise RuntimeError(
            f"linear_cross_entropy implementation='fla' runs Triton kernels and needs CUDA tensors; got device "
            f"{hidden.device}. Use implementation='chunked' on a CPU."
        )
    loss = fused_linear_cross_entropy_loss(hidden, targets, weight, ignore_index=IGNORE_INDEX)
    return torch.where((targets != IGNORE_INDEX).any(), loss, torch.nan)  # a tensor test: no host sync


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, per_target_wanted):
        with torch.autocast(hidden.device.type, enabled=False):  # the inputs arrive already in the matmul dtype
            loss, grad_hidden, grad_weight, per_target = _chunked(
                hidden, weight, targets, chunk_size, True, per_target_wanted
            )
        ctx.save_for_backward(grad_hidden, grad_weight)
        if per_target is None:
            per_target = loss.new_empty(0)
        ctx.mark_non_differentiable(per_target)
        return loss, per_target

    @staticmethod
    def backward(ctx, grad_loss, _grad_per_target):
        grad_hidden, grad_weight = ctx.saved_tensors
        # On CPU the usual grad_loss == 1 returns the gradients as they are: scaling by 1 would write a fresh [V, d]
        # tensor (why: docs/decisions/linear-cross-entropy.md). Elsewhere always the one pass: testing for 1 costs a
        # host sync on a GPU and a graph break under torch.compile.
        if grad_loss.device.type == "cpu" and not torch.compiler.is_compiling() and grad_loss.item() == 1.0:
            return grad_hidden, grad_weight, None, None, None
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None


def _chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int,
    with_grads: bool,
    per_target_wanted: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The mean loss over the kept targets; with_grads, its gradients w.r.t. hidden and weight in their dtypes; with
    per_target_wanted, each target's loss ([N], 0 where ignored). One [chunk, V] block of logits at a time, in fp32 for
    bf16/fp16/fp32 inputs and fp64 for fp64 ones (precision=fp64 keeps every sum exact enough to compare layouts)."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    kept = targets != IGNORE_INDEX
    per_target = torch.zeros(hidden.shape[0], dtype=acc, device=hidden.device) if per_target_wanted else None
    count = kept.sum()  # a tensor: no host sync on a GPU, no graph break under torch.compile
    # The mean's 1 / count goes into the [chunk, d] side of each gradient product, never a pass over [chunk, V].
    # All targets ignored: the gradient rows are all masked to 0, and the clamp keeps them 0 rather than NaN.
    row_scale = kept[:, None].to(acc) / count.clamp(min=1)
    safe_targets = torch.where(kept, targets, 0)[:, None]  # any valid index: the ignored rows are masked out
    loss_sum = torch.zeros((), dtype=acc, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if with_grads else None
    # an fp32 (fp64) accumulator: summing the chunks' products in bf16 would round at every chunk; torch.empty, as
    # the first chunk's addmm_ has beta=0 (it ignores what was there)
    grad_weight = torch.empty_like(weight, dtype=acc) if with_grads else None
    # One block (fp32, or fp64) reused by every chunk: a fresh [chunk, V] allocation per chunk costs page faults on CPU.
    block = torch.empty(min(chunk_size, hidden.shape[0]), weight.shape[0], dtype=acc, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        h, t, scale = hidden[rows], safe_targets[rows], row_scale[rows]
        logits = block[: h.shape[0]]
        if h.dtype == acc:
            torch.mm(h, weight.T, out=logits)
        else:
            logits.copy_(h @ weight.T)  # the matmul in the low-precision dtype, the softmax in fp32
        log_probs = torch.log_softmax(logits, dim=-1, out=logits)  # in place: each row is read before it is written
        target_log_probs = log_probs.gather(1, t)
        loss_sum -= (target_log_probs * scale).sum()  # scale: the kept rows' 1 / count, 0 for ignored ones
        if per_target is not None:
            per_target[rows] = torch.where(kept[rows], -target_log_probs[:, 0], 0.0)
        if not with_grads:
            continue
        # d(summed loss)/d(logits) = softmax - one_hot; the row scale turns it into the mean's, masked
        grad_logits = log_probs.exp_().scatter_add_(1, t, torch.full_like(t, -1, dtype=acc))
        if h.dtype == acc:
            grad_hidden[rows] = (grad_logits @ weight) * scale
            grad_weight.addmm_(grad_logits.T, h * scale, beta=0 if start == 0 else 1)
        else:  # scaled in fp32 before the cast, as the whole-logits path's gradient is (1 / count in bf16 is off by
            # up to 2^-9, a bias on every gradient); the products in the low-precision dtype, their sum in fp32
            grad_logits = grad_logits.mul_(scale).to(h.dtype)
            grad_hidden[rows] = grad_logits @ weight
            product = grad_logits.T @ h
            if start == 0:
                grad_weight.copy_(product)
            else:
                grad_weight += product
    loss = torch.where(count > 0, loss_sum, torch.nan)  # all ignored: NaN, as F.cross_entropy gives
    if with_grads:
        return loss, grad_hidden, grad_weight.to(weight.dtype), per_target
    return loss, None, None, per_target
