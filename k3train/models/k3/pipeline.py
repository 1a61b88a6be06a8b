"""KimiK3 cut by block into pipeline stages (KimiK3.pipeline_stage; parallel.pp, k3train/train/pipeline.py).

A stage holds layers [first, last) of the model, the embedding with the first stage, and the output mix, the final
norm, the LM head and the loss with the last, under the whole model's names (`layers.5.mixer...`), so the stages'
state dicts are pieces of the model's and a checkpoint of any cut is the model's. What crosses a cut is the
residual stream h and, with attention residuals, the sums of the blocks finished before it (the embedding first):
every later layer mixes over them (k3train/models/k3/model.py), so a stage receives them with h and sends them on,
one more each time a layer of its own starts a block. Their number at a cut is fixed by the cut (blocks_before),
which is what torch.distributed.pipelining needs to size its buffers.

Keywords reach every stage (the schedule splits them by micro-batch as it splits the tokens): `document_ids`, from
which each stage builds the Documents its layers read, and `targets`, which only the last reads. The last stage's
output is the micro-batch's mean next-token loss: the LM head and the loss run together (linear_cross_entropy), as
KimiK3.forward does with targets, so the logits are never built whole. torchtitan cuts its models the same way
(torchtitan/distributed/pipeline_parallel.py: whole-model names, the loss on the last stage).
"""

from __future__ import annotations

import torch
from torch import nn

from k3train.models.common.documents import Documents
from k3train.models.common.loss import TargetLosses, linear_cross_entropy
from k3train.models.k3 import mup
from k3train.models.k3.parallelize import parallelize as parallelize_k3


def blocks_before(model: nn.Module, layer: int) -> int:
    """How many block sums reach layer `layer` (0 without attention residuals): those its earlier layers started."""
    return sum(1 for i in range(layer) if model.layers[i].starts_block)


class KimiK3Stage(nn.Module):
    """Layers [first, last) of a KimiK3, with its embedding when first == 0 and its head and loss when last is the
    model's layer count. forward(tokens or (h, *blocks), document_ids=None, targets=None)."""

    def __init__(self, model: nn.Module, first: int, last: int) -> None:
        super().__init__()
        n_layers = len(model.layers)
        if not 0 <= first < last <= n_layers:
            raise ValueError(f"a stage of layers [{first}, {last}) of a {n_layers}-layer model")
        if model.config.tie_embeddings and not (first == 0 and last == n_layers):
            raise ValueError(
                "model.tie_embeddings=true shares the embedding with the LM head, which pipeline parallelism puts "
                "on the first and the last stage: untie them (model.tie_embeddings=false) or set parallel.pp=1"
            )
        self.config = model.config
        self.first, self.last = first, last
        self.is_first, self.is_last = first == 0, last == n_layers
        if self.is_first:
            self.embed_tokens = model.embed_tokens
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(first, last)})
        if self.is_last:
            self.norm, self.lm_head = model.norm, model.lm_head
            if model.config.attn_res_block_size is not None:
                self.output_attn_res_norm = model.output_attn_res_norm
                self.output_attn_res_proj = model.output_attn_res_proj
        self._output_mix = type(model)._output_mix  # KimiK3's, called on this stage's modules
        self.output_multiplier = model.output_multiplier
        self._model_class = type(model)  # the base under mup is one of these (parametrization_base)
        self.blocks_in = blocks_before(model, first)
        self.blocks_out = blocks_before(model, last)

    def parametrization_base(self) -> nn.Module | None:
        """The whole model's base under mup (HasParametrizationBase): its names are this stage's."""
        return mup.base_model(self._model_class, self.config)

    def parallelize(self, dims, fully_shard) -> dict:
        """This stage spread over the ranks that hold it, as the whole model would be (the Parallelizes protocol):
        under FSDP2 its blocks and itself the units, the stage the root."""
        return parallelize_k3(self, dims, fully_shard)

    def forward(
        self,
        *inputs: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        target_losses: TargetLosses | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """inputs: the tokens [B, T] (first stage) or (h [B, T, d], *blocks); returns (h, *blocks) for the next
        stage, or on the last the mean next-token loss over the micro-batch's B*T positions (fp32), shape [1]: the
        schedule concatenates the micro-batches' outputs; there target_losses gets each target's loss."""
        if self.is_first:
            (x,) = inputs
            h, blocks = self.embed_tokens(x), ()
        else:
            h, blocks = inputs[0], tuple(inputs[1:])
        context_parallel = next((layer.mixer.context_parallel for layer in self.layers.values()), None)
        documents = None if document_ids is None else Documents(document_ids, context_parallel)
        for layer in self.layers.values():
            h, blocks = layer(h, blocks, documents), blocks + (h,) if layer.starts_block else blocks
        if not self.is_last:
            return (h, *blocks)
        if targets is None:
            raise ValueError("the last pipeline stage computes the loss: it needs targets")
        h = self.norm(self._output_mix(self, h, blocks))
        if self.output_multiplier != 1.0:  # mup's (KimiK3._head_input)
            h = h * self.output_multiplier
        # a new tensor, not a view of the scalar: FSDP2 hooks a root's outputs for backward, and warns at a view
        loss = linear_cross_entropy(
            h.flatten(0, 1), self.lm_head.weight, targets.flatten(), target_losses=target_losses
        )
        return torch.stack([loss])
