"""DenseTransformer: a Llama-style dense decoder, the peer k3_small is measured against (conf/model/dense_peer.yaml).

    tokens [B, T] -> embed_tokens -> n_layers x Block -> RMSNorm -> lm_head -> logits [B, T, V]
                                                                (with targets: -> lm_head + cross-entropy -> loss)

    Block:  x = x + attn(RMSNorm(x))     causal multi-head softmax attention, RoPE on q and k
            x = x + ffn(RMSNorm(x))      SwiGLU: w_down(silu(w_gate x) * w_up x)

No KDA, no MLA, no MoE, none of Kimi K3's components: a model of the same active parameters built only from the
parts every GPU stack has fast kernels for (F.scaled_dot_product_attention and plain matmuls), so that a K3-shaped
model's step time over this one's is the cost of KDA, MLA and the MoE (benchmarks/gpu_train_step.py).

Its parts are k3train's own where it has them, all from models/common/ (the parts every model family shares):
RMSNorm (norm.py), the SwiGLU FFN (swiglu.py), the rotary embedding (attention.py, half-split pairing), the chunked
LM head + loss (loss.py), and the weight initialisation KimiK3 uses (Normal(init_std), residual-writing projections
scaled by 1 / sqrt(2 n_layers)). The attention projections declare a head split (param_layouts), so Muon
orthogonalises them per head as it does MLA's (k3train/optim/param_groups.py); there is no QK-Clip here (nothing
measures this attention's max logits).

Document masking (forward's document_ids, k3train/models/common/documents.py): attention is causal within each
document (block-diagonal causal: document_attention, models/common/attention.py, as MLA's), every layer reading one
Documents built by forward (its mask or tiles made once). RoPE scores depend only on the distance between two
positions, so a document packed after others gets the outputs it would get alone. Without document_ids each row is
one sequence and attention is plain F.scaled_dot_product_attention(is_causal=True).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3train.models.common.attention import RotaryEmbedding, document_attention
from k3train.models.common.documents import Documents
from k3train.models.common.init import ONE, InitialWeights, Normal, Rule, fill
from k3train.models.common.loss import TargetLosses, linear_cross_entropy
from k3train.models.common.norm import RMSNorm
from k3train.models.common.swiglu import SwiGLU
from k3train.models.layout import ParamLayout


@dataclass
class DenseConfig:
    model_type: str = "dense_transformer"
    vocab_size: int | None = None  # None until the entry point fills it from the data
    d_model: int = 512
    n_layers: int = 12
    n_heads: int = 8  # head_dim = d_model // n_heads
    ffn_dim: int = 1024  # SwiGLU hidden width
    max_seq_len: int = 4096  # the rotary table's length
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.model_type != "dense_transformer":
            raise ValueError(f"model_type={self.model_type!r}: DenseConfig only builds 'dense_transformer'")
        sizes = ["d_model", "n_layers", "n_heads", "ffn_dim", "max_seq_len"]
        if self.vocab_size is not None:
            sizes.append("vocab_size")
        for name in sizes:
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = d_model / n_heads = {self.head_dim} must be even: RoPE rotates channel pairs")
        for name in ("norm_eps", "rope_theta", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class CausalSelfAttention(nn.Module):
    """x [B, T, d] -> [B, T, d]: n_heads heads of head_dim = d / n_heads, RoPE on q and k, causal softmax."""

    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        d, H = config.d_model, config.n_heads
        self.n_heads, self.head_dim = H, config.head_dim
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.rotary = RotaryEmbedding(self.head_dim, config.max_seq_len, config.rope_theta)

    def param_layouts(self) -> dict[str, ParamLayout]:
        """Muon's per-head views (k3train/models/layout.py): rows [H*dh, d] for q, k, v; columns [d, H*dh] for o."""
        rows = {f"{name}.weight": ParamLayout(head_split=(self.n_heads, 0)) for name in ("q_proj", "k_proj", "v_proj")}
        return {**rows, "o_proj.weight": ParamLayout(head_split=(self.n_heads, 1))}

    def forward(self, x: torch.Tensor, documents: Documents | torch.Tensor | None = None) -> torch.Tensor:
        B, T, d = x.shape
        heads = (B, T, self.n_heads, self.head_dim)
        q = self.rotary(self.q_proj(x).view(heads)).transpose(1, 2)  # [B, H, T, dh]
        k = self.rotary(self.k_proj(x).view(heads)).transpose(1, 2)
        v = self.v_proj(x).view(heads).transpose(1, 2)
        if documents is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = document_attention(q, k, v, self.head_dim**-0.5, documents)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, d))


class Block(nn.Module):
    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ffn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.ffn = SwiGLU(config.d_model, config.ffn_dim)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), documents)
        return x + self.ffn(self.ffn_norm(x))


class DenseTransformer(nn.Module):
    log_label = ""
    config_class = DenseConfig  # what from_fields builds: k3train/config_targets.py checks a run's model.* by it

    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        if config.vocab_size is None:
            raise ValueError(
                "DenseTransformer needs config.vocab_size; vocab_size=null is filled in from the dataset by the "
                "entry point, so set it when building the model directly"
            )
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if self.embed_tokens.weight.device.type != "meta":  # built whole here: drawn as any layout draws it
            fill(self, InitialWeights(self.init_rules(), torch.initial_seed()))

    @classmethod
    def from_fields(cls, **fields) -> DenseTransformer:
        """The Hydra target: conf/model/dense_peer.yaml lists DenseConfig's fields flat."""
        return cls(DenseConfig(**fields))

    def init_rules(self) -> dict[str, Rule]:
        """KimiK3's scheme (k3train/models/k3/model.py), so neither model starts from a better-scaled place:
        Normal(init_std) for the embedding and every linear map, init_std / sqrt(2 n_layers) for the projections
        that write into the residual stream (o_proj, w_down; GPT-2); norms start at 1. Drawn by counter, the same
        under any layout (k3train/models/common/init.py)."""
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        rules: dict[str, Rule] = {"embed_tokens.weight": Normal(std)}
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and module.weight is not self.embed_tokens.weight:
                rules[f"{name}.weight"] = Normal(residual_std if name.endswith(("o_proj", "w_down")) else std)
            elif isinstance(module, nn.RMSNorm):
                rules[f"{name}.weight"] = ONE
        return rules

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        target_losses: TargetLosses | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """x [B, T] token ids -> (logits [B, T, V], None); with targets [B, T] (x shifted by one) -> (None, the
        mean next-token cross-entropy over all B*T positions in fp32), through linear_cross_entropy as KimiK3
        computes it (the logits never built whole; target_losses: each target's loss added to it). document_ids
        [B, T]: attention within each document."""
        documents = None if document_ids is None else Documents(document_ids)  # one for every layer
        h = self.embed_tokens(x)
        for layer in self.layers:
            h = layer(h, documents)
        h = self.norm(h)
        if targets is None:
            return self.lm_head(h), None
        loss = linear_cross_entropy(
            h.flatten(0, 1), self.lm_head.weight, targets.flatten(), target_losses=target_losses
        )
        return None, loss

    def check_data(self, vocab_size: int, seq_len: int) -> None:
        c = self.config
        if vocab_size != c.vocab_size:
            raise ValueError(
                f"the data's vocab_size is {vocab_size} but the model's is {c.vocab_size}: set "
                f"model.vocab_size=null (take it from the data) or {vocab_size}"
            )
        if seq_len > c.max_seq_len:
            raise ValueError(
                f"seq_len={seq_len} exceeds the model's max_seq_len={c.max_seq_len} (the rotary table's length): "
                "lower seq_len or raise model.max_seq_len"
            )

    def diagnostics(self) -> dict[str, float]:
        return {}  # no router, no gates: nothing to report beyond the loss

    def param_counts(self) -> dict[str, int]:
        """total: every parameter once (a tied lm_head is not counted twice); active: the same, every token uses
        every weight; embedding: the input embedding table."""
        total = sum(p.numel() for p in self.parameters())
        return {"total": total, "active": total, "embedding": self.embed_tokens.weight.numel()}

    def flops_per_token(self, seq_len: int) -> dict[str, float]:
        """FLOPs per token of a [*, seq_len] batch, with KimiK3's conventions (k3train/models/k3/flops.py): every
        matmul at 2 FLOPs per multiply-add, attention over all seq_len x seq_len pairs (causal or not, as PaLM and
        torch.utils.flop_counter count it), training = 3 x forward; norms, RoPE, activations and softmax not
        counted."""
        c = self.config
        projections = 4 * c.d_model * c.d_model  # q, k, v, o: n_heads * head_dim == d_model
        attention = seq_len * c.n_heads * 2 * c.head_dim  # q.k over seq_len keys, then p.v, per head
        ffn = 3 * c.d_model * c.ffn_dim
        macs = c.n_layers * (projections + attention + ffn) + c.d_model * c.vocab_size  # + the LM head
        forward = 2.0 * macs
        return {"forward": forward, "training": 3.0 * forward}
