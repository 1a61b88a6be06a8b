"""KimiK3: a Kimi Linear-style hybrid language model.

    tokens [B, T] -> embed_tokens -> n_layers x Block -> RMSNorm -> lm_head -> logits [B, T, V]
                                                                (with targets: -> lm_head + cross-entropy -> loss)

    Block:  x = x + mixer(RMSNorm(x))     mixer: KimiDeltaAttention (linear, recurrent state) or
                                                 MultiHeadLatentAttention (full causal softmax attention)
            x = x + ffn(RMSNorm(x))       ffn:   SwiGLU in the first `first_k_dense` layers, MoE after

The layer pattern (e.g. 3 KDA then 1 MLA, repeated) comes from KimiK3Config.layer_pattern.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from k3train.models.k3.cache import MLACache
from k3train.models.k3.config import KimiK3Config
from k3train.models.k3.flops import flops_per_token
from k3train.models.k3.mla import MultiHeadLatentAttention
from k3train.models.k3.moe import MoE, RoutedExperts, SwiGLU
from k3train.models.kda.layer import KimiDeltaAttention
from k3train.models.kda.state import KDAState
from k3train.models.loss import linear_cross_entropy
from k3train.models.norm import RMSNorm


class Block(nn.Module):
    def __init__(self, config: KimiK3Config, layer_idx: int) -> None:
        super().__init__()
        c = config
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
            )
        self.ffn_norm = RMSNorm(c.d_model, eps=c.norm_eps)
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
            )
        else:
            self.ffn = SwiGLU(c.d_model, c.dense_ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x))
        return x + self.ffn(self.ffn_norm(x))

    def forward_cached(self, x: torch.Tensor, cache: KDAState | MLACache) -> torch.Tensor:
        x = x + self.mixer.forward_cached(self.mixer_norm(x), cache)
        return x + self.ffn(self.ffn_norm(x))

    def empty_cache(self, batch: int, capacity: int, device: torch.device, dtype: torch.dtype) -> KDAState | MLACache:
        if self.mixer_type == "kda":
            return self.mixer.empty_state(batch, device, dtype)
        return self.mixer.empty_cache(batch, capacity, device, dtype)


class KimiK3(nn.Module):
    log_label = ""

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__()
        if config.vocab_size is None:
            raise ValueError(
                "KimiK3 needs config.vocab_size; vocab_size=null is filled in from the dataset by the "
                "entry point, so set it when building the model directly"
            )
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._init_weights()

    @classmethod
    def from_fields(cls, **fields) -> KimiK3:
        """The Hydra target: conf/model/k3_*.yaml list KimiK3Config's fields flat."""
        return cls(KimiK3Config(**fields))

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Normal(init_std) for embeddings and linear maps (as nanoGPT and FLA's models do); the projections that
        write into the residual stream (attention outputs, FFN down projections) get init_std / sqrt(2 n_layers) so
        the residual's variance does not grow with depth (GPT-2). Norms start at 1. KDA's own parameters that are
        not linear maps (A_log, dt_bias, convolutions) keep the initialisation its layer gives them.
        https://github.com/karpathy/nanoGPT/blob/3adf61e154c3fe3fca428ad6bc3818b27a3b8291/model.py
        https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/models/kda/modeling_kda.py
        """
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        nn.init.normal_(self.embed_tokens.weight, std=std)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and module.weight is not self.embed_tokens.weight:
                is_residual = name.endswith(("o_proj", "w_down"))
                nn.init.normal_(module.weight, std=residual_std if is_residual else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RoutedExperts):
                nn.init.normal_(module.w_gate, std=std)
                nn.init.normal_(module.w_up, std=std)
                nn.init.normal_(module.w_down, std=residual_std)

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """x [B, T] token ids -> (logits [B, T, V], None); with targets [B, T] -> (None, the mean next-token
        cross-entropy over all B*T positions in fp32) (targets are already shifted: targets[:, t] follows x[:, t]).

        With targets the logits are never built whole: linear_cross_entropy (k3train/models/loss.py) runs the LM
        head and the loss together over row chunks, the same matmuls as lm_head + F.cross_entropy."""
        h = self.embed_tokens(x)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        if targets is None:
            return self.lm_head(h), None
        return None, linear_cross_entropy(h.flatten(0, 1), self.lm_head.weight, targets.flatten())

    def empty_cache(self, batch: int, capacity: int) -> list[KDAState | MLACache]:
        """One decoding cache per layer for `batch` sequences of up to `capacity` positions (prompt + new tokens):
        a fixed-size KDAState for a KDA layer, an MLACache of the latent for an MLA layer (models/k3/cache.py)."""
        weight = self.embed_tokens.weight
        return [layer.empty_cache(batch, capacity, weight.device, weight.dtype) for layer in self.layers]

    def forward_cached(self, x: torch.Tensor, cache: list[KDAState | MLACache]) -> torch.Tensor:
        """x [B, T] the next T tokens after those `cache` has seen (updated in place) -> logits [B, T, V].

        Equal to forward()'s logits at those positions: a prompt goes in at once, then one token at a time."""
        h = self.embed_tokens(x)
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h = layer.forward_cached(h, layer_cache)
        return self.lm_head(self.norm(h))

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

    def diagnostics(self) -> dict[str, float]:
        """Router health per MoE layer (moe/<layer>/<stat>) from the last training pass. The MLA max logits are
        reported by the QK-Clip callback (k3train/optim/qk_clip.py), which consumes them after each update."""
        out: dict[str, float] = {}
        for i, moe in self.moe_layers().items():
            out.update({f"moe/{i}/{k}": v for k, v in moe.diagnostics().items()})
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
