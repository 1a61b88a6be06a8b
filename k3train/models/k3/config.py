"""KimiK3Config: every field that shapes a Kimi K3-style model, validated when built.

The model YAMLs in conf/model/ list these fields flat under `_target_: k3train.models.k3.KimiK3.from_fields`.
`vocab_size: null` means "take it from the dataset": the entry point fills it in before the model is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction

from k3train.models.common.situ import ACTIVATIONS as FFN_ACTIVATIONS
from k3train.models.k3.moe import BALANCING as ROUTERS
from k3train.models.k3.moe import EXPERT_IMPLEMENTATIONS
from k3train.models.kda.layer import GATES as KDA_GATES
from k3train.models.kda.layer import IMPLEMENTATIONS as KDA_IMPLEMENTATIONS
from k3train.models.kda.layer import OUTPUT_GATES as KDA_OUTPUT_GATES

LAYER_TYPES = ("kda", "mla")
PARAMETRIZATIONS = ("standard", "mup")
# The fields a family scales with d_model under mup (heads at a fixed head width): the base model has them all
# scaled by mup_base_width / d_model (k3train/models/k3/mup.py).
WIDTH_FIELDS = (
    "mla_n_heads",
    "kda_n_heads",
    "kv_lora_rank",
    "q_lora_rank",
    "expert_ffn_dim",
    "dense_ffn_dim",
    "expert_latent_dim",
)
# Fields that change how a model trains or runs, not what its weights mean.
TRAINING_ONLY = (
    "kda_implementation",
    "kda_chunk_size",
    "expert_implementation",
    "router",
    "aux_free_bias_rate",
    "init_std",
    "max_seq_len",
)


@dataclass
class KimiK3Config:
    """A KDA + MLA hybrid with a sigmoid-routed MoE (Kimi Linear / DeepSeek-V3 lineage).

    Layer pattern: either `kda_mla_ratio` ("a:b": groups of a KDA layers then b MLA layers, MLA closing each
    group; a trailing partial group keeps its MLA layers last, as Kimi-Linear-48B's 27 layers put MLA at 27)
    or an explicit `layer_types` list, not both. "0:1" is an all-MLA model.
    """

    model_type: str = "kimi_k3"
    vocab_size: int | None = None  # None until the entry point fills it from the data
    d_model: int = 128
    n_layers: int = 4
    kda_mla_ratio: str | None = "3:1"
    layer_types: list[str] | None = None
    max_seq_len: int = 512
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02

    # MLA (DeepSeek-V3 latent attention; NoPE by default as in Kimi Linear)
    mla_n_heads: int = 4
    q_lora_rank: int | None = None  # None: q = W_q x, no query compression
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    mla_rope: bool = False
    rope_theta: float = 10000.0

    # KDA (Kimi Delta Attention)
    kda_n_heads: int = 4
    kda_head_dim: int = 32
    kda_conv_size: int = 4
    kda_implementation: str = "chunk"
    kda_chunk_size: int = 64
    kda_gate: str = "softplus"

    # MoE FFN (dense SwiGLU in the first `first_k_dense` layers)
    n_routed_experts: int = 8
    experts_per_token: int = 2
    n_shared_experts: int = 1
    expert_ffn_dim: int = 128
    first_k_dense: int = 1
    dense_ffn_dim: int = 512
    router: str = "quantile_balancing"
    routed_scaling_factor: float = 1.0
    aux_free_bias_rate: float = 1e-3
    # how the routed experts' matmuls run (moe/experts.py): "auto" (grouped_mm for bf16 on CUDA, else loop)
    expert_implementation: str = "auto"

    # Kimi K3's components; each at its default is the Kimi Linear form.
    attn_res_block_size: int | None = None  # attention residuals over blocks of this many layers; None: x + f(x)
    ffn_activation: str = "swiglu"  # every FFN (dense, shared, routed): "swiglu" | "situ"
    situ_beta: float = 4.0  # SiTU's gate branch: beta * tanh(g / beta) * sigmoid(g)
    situ_linear_beta: float = 25.0  # SiTU's up branch: linear_beta * tanh(u / linear_beta)
    expert_latent_dim: int | None = None  # latent MoE: routed experts at this width; None: at d_model
    mla_output_gate: bool = False  # sigmoid(g_proj x) times the attention output, before o_proj
    mla_latent_norm_eps: float | None = None  # q_a_norm and kv_a_norm (K3: 1e-6); None: norm_eps
    kda_output_gate: str = "low_rank"  # "low_rank" (g_a -> g_b) | "full_rank" (one g_proj, no bias)
    # low_rank's g_b_proj bias: None = with one for low_rank (FLA's layer, k3train's before the field), none for
    # full_rank; false = Kimi Linear as released (transformers' kimi_linear has none)
    kda_output_gate_bias: bool | None = None
    kda_gate_lower_bound: float = -5.0  # the sigmoid gate's log decay lies in (lower bound, 0)
    kda_qk_norm_eps: float = 1e-6  # q and k are x / sqrt(sum x^2 + eps), as FLA's kernel normalises them

    # How the init, the forward's multipliers and each tensor's learning rate depend on width and depth
    # (k3train/models/k3/mup.py): "standard", or "mup", under which the best lr of a family (the widths and depths
    # of one shape, heads scaled at a fixed head width) stays where it was found at the base width and depth.
    parametrization: str = "standard"
    mup_base_width: int = 128  # the d_model the family's lr was tuned at (k3_tiny's)
    mup_base_depth: int = 4  # the n_layers it was tuned at

    def __post_init__(self) -> None:
        if self.model_type != "kimi_k3":
            raise ValueError(f"model_type={self.model_type!r}: KimiK3Config only builds 'kimi_k3'")
        if self.vocab_size is not None:
            _positive(self, "vocab_size")
        for name in (
            "d_model",
            "n_layers",
            "max_seq_len",
            "mla_n_heads",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "v_head_dim",
            "kda_n_heads",
            "kda_head_dim",
            "kda_conv_size",
            "kda_chunk_size",
            "n_routed_experts",
            "experts_per_token",
            "expert_ffn_dim",
            "dense_ffn_dim",
        ):
            _positive(self, name)
        for name in ("attn_res_block_size", "expert_latent_dim"):
            if getattr(self, name) is not None:
                _positive(self, name)
        _choice(self, "ffn_activation", FFN_ACTIVATIONS)
        _choice(self, "parametrization", PARAMETRIZATIONS)
        _positive(self, "mup_base_width")
        _positive(self, "mup_base_depth")
        _choice(self, "kda_output_gate", KDA_OUTPUT_GATES)
        if self.kda_output_gate == "full_rank" and self.kda_output_gate_bias:
            raise ValueError("kda_output_gate_bias=true needs kda_output_gate=low_rank: the full-rank gate has no bias")
        for name in ("situ_beta", "situ_linear_beta", "kda_qk_norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.mla_latent_norm_eps is not None and not self.mla_latent_norm_eps > 0:
            raise ValueError(f"mla_latent_norm_eps={self.mla_latent_norm_eps} must be > 0 (or null: norm_eps)")
        if not self.kda_gate_lower_bound < 0:
            raise ValueError(f"kda_gate_lower_bound={self.kda_gate_lower_bound} must be < 0 (a log decay)")
        for name in ("qk_nope_head_dim", "n_shared_experts", "first_k_dense"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        for name in ("norm_eps", "init_std", "rope_theta", "routed_scaling_factor", "aux_free_bias_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.q_lora_rank is not None:
            _positive(self, "q_lora_rank")
        if self.mla_rope and self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim={self.qk_rope_head_dim} must be even when mla_rope=true (rotary pairs up channels)"
            )
        if self.kda_chunk_size & (self.kda_chunk_size - 1):
            raise ValueError(f"kda_chunk_size={self.kda_chunk_size} must be a power of two (16, 32, 64, ...)")
        _choice(self, "kda_implementation", KDA_IMPLEMENTATIONS)
        _choice(self, "kda_gate", KDA_GATES)
        _choice(self, "router", ROUTERS)
        _choice(self, "expert_implementation", EXPERT_IMPLEMENTATIONS)
        if self.experts_per_token >= self.n_routed_experts:
            raise ValueError(
                f"experts_per_token={self.experts_per_token} must be < n_routed_experts="
                f"{self.n_routed_experts}; lower experts_per_token or add experts"
            )
        if self.first_k_dense > self.n_layers:
            raise ValueError(f"first_k_dense={self.first_k_dense} exceeds n_layers={self.n_layers}")
        if self.layer_types is not None:
            # Hydra hands over a ListConfig; keep a plain list so the config stays picklable and JSON-able.
            self.layer_types = [str(t) for t in self.layer_types]
        _ = self.layer_pattern  # validates the pattern now rather than at model build
        if self.parametrization == "mup":
            _ = self.mup_base()  # every width field must scale to the base in whole numbers

    def mup_base(self) -> KimiK3Config:
        """The family's base under mup: this config at width mup_base_width, its own depth, parametrized as
        standard. Its tensors' shapes say which dims of each tensor grow with width."""
        try:
            return dataclasses.replace(self, parametrization="standard").at_width(self.mup_base_width)
        except ValueError as e:
            raise ValueError(f"parametrization=mup with mup_base_width={self.mup_base_width}: {e}") from None

    def at_width(self, d_model: int) -> KimiK3Config:
        """This config's family member at `d_model`: WIDTH_FIELDS scaled with it (heads at a fixed head width)."""
        ratio = Fraction(d_model, self.d_model)
        changes: dict = {"d_model": d_model}
        for name in WIDTH_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            scaled = value * ratio
            if scaled.denominator != 1:
                raise ValueError(
                    f"{name}={value} at d_model={self.d_model} scales to {float(scaled):g} at d_model={d_model}, "
                    f"not a whole number: a family scales every one of {', '.join(WIDTH_FIELDS)} with d_model, so "
                    "choose widths (and model.mup_base_width) a power of two apart"
                )
            changes[name] = int(scaled)
        return dataclasses.replace(self, **changes)

    @property
    def layer_pattern(self) -> list[str]:
        """The mixer of each layer, e.g. ['kda', 'kda', 'kda', 'mla'] for n_layers=4 and kda_mla_ratio='3:1'."""
        if self.layer_types is not None:
            if self.kda_mla_ratio is not None:
                raise ValueError(
                    "set either kda_mla_ratio or layer_types, not both: "
                    "use kda_mla_ratio=null with an explicit layer_types list"
                )
            if len(self.layer_types) != self.n_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries but n_layers={self.n_layers}; "
                    "give one entry per layer"
                )
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"layer_types contains {bad}; each entry must be one of {LAYER_TYPES}")
            return list(self.layer_types)
        if self.kda_mla_ratio is None:
            raise ValueError("no layer pattern: set kda_mla_ratio (e.g. '3:1') or layer_types")
        n_kda, n_mla = _parse_ratio(str(self.kda_mla_ratio))
        group = ["kda"] * n_kda + ["mla"] * n_mla
        full, rest = divmod(self.n_layers, len(group))
        tail_mla = min(rest, n_mla)
        return group * full + ["kda"] * (rest - tail_mla) + ["mla"] * tail_mla

    def architecture(self) -> dict:
        """What the weights mean, in one normal form: every field but those that change only training or speed
        (TRAINING_ONLY), the layer pattern spelled out, defaults resolved and settings of parts the model lacks
        dropped. Two configs with equal architectures hold each other's weights (train.init_from checks this)."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in TRAINING_ONLY}
        fields["layer_types"] = self.layer_pattern
        del fields["kda_mla_ratio"]
        if fields["mla_latent_norm_eps"] is None:
            fields["mla_latent_norm_eps"] = self.norm_eps
        if fields["kda_output_gate_bias"] is None:
            fields["kda_output_gate_bias"] = self.kda_output_gate == "low_rank"
        if self.kda_gate != "sigmoid":
            del fields["kda_gate_lower_bound"]
        if self.ffn_activation != "situ":
            del fields["situ_beta"], fields["situ_linear_beta"]
        if not self.mla_rope:
            del fields["rope_theta"]
        if self.parametrization == "standard":  # the base only matters under mup; older checkpoints lack all three
            del fields["parametrization"], fields["mup_base_width"], fields["mup_base_depth"]
        return fields

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense


def _parse_ratio(ratio: str) -> tuple[int, int]:
    parts = ratio.split(":")
    try:
        n_kda, n_mla = (int(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"kda_mla_ratio={ratio!r} must look like '3:1' (KDA layers : MLA layers "
            "per group); quote it in YAML, where an unquoted 3:1 reads as the base-60 integer 181"
        ) from None
    if n_kda < 0 or n_mla < 0 or n_kda + n_mla == 0:
        raise ValueError(f"kda_mla_ratio={ratio!r} needs non-negative counts with at least one layer per group")
    return n_kda, n_mla


def _positive(cfg: KimiK3Config, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def _choice(cfg: KimiK3Config, name: str, allowed: tuple[str, ...]) -> None:
    if getattr(cfg, name) not in allowed:
        raise ValueError(f"{name}={getattr(cfg, name)!r} must be one of {allowed}")
