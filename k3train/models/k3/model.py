"""KimiK3: a Kimi Linear-style hybrid language model.

    tokens [B, T] -> embed_tokens -> n_layers x Block -> RMSNorm -> lm_head -> logits [B, T, V]
                                                                (with targets: -> lm_head + cross-entropy -> loss)

    Block:  x = x + mixer(RMSNorm(x))     mixer: KimiDeltaAttention (linear, recurrent state) or
                                                 MultiHeadLatentAttention (full causal softmax attention)
            x = x + ffn(RMSNorm(x))       ffn:   SwiGLU in the first `first_k_dense` layers, MoE after

The layer pattern (e.g. 3 KDA then 1 MLA, repeated) comes from KimiK3Config.layer_pattern.

Attention residuals (Kimi K3; config.attn_res_block_size = S, an int) replace the residual sum: each layer's input
is a learned softmax mix over depth (k3train/models/k3/attn_res.py) of `blocks` (the embedding, then the sum of
each finished block of S layers' outputs) and the running sum of the current block's outputs:

    blocks = []; h = embed_tokens(tokens)
    layer l:  x = Mix_attn_l(blocks + [h]) if blocks else h      (layer 0's Mix_attn_l is never used)
              if l % S == 0: blocks += [h]; s = mixer(RMSNorm(x))                 (h: the finished block's sum)
              else:          s = h + mixer(RMSNorm(x))
              h = s + ffn(RMSNorm(Mix_mlp_l(blocks + [s])))
    logits = lm_head(RMSNorm(Mix_out(blocks + [h])))

Mix_attn_l, Mix_mlp_l, Mix_out: Block.self_attention_res_{norm,proj}, Block.mlp_res_{norm,proj},
KimiK3.output_attn_res_{norm,proj}, as the released checkpoint names them. The mix is per token: decoding
(forward_cached) keeps no state for it. S = None: the `x + f(x)` blocks above, no mixing parameters. Reference:
NVIDIA-NeMo/Automodel's Kimi K3 (KimiDecoderLayer._forward_attn_residual, KimiK3TextModel.forward),
https://github.com/NVIDIA-NeMo/Automodel/blob/00ef9ca241e8b06fb7f59eb70b1cad1cc5c357bb/nemo_automodel/components/models/kimi_k3/model.py

Activation checkpointing (KimiK3.set_activation_checkpointing; train.activation_checkpointing): "block" keeps only
each Block's inputs and recomputes the Block in the backward; "selective" recomputes only the attention core (the
mixer) and the routed experts (MoE's checkpoint_experts argument; the dense FFN whole), keeping the norms, mixes
and routing. The MoE's routing changes its bias in a training forward, so a recomputed Block replays the experts its
forward chose and leaves the bias alone (MoE.route): the recompute is the forward, bit for bit.

Document masking (forward's document_ids, k3train/models/common/documents.py): each row may hold several documents, and
only the mixers read across positions, so only they take the boundaries: KDA restarts its state and short convs at
each document start, MLA attends within the document. Everything else is per token. The routing's bias update is
over the batch's tokens either way: balancing, not attention, so documents do not split it. forward builds one
Documents from the ids (with the context-parallel group, whose ranks' ids it gathers once) and hands it to every
Block's mixer, which reads the form it needs (cu_seqlens, masks, tiles), made by the first layer that asks: one
host read and one mask per forward, not one per layer, and a recompute under activation checkpointing reads the
same.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3train.models.common.context_parallel import ContextParallel
from k3train.models.common.documents import Documents
from k3train.models.common.health import WindowStats
from k3train.models.common.init import ONE, ZERO, InitialWeights, Normal, Rule, declared_rules, fill
from k3train.models.common.loss import TargetLosses, linear_cross_entropy
from k3train.models.common.norm import RMSNorm
from k3train.models.common.swiglu import SwiGLU
from k3train.models.k3 import mup
from k3train.models.k3.attn_res import attn_res_mix
from k3train.models.k3.cache import MLACache
from k3train.models.k3.config import KimiK3Config
from k3train.models.k3.costs import K3Costs
from k3train.models.k3.flops import flops_per_token
from k3train.models.k3.mla import MultiHeadLatentAttention
from k3train.models.k3.moe import MoE, RoutedExperts, replayed_routes
from k3train.models.k3.parallelize import parallelize as parallelize_k3
from k3train.models.k3.pipeline import KimiK3Stage
from k3train.models.kda.layer import KimiDeltaAttention
from k3train.models.kda.state import KDAState

CHECKPOINTING = ("none", "block", "selective")


@contextlib.contextmanager
def measured_once(mixer: nn.Module, passes: list) -> Iterator[None]:
    """Within a checkpointed function: its first pass runs as it is, and a later one (the backward's recompute of
    the same inputs) leaves out QK-Clip's max-logit measurement (MLA's track_max_logit), which would measure the
    same logits again at the cost of a second set of fp32 matmuls, and KDA's gate figures (track_gates)."""
    passes.append(None)
    tracking = [name for name in MEASUREMENTS if getattr(mixer, name, False)]
    if len(passes) == 1 or not tracking:
        yield
        return
    for name in tracking:
        setattr(mixer, name, False)
    try:
        yield
    finally:
        for name in tracking:
            setattr(mixer, name, True)


MEASUREMENTS = ("track_max_logit", "track_gates")  # what a mixer measures in a training forward


class Block(nn.Module):
    def __init__(self, config: KimiK3Config, layer_idx: int) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.checkpointing = "none"  # set_activation_checkpointing (module docstring)
        self.residual_stats = WindowStats()  # the output's RMS over the training forwards since the last read
        self.track_residual = True  # the health panel's (KimiK3.set_health_tracking)
        self.attn_res_block_size = c.attn_res_block_size
        self.branch_multiplier = mup.branch_multiplier(c)  # 1 but under mup without attention residuals
        self.mixer_type = c.layer_pattern[layer_idx]
        self.mixer_norm = RMSNorm(c.d_model, eps=c.norm_eps)
        if self.mixer_type == "kda":
            self.mixer = KimiDeltaAttention(
                c.d_model,
                c.kda_n_heads,
                c.kda_head_dim,
                conv_size=c.kda_conv_size,
                implementation=c.kda_implementation,
                chunk_size=c.kda_chunk_size,
                gate=c.kda_gate,
                norm_eps=c.norm_eps,
                output_gate=c.kda_output_gate,
                output_gate_bias=c.kda_output_gate_bias,
                gate_lower_bound=c.kda_gate_lower_bound,
                qk_norm_eps=c.kda_qk_norm_eps,
            )
        else:
            self.mixer = MultiHeadLatentAttention(
                c.d_model,
                c.mla_n_heads,
                c.kv_lora_rank,
                c.qk_nope_head_dim,
                c.qk_rope_head_dim,
                c.v_head_dim,
                q_lora_rank=c.q_lora_rank,
                rope=c.mla_rope,
                rope_theta=c.rope_theta,
                max_seq_len=c.max_seq_len,
                norm_eps=c.norm_eps,
                output_gate=c.mla_output_gate,
                latent_norm_eps=c.mla_latent_norm_eps,
            )
        self.ffn_norm = RMSNorm(c.d_model, eps=c.norm_eps)
        activation = dict(activation=c.ffn_activation, situ_beta=c.situ_beta, situ_linear_beta=c.situ_linear_beta)
        if c.is_moe_layer(layer_idx):
            self.ffn: nn.Module = MoE(
                c.d_model,
                c.n_routed_experts,
                c.experts_per_token,
                c.expert_ffn_dim,
                n_shared_experts=c.n_shared_experts,
                routed_scaling_factor=c.routed_scaling_factor,
                balancing=c.router,
                aux_free_bias_rate=c.aux_free_bias_rate,
                latent_dim=c.expert_latent_dim,
                norm_eps=c.norm_eps,
                expert_implementation=c.expert_implementation,
                **activation,
            )
        else:
            self.ffn = SwiGLU(c.d_model, c.dense_ffn_dim, **activation)
        if c.attn_res_block_size is not None:  # the released checkpoint's names; layer 0's attention mix is unused
            self.self_attention_res_norm = RMSNorm(c.d_model, eps=c.norm_eps)
            self.self_attention_res_proj = nn.Linear(c.d_model, 1, bias=False)
            self.mlp_res_norm = RMSNorm(c.d_model, eps=c.norm_eps)
            self.mlp_res_proj = nn.Linear(c.d_model, 1, bias=False)
            if layer_idx == 0:  # nothing to mix before the first layer: kept for the layout, never trained (no
                # gradient would reach them; DDP would wait for one)
                self.self_attention_res_norm.weight.requires_grad_(False)
                self.self_attention_res_proj.weight.requires_grad_(False)

    @property
    def starts_block(self) -> bool:
        """With attention residuals: this layer begins a block, so its input joins `blocks` (module docstring)."""
        return self.attn_res_block_size is not None and self.layer_idx % self.attn_res_block_size == 0

    def forward(
        self, x: torch.Tensor, blocks: tuple[torch.Tensor, ...] = (), documents: Documents | None = None
    ) -> torch.Tensor:
        """x [B, T, d] the previous layer's output (the embedding at layer 0) -> this layer's output [B, T, d].

        blocks: with attention residuals, the finished blocks' sums before this layer, the embedding first (the
        caller appends x after a layer that starts_block). Without: unused, the output is x + f(x).
        documents: the documents in each row, the forward's one Documents, for the mixer (module docstring); None:
        one per row."""

        out = self._checkpointed_forward(x, blocks, documents)
        if self.training and self.track_residual:  # outside the checkpointed function: never in the recompute
            dtype = torch.promote_types(out.dtype, torch.float32)  # a bf16 stream summed in fp32
            mean_square = torch.linalg.vector_norm(out.detach(), dtype=dtype).square() / out.numel()
            self.residual_stats.mean("rms", mean_square)
        return out

    def _checkpointed_forward(
        self, x: torch.Tensor, blocks: tuple[torch.Tensor, ...], documents: Documents | None
    ) -> torch.Tensor:
        def mixer(y: torch.Tensor) -> torch.Tensor:
            return self.mixer(y, documents)

        if self.checkpointing == "block" and torch.is_grad_enabled():
            routes: dict = {}  # the experts the forward chose, for the recompute to replay (MoE.route)
            passes: list[None] = []  # one per run: a second is checkpoint's recompute

            def run(h: torch.Tensor, *bs: torch.Tensor) -> torch.Tensor:
                with replayed_routes(self.ffn, routes), measured_once(self.mixer, passes):
                    return self._forward(h, bs, mixer)

            return checkpoint(run, x, *blocks, use_reentrant=False)
        if self.checkpointing == "selective" and torch.is_grad_enabled():
            passes = []

            def recomputed_mixer(y: torch.Tensor) -> torch.Tensor:
                with measured_once(self.mixer, passes):
                    return self.mixer(y, documents)

            return self._forward(x, blocks, lambda y: checkpoint(recomputed_mixer, y, use_reentrant=False))
        return self._forward(x, blocks, mixer)

    def forward_cached(
        self, x: torch.Tensor, cache: KDAState | MLACache, blocks: tuple[torch.Tensor, ...] = ()
    ) -> torch.Tensor:
        """forward() for the next positions after those `cache` has seen (updated in place); blocks are over depth
        for the same positions, so they need no cache."""
        return self._forward(x, blocks, lambda y: self.mixer.forward_cached(y, cache))

    def _forward(
        self, h: torch.Tensor, blocks: tuple[torch.Tensor, ...], mixer: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        if self.attn_res_block_size is None:
            if self.branch_multiplier != 1.0:
                h = h + self.branch_multiplier * mixer(self.mixer_norm(h))
                return h + self.branch_multiplier * self._ffn(self.ffn_norm(h))
            h = h + mixer(self.mixer_norm(h))
            return h + self._ffn(self.ffn_norm(h))
        x = self._mix(blocks + (h,), self.self_attention_res_norm, self.self_attention_res_proj) if blocks else h
        attn = mixer(self.mixer_norm(x))
        if self.starts_block:
            blocks = blocks + (h,)  # h: the embedding, or the sum of the block just finished
            s = attn.to(h.dtype)  # the new block's sum starts here, in the stream's dtype (autocast: not bf16)
        else:
            s = h + attn
        return s + self._ffn(self.ffn_norm(self._mix(blocks + (s,), self.mlp_res_norm, self.mlp_res_proj)))

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The FFN under selective checkpointing: a dense one recomputed whole, a MoE's routed experts alone."""
        selective = self.checkpointing == "selective"
        if isinstance(self.ffn, MoE):
            return self.ffn(x, checkpoint_experts=selective)
        if selective and torch.is_grad_enabled():
            return checkpoint(self.ffn, x, use_reentrant=False)
        return self.ffn(x)

    @staticmethod
    def _mix(sources: tuple[torch.Tensor, ...], norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
        return attn_res_mix(sources, norm.weight, proj.weight, norm.eps)

    def empty_cache(self, batch: int, capacity: int, device: torch.device, dtype: torch.dtype) -> KDAState | MLACache:
        if self.mixer_type == "kda":
            return self.mixer.empty_state(batch, device, dtype)
        return self.mixer.empty_cache(batch, capacity, device, dtype)


class KimiK3(nn.Module):
    log_label = ""
    config_class = KimiK3Config  # what from_fields builds: k3train/config_targets.py checks a run's model.* by it

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__()
        if config.vocab_size is None:
            raise ValueError(
                "KimiK3 needs config.vocab_size; vocab_size=null is filled in from the dataset by the "
                "entry point, so set it when building the model directly"
            )
        self.config = config
        self.output_multiplier = mup.output_multiplier(config)  # the logits' (1 but under mup)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if config.attn_res_block_size is not None:  # the mix before the final norm (the released names)
            self.output_attn_res_norm = RMSNorm(config.d_model, eps=config.norm_eps)
            self.output_attn_res_proj = nn.Linear(config.d_model, 1, bias=False)
        if self.embed_tokens.weight.device.type != "meta":  # built whole here: drawn as any layout draws it
            fill(self, InitialWeights(self.init_rules(), torch.initial_seed()))

    def pipeline_stage(self, first: int, last: int) -> KimiK3Stage:
        """Layers [first, last) as a pipeline stage (k3train/models/k3/pipeline.py; the Pipelines protocol)."""
        return KimiK3Stage(self, first, last)

    def parallelize(self, dims, fully_shard) -> dict:
        """Spread over a run's ranks (k3train/models/k3/parallelize.py; the Parallelizes protocol)."""
        return parallelize_k3(self, dims, fully_shard)

    def parametrization_base(self) -> nn.Module | None:
        """Under mup the family's base on the meta device (k3train/models/k3/mup.py), else None (the
        HasParametrizationBase protocol)."""
        return mup.base_model(type(self), self.config)

    def set_activation_checkpointing(self, mode: str) -> None:
        """mode: none | block | selective (module docstring); in effect for passes that build a graph."""
        if mode not in CHECKPOINTING:
            raise ValueError(f"activation checkpointing {mode!r} must be one of {CHECKPOINTING}")
        for layer in self.layers:
            layer.checkpointing = mode

    @classmethod
    def from_fields(cls, **fields) -> KimiK3:
        """The Hydra target: conf/model/k3_*.yaml list KimiK3Config's fields flat."""
        return cls(KimiK3Config(**fields))

    def init_rules(self) -> dict[str, Rule]:
        """How every tensor of the state dict starts (drawn by counter, the same under any layout:
        k3train/models/common/init.py). Normal(init_std) for embeddings and linear maps (as nanoGPT and FLA's models
        do); the projections that write into the residual stream (attention outputs, FFN down projections) get
        init_std / sqrt(2 n_layers) so the residual's variance does not grow with depth (GPT-2). Norms start at 1,
        biases and the MoE's balancing bias at 0. KDA's own parameters that are not linear maps (A_log, dt_bias,
        the short convolutions) start as its layer draws them (its init_rules). The attention residuals' [1, d]
        query projections (`*_res_proj`) are linear maps too: Normal(init_std), as the reference initialises them
        (not zeros, which would start every mix uniform). Under mup every matrix but the embedding and LM head has
        its std scaled by mup.init_scale against the family's base, and n_layers is the base depth.
        https://github.com/karpathy/nanoGPT/blob/3adf61e154c3fe3fca428ad6bc3818b27a3b8291/model.py
        https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/models/kda/modeling_kda.py
        """
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * mup.residual_init_depth(self.config))
        shapes = {name: tuple(t.shape) for name, t in self.state_dict().items()}
        base = mup.base_model(type(self), self.config)
        bases = shapes if base is None else {name: tuple(t.shape) for name, t in base.state_dict().items()}

        def normal(name: str, std: float) -> Normal:
            return Normal(std * mup.init_scale(shapes[name], bases[name]))

        rules: dict[str, Rule] = {"embed_tokens.weight": Normal(std)}
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and module.weight is not self.embed_tokens.weight:
                is_residual = name.endswith(("o_proj", "w_down", "latent_up"))
                is_head = name == "lm_head"  # scaled by the output multiplier instead
                weight = f"{name}.weight"
                rules[weight] = Normal(std) if is_head else normal(weight, residual_std if is_residual else std)
                if module.bias is not None:
                    rules[f"{name}.bias"] = ZERO
            elif isinstance(module, RoutedExperts):
                rules |= {f"{name}.{w}": normal(f"{name}.{w}", std) for w in ("w_gate", "w_up")}
                rules[f"{name}.w_down"] = normal(f"{name}.w_down", residual_std)
            elif isinstance(module, nn.RMSNorm):
                rules[f"{name}.weight"] = ONE
            elif isinstance(module, MoE):
                rules[f"{name}.expert_bias"] = ZERO
        return rules | declared_rules(self)  # KDA's own

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        target_losses: TargetLosses | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """x [B, T] token ids -> (logits [B, T, V], None); with targets [B, T] -> (None, the mean next-token
        cross-entropy over all B*T positions in fp32) (targets are already shifted: targets[:, t] follows x[:, t]).
        document_ids [B, T] (k3train/models/common/documents.py): the documents packed in each row, each then seen as if
        alone (module docstring), read by every layer from one Documents built here; None: each row is one sequence.
        The loss still averages over every position.

        With targets the logits are never built whole: linear_cross_entropy (k3train/models/common/loss.py) runs the LM
        head and the loss together over row chunks, the same matmuls as lm_head + F.cross_entropy; target_losses:
        each target's loss added to it (a mixture's loss per source)."""
        documents = None if document_ids is None else Documents(document_ids, self._context_parallel())
        h = self.embed_tokens(x)
        blocks: tuple[torch.Tensor, ...] = ()
        for layer in self.layers:
            h, blocks = layer(h, blocks, documents), self._blocks_after(layer, h, blocks)
        h = self._head_input(h, blocks)
        if targets is None:
            return self.lm_head(h), None
        loss = linear_cross_entropy(
            h.flatten(0, 1), self.lm_head.weight, targets.flatten(), target_losses=target_losses
        )
        return None, loss

    def _context_parallel(self) -> ContextParallel | None:
        """The group the mixers split the sequence over (set_context_parallel hands every one the same), or None."""
        return next((layer.mixer.context_parallel for layer in self.layers), None)

    def empty_cache(self, batch: int, capacity: int) -> list[KDAState | MLACache]:
        """One decoding cache per layer for `batch` sequences of up to `capacity` positions (prompt + new tokens):
        a fixed-size KDAState for a KDA layer, an MLACache of the latent for an MLA layer (models/k3/cache.py)."""
        weight = self.embed_tokens.weight
        return [layer.empty_cache(batch, capacity, weight.device, weight.dtype) for layer in self.layers]

    def forward_cached(self, x: torch.Tensor, cache: list[KDAState | MLACache]) -> torch.Tensor:
        """x [B, T] the next T tokens after those `cache` has seen (updated in place) -> logits [B, T, V].

        Equal to forward()'s logits at those positions: a prompt goes in at once, then one token at a time."""
        h = self.embed_tokens(x)
        blocks: tuple[torch.Tensor, ...] = ()
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h, blocks = layer.forward_cached(h, layer_cache, blocks), self._blocks_after(layer, h, blocks)
        return self.lm_head(self._head_input(h, blocks))

    @staticmethod
    def _blocks_after(layer: Block, h: torch.Tensor, blocks: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """blocks after `layer`, given its input h: h joins them when the layer starts a block. Kept here, not
        returned by the Block: under FSDP2 a module that returns (a view of) its own input draws a warning."""
        return blocks + (h,) if layer.starts_block else blocks

    def _head_input(self, h: torch.Tensor, blocks: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """What the LM head reads: the final norm of the last layer's output (mixed), times the output multiplier."""
        h = self.norm(self._output_mix(h, blocks))
        return h * self.output_multiplier if self.output_multiplier != 1.0 else h

    def _output_mix(self, h: torch.Tensor, blocks: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The last layer's output h, or with attention residuals its mix with the finished blocks."""
        if self.config.attn_res_block_size is None:
            return h
        return Block._mix(blocks + (h,), self.output_attn_res_norm, self.output_attn_res_proj)

    def check_data(self, vocab_size: int, seq_len: int) -> None:
        """Raise ValueError if data with this vocabulary and sequence length cannot train this model.

        No chunk-alignment rule: the KDA chunk path pads the last chunk itself (k3train/models/kda/chunk.py),
        so any seq_len <= max_seq_len works with every kda_implementation.
        """
        c = self.config
        if vocab_size != c.vocab_size:
            raise ValueError(
                f"the data's vocab_size is {vocab_size} but the model's is {c.vocab_size}: set "
                f"model.vocab_size=null (take it from the data) or {vocab_size}"
            )
        if seq_len > c.max_seq_len:
            raise ValueError(
                f"seq_len={seq_len} exceeds the model's max_seq_len={c.max_seq_len}: lower seq_len "
                f"or raise model.max_seq_len"
            )

    def moe_layers(self) -> dict[int, MoE]:
        return {i: layer.ffn for i, layer in enumerate(self.layers) if isinstance(layer.ffn, MoE)}

    def set_health_tracking(self, on: bool) -> None:
        """Whether training forwards measure the KDA gates and the residual stream (on by default: cheap enough to
        leave on, benchmarks/bench_health.py); the routers' load is counted either way (balancing needs it)."""
        for layer in self.layers:
            layer.track_residual = on
            if layer.mixer_type == "kda":
                layer.mixer.track_gates = on

    def diagnostics(self) -> dict[str, float]:
        """The health panel over the training forwards since the last call: per MoE layer the router's health
        (moe/<layer>/<stat>: the last pass's load spread, and the window's load CV, dead-expert share and bias
        drift), per KDA layer its gates (kda/<layer>/<stat>), per layer the residual stream's RMS after it
        (residual/<layer>/rms, its mean square averaged over the window's forwards). The MLA max logits per head are
        reported by the QK-Clip callback (k3train/optim/qk_clip.py), which consumes them after each update."""
        out: dict[str, float] = {}
        for i, layer in enumerate(self.layers):
            if isinstance(layer.ffn, MoE):
                out.update({f"moe/{i}/{k}": v for k, v in layer.ffn.diagnostics().items()})
            if layer.mixer_type == "kda":
                out.update({f"kda/{i}/{k}": v for k, v in layer.mixer.gate_diagnostics().items()})
            if residual := layer.residual_stats.read():
                out[f"residual/{i}/rms"] = math.sqrt(residual["rms"])
        return out

    def param_counts(self) -> dict[str, int]:
        """total: every parameter once (a tied lm_head is not counted twice); active: what one token uses
        (experts_per_token of the routed experts, plus everything else); embedding: the input embedding table."""
        total = sum(p.numel() for p in self.parameters())
        idle = 0
        for moe in self.moe_layers().values():
            # numel / E, not w[0].numel(): indexing an FSDP2-sharded stack is a collective (rank 0 calls this)
            per_expert = sum(
                w.numel() // w.shape[0] for w in (moe.experts.w_gate, moe.experts.w_up, moe.experts.w_down)
            )
            idle += (moe.n_experts - moe.k) * per_expert
        return {"total": total, "active": total - idle, "embedding": self.embed_tokens.weight.numel()}

    def flops_per_token(self, seq_len: int) -> dict[str, float]:
        """FLOPs per token at this sequence length, "forward" and "training" (k3train/models/k3/flops.py)."""
        return flops_per_token(self.config, seq_len)

    def plan_costs(self) -> K3Costs:
        """The costs k3train/plan sizes a run with beyond the shapes (k3train/models/k3/costs.py; PlansCosts)."""
        return K3Costs()
