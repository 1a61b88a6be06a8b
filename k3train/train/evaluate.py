"""Validation loss on a fixed prefix of the val split, leaving every piece of training state as it was."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from k3train.data import EndOfData
from k3train.models.protocol import document_inputs
from k3train.runtime.distributed import mean_across_ranks
from k3train.train.rng import capture_rng_state, restore_rng_state


@torch.no_grad()
def evaluate(
    model,
    val_loader,
    num_batches: int,
    precision,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    loss_of: Callable | None = None,
) -> dict:
    """Mean loss over the first num_batches val batches (fewer if the split is shorter).

    Model mode, the val cursor and all RNG states are restored afterwards, so evaluating never changes what
    training does next; routers see model.eval() and leave their balancing state alone. Documents are masked as the
    loader marks them, as in training (the same TokenData gives both loaders). `loss_of(x, y, document_ids)`, when
    given, is a batch's mean loss instead of the model's forward (the run's UpdateStep.eval_loss: a pipeline's stages
    in turn).
    """
    was_training = model.training
    rng = capture_rng_state()
    cursor = val_loader.state_dict()
    model.eval()
    val_loader.reset()
    losses = []
    try:
        for _ in range(num_batches):
            try:
                x, y, document_ids = val_loader.next_batch()
            except EndOfData:
                break
            with precision.autocast(device):
                if loss_of is not None:
                    ids = None if document_ids is None else document_ids.to(device)
                    loss = torch.as_tensor(loss_of(x.to(device), y.to(device), ids), dtype=torch.float64)
                else:
                    documents = document_inputs(model, document_ids, device)
                    _, loss = model(x.to(device), targets=y.to(device), **documents)
            losses.append(loss.double())
    finally:
        val_loader.load_state_dict(cursor)
        restore_rng_state(rng)
        model.train(was_training)
    # Every rank read its rows of the same global batches: their mean is the global batch's loss.
    loss = mean_across_ranks(torch.stack(losses).mean().item(), device, group)
    return {"loss": loss, "batches": len(losses), "val_tokens": len(losses) * val_loader.global_tokens_per_batch}
