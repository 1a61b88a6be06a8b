"""KimiK3Config <-> a Hugging Face config.json, in one of two layouts:

- `kimi_linear`: transformers' KimiLinearConfig (model_type "kimi_linear"), the form Moonshot's Kimi Linear release
  uses; for a model with none of Kimi K3's components.
- `kimi_k3`: the released Kimi K3 (model_type "kimi_k3", the text model's fields under `text_config`, 1-based layer
  lists in `linear_attn_config`); for a model with any of them. transformers has no such model type: `auto_map`
  names the code the export carries for trust_remote_code=True (hf_remote/, which reads these fields by name).

`to_hf_config` refuses, naming the field, what the layout cannot say; `from_hf_config` refuses, naming the HF field,
what k3train cannot build. Constants both consumers hard-code are checked, not written: the MLA latent norms' eps
(1e-6) and the KDA q/k L2-norm eps (1e-6, FLA's kernel). A field config.json leaves out is read as that layout's
consumer reads it (ABSENT: transformers' KimiLinearConfig for kimi_linear, the released Kimi K3 config.json for
kimi_k3, whose values NVIDIA Automodel's KimiK3TextConfig takes as its defaults) or refused naming it, never given
another family's default. Sources: transformers' configuration_kimi_linear.py (5.24), NVIDIA-NeMo/Automodel's
kimi_k3 config.py and model.py, and the released config.json as llama.cpp's conversion/kimi_k3.py quotes it,
https://github.com/huggingface/transformers/blob/main/src/transformers/models/kimi_linear/configuration_kimi_linear.py
https://github.com/NVIDIA-NeMo/Automodel/tree/main/nemo_automodel/components/models/kimi_k3
"""

from __future__ import annotations

from typing import Any

from k3train.hf import HFFormatError
from k3train.models.k3 import mup
from k3train.models.k3.config import KimiK3Config

LAYOUTS = ("kimi_linear", "kimi_k3")
# transformers has no kimi_k3: a kimi_k3 export carries its own code (hf_remote/, which the writer copies beside the
# weights), loaded with trust_remote_code=True through these classes
AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k3.KimiK3Config",
    "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForCausalLM",
}
FIXED_EPS = 1e-6  # MLA q_a/kv_a layernorms and the KDA q/k L2 norm, as both consumers hard-code them
# Kimi K3's components at their Kimi Linear values: a model with all of these is written as kimi_linear.
KIMI_LINEAR_FORM = {
    "attn_res_block_size": None,
    "ffn_activation": "swiglu",
    "expert_latent_dim": None,
    "mla_output_gate": False,
    "kda_output_gate": "low_rank",
    "kda_gate": "softplus",
}


class Refused(str):
    """ABSENT's mark for a field a config.json must give: the refusal names it and says why (this text)."""


# What each layout's reader takes for a field config.json leaves out (names as the writer spells them; the reader
# also takes the aliases noted in from_hf_config). kimi_linear: transformers' KimiLinearConfig (5.24) defaults, what
# AutoModelForCausalLM builds. kimi_k3: the released Kimi K3 config.json's values, which Automodel's KimiK3TextConfig
# also defaults to; Refused for a size only the release's own shape has (q_lora_rank 1536, routed_expert_hidden_size
# 3584, 96 KDA heads of 128) and for the two fields whose absence Automodel reads as Kimi Linear's form, not the
# release's (model.py: a linear_attn_config without use_full_rank_gate builds the low-rank output gate, without
# gate_lower_bound the softplus decay). docs/huggingface.md lists the table.
ABSENT: dict[str, dict[str, Any]] = {
    "kimi_linear": {
        "hidden_act": "silu",
        "q_lora_rank": None,
        "routed_expert_hidden_size": None,
        "latent_moe_use_norm": True,
        "mla_use_output_gate": False,
        "attn_res_block_size": None,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.446,
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "linear_attn_config.num_heads": 32,
        "linear_attn_config.head_dim": 128,
        "linear_attn_config.short_conv_kernel_size": 4,
        "linear_attn_config.use_full_rank_gate": False,
        "linear_attn_config.gate_lower_bound": None,
    },
    "kimi_k3": {
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "q_lora_rank": Refused("null: no query compression; the release's 1536 fits only its own width"),
        "routed_expert_hidden_size": Refused("null: experts at hidden_size; the release's 3584 fits only its width"),
        "latent_moe_use_norm": True,
        "mla_use_output_gate": True,
        "attn_res_block_size": 12,
        "num_shared_experts": 2,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.0,
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "linear_attn_config.num_heads": Refused("the release's 96 KDA heads fit only its own width"),
        "linear_attn_config.head_dim": Refused("the release's KDA head dim 128 fits only its own width"),
        "linear_attn_config.short_conv_kernel_size": 4,
        "linear_attn_config.use_full_rank_gate": Refused(
            "without it Automodel builds the low-rank output gate, the release the full-rank one"
        ),
        "linear_attn_config.gate_lower_bound": Refused(
            "null: the softplus decay; without it Automodel builds that, the release's bound is -5.0"
        ),
    },
}
# Both layouts, both readers: num_key_value_heads = num_attention_heads, and the routing and attention k3train builds
ABSENT_BOTH = {
    "mla_use_nope": True,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "attention_bias": False,
}
for _table in ABSENT.values():
    _table.update(ABSENT_BOTH)
# Fields transformers' kimi_linear never reads (it builds their Kimi Linear value whatever they say): a kimi_linear
# config.json giving another value describes a model transformers would not build, so it is refused.
KIMI_LINEAR_IGNORES = (
    "routed_expert_hidden_size",
    "mla_use_output_gate",
    "attn_res_block_size",
    "linear_attn_config.use_full_rank_gate",
    "linear_attn_config.gate_lower_bound",
)


class NotExpressible(HFFormatError):
    """A setting one side has and the other cannot say."""


def layout_for(cfg: KimiK3Config) -> str:
    """kimi_linear for a model in Kimi Linear's form, kimi_k3 for one with any of Kimi K3's components."""
    return "kimi_linear" if all(getattr(cfg, k) == v for k, v in KIMI_LINEAR_FORM.items()) else "kimi_k3"


def to_hf_config(cfg: KimiK3Config, layout: str, eos_token_id: int | None, dtype: str) -> dict[str, Any]:
    """The config.json of `cfg` in `layout`; NotExpressible names the first field the layout cannot carry."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
    _check_common(cfg)
    pattern = cfg.layer_pattern
    text: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "intermediate_size": cfg.dense_ffn_dim,
        "moe_intermediate_size": cfg.expert_ffn_dim,
        "num_attention_heads": cfg.mla_n_heads,
        "num_key_value_heads": cfg.mla_n_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        # transformers' MLA convention (KimiLinearConfig, DeepseekV3Config): the rotary dim. Without it Automodel's
        # KimiK3TextConfig takes hidden_size // num_attention_heads, which RoPE validation refuses when odd (64 // 3)
        "head_dim": cfg.qk_rope_head_dim,
        "mla_use_nope": True,
        "num_experts": cfg.n_routed_experts,
        "num_experts_per_token": cfg.experts_per_token,
        "num_shared_experts": cfg.n_shared_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": cfg.first_k_dense,
        "moe_layer_freq": 1,
        "hidden_act": "situ" if cfg.ffn_activation == "situ" else "silu",
        "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        # both tensors are written: transformers' kimi_linear (5.24) does not tie them
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "pad_token_id": None,  # transformers' default (163839) is no valid id of a small vocabulary
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "linear_attn_config": {
            "head_dim": cfg.kda_head_dim,
            "num_heads": cfg.kda_n_heads,
            "short_conv_kernel_size": cfg.kda_conv_size,
            # 1-based, always written: without them transformers puts MLA at 0-based layers 4, 8, ...
            "kda_layers": [i + 1 for i, t in enumerate(pattern) if t == "kda"],
            "full_attn_layers": [i + 1 for i, t in enumerate(pattern) if t == "mla"],
        },
    }
    if layout == "kimi_linear":
        for name, value in KIMI_LINEAR_FORM.items():
            if getattr(cfg, name) != value:
                raise NotExpressible(
                    f"{name}={getattr(cfg, name)!r}: transformers' kimi_linear has only {value!r} (a Kimi K3 "
                    "component); write the kimi_k3 layout instead"
                )
        return {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            **text,
            "model_max_length": cfg.max_seq_len,
            "torch_dtype": dtype,
        }
    if cfg.experts_per_token == 1:  # K3's router renormalises only for k > 1; k3train always does
        raise NotExpressible("experts_per_token=1: Kimi K3's router leaves a single expert's weight unnormalised")
    if cfg.ffn_activation != "situ":  # Automodel's kimi_k3 never reads hidden_act; vLLM's refuses all but situ
        raise NotExpressible(
            f"ffn_activation={cfg.ffn_activation!r}: Kimi K3's code computes SiTU-GLU whatever hidden_act says; the "
            "kimi_k3 layout carries only ffn_activation=situ"
        )
    if cfg.qk_rope_head_dim % 2 and cfg.qk_rope_head_dim > 4:  # transformers' validate_rope, which Automodel runs
        raise NotExpressible(
            f"qk_rope_head_dim={cfg.qk_rope_head_dim} (head_dim): Kimi K3's config (a transformers PretrainedConfig "
            "with rope_theta) refuses an odd rotary dimension above 4"
        )
    text["model_type"] = "kimi_linear"  # the released text_config's own model_type
    text["max_position_embeddings"] = cfg.max_seq_len
    text["mla_use_output_gate"] = cfg.mla_output_gate
    text["linear_attn_config"]["use_full_rank_gate"] = cfg.kda_output_gate == "full_rank"
    # null selects the softplus gate (Automodel reads an absent one so too, but the release's is -5: the reader
    # refuses absence), a number the sigmoid gate with that bound
    sigmoid = cfg.kda_gate == "sigmoid"
    text["linear_attn_config"]["gate_lower_bound"] = cfg.kda_gate_lower_bound if sigmoid else None
    text["activation_situ_beta"] = cfg.situ_beta
    text["activation_situ_linear_beta"] = cfg.situ_linear_beta
    text["attn_res_block_size"] = cfg.attn_res_block_size
    text["routed_expert_hidden_size"] = cfg.expert_latent_dim
    text["latent_moe_use_norm"] = cfg.expert_latent_dim is not None
    text["topk_method"] = "noaux_tc"
    text["torch_dtype"] = dtype
    # both tensors are written either way; the flag says whether the model ties them (the release does not)
    text["tie_word_embeddings"] = cfg.tie_embeddings
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "auto_map": dict(AUTO_MAP),
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "text_config": text,
        "torch_dtype": dtype,
    }


def _check_common(cfg: KimiK3Config) -> None:
    if cfg.vocab_size is None:
        raise ValueError("vocab_size is unset: build the model from its data first")
    if mup.branch_multiplier(cfg) != 1.0:
        raise NotExpressible(
            f"parametrization=mup at n_layers={cfg.n_layers} != mup_base_depth={cfg.mup_base_depth} without attention "
            "residuals multiplies each residual branch, which the formats cannot say (the logits' multiplier is "
            "folded into the final norm; the branches' is not yet)"
        )
    if cfg.mla_rope:
        raise NotExpressible("mla_rope=true: Kimi Linear and Kimi K3 attention is NoPE (mla_use_nope)")
    latent_eps = cfg.mla_latent_norm_eps if cfg.mla_latent_norm_eps is not None else cfg.norm_eps
    if latent_eps != FIXED_EPS:
        raise NotExpressible(
            f"mla_latent_norm_eps={latent_eps:g} (effective): the MLA latent norms' eps is fixed at {FIXED_EPS:g}"
        )
    if cfg.kda_qk_norm_eps != FIXED_EPS:
        raise NotExpressible(f"kda_qk_norm_eps={cfg.kda_qk_norm_eps:g}: the KDA q/k L2 norm's eps is fixed at 1e-06")
    if cfg.kda_output_gate == "low_rank" and cfg.kda_output_gate_bias is not False:
        raise NotExpressible(
            "kda_output_gate_bias is not false: Kimi Linear's low-rank output gate has no bias (g_b_proj); "
            "train with kda_output_gate_bias=false (as kimi_linear_tiny and kimi_linear_small do)"
        )


def from_hf_config(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A config.json -> (layout, KimiK3Config fields); NotExpressible names the first HF field k3train cannot build,
    HFFormatError the first it needs and config.json lacks. A field left out is read as ABSENT says."""
    model_type = config.get("model_type")
    if model_type == "kimi_k3":
        layout, text = "kimi_k3", config.get("text_config")
        if not isinstance(text, dict):
            raise HFFormatError("model_type kimi_k3 without a text_config: not a Kimi K3 config.json")
    elif model_type == "kimi_linear":
        layout, text = "kimi_linear", config
    else:
        raise NotExpressible(f"model_type={model_type!r}: k3train reads kimi_linear and kimi_k3 configs")
    linear = text.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise HFFormatError("linear_attn_config is not an object: not a Kimi Linear or Kimi K3 config")
    get = _Reader(text, linear, layout)
    n_layers = get.required("num_hidden_layers")
    mla_heads = get.required("num_attention_heads")
    kv_heads = get("num_key_value_heads", default=mla_heads)  # both readers: num_attention_heads when absent
    _refuse(kv_heads != mla_heads, "num_key_value_heads", get, "must equal num_attention_heads")
    _refuse(get("mla_use_nope") is not True, "mla_use_nope", get, "k3train's MLA is NoPE only")
    _refuse(get("moe_renormalize", "norm_topk_prob") is not True, "moe_renormalize", get, "k3train renormalises")
    _refuse(get("moe_router_activation_func") != "sigmoid", "moe_router_activation_func", get, "sigmoid only")
    groups, topk_groups = get("num_expert_group", "n_group"), get("topk_group")
    _refuse(topk_groups < groups, "topk_group", get, f"below num_expert_group={groups}: group-limited routing")
    _refuse(get("moe_layer_freq") != 1, "moe_layer_freq", get, "every layer after the dense ones is MoE")
    _refuse(get("num_nextn_predict_layers") or 0, "num_nextn_predict_layers", get, "no multi-token prediction")
    _refuse(get("attention_bias"), "attention_bias", get, "k3train's attention has no biases")
    act = get("hidden_act")
    if layout == "kimi_k3":  # Automodel's kimi_k3 computes SiTU whatever hidden_act says (vLLM refuses the rest)
        _refuse(act != "situ", "hidden_act", get, "Kimi K3's code computes SiTU-GLU whatever hidden_act says")
    else:
        _refuse(act != "silu", "hidden_act", get, "kimi_linear is SwiGLU here; SiTU is Kimi K3's, model_type kimi_k3")
        for name in KIMI_LINEAR_IGNORES:
            default = ABSENT["kimi_linear"][name]
            why = f"transformers' kimi_linear ignores it and builds {default!r}; Kimi K3's components are kimi_k3"
            _refuse(get(name) != default, name, get, why)
    latent = get("routed_expert_hidden_size")
    _refuse(latent is not None and not get("latent_moe_use_norm"), "latent_moe_use_norm", get, "always normed")
    lower_bound = get("linear_attn_config.gate_lower_bound")
    fields: dict[str, Any] = {
        "vocab_size": get.required("vocab_size"),
        "d_model": get.required("hidden_size"),
        "n_layers": n_layers,
        "kda_mla_ratio": None,
        "layer_types": _layer_types(text, linear, n_layers),
        "max_seq_len": get("max_position_embeddings", "model_max_length"),
        "norm_eps": get("rms_norm_eps"),
        "tie_embeddings": bool(config.get("tie_word_embeddings", get("tie_word_embeddings"))),
        "init_std": get("initializer_range"),
        "mla_n_heads": mla_heads,
        "q_lora_rank": get("q_lora_rank"),
        "kv_lora_rank": get.required("kv_lora_rank"),
        "qk_nope_head_dim": get.required("qk_nope_head_dim"),
        "qk_rope_head_dim": get.required("qk_rope_head_dim"),
        "v_head_dim": get.required("v_head_dim"),
        "mla_rope": False,
        "mla_output_gate": bool(get("mla_use_output_gate")),
        "mla_latent_norm_eps": FIXED_EPS,
        "kda_n_heads": get("linear_attn_config.num_heads", "linear_num_heads"),
        "kda_head_dim": get("linear_attn_config.head_dim", "linear_head_dim"),
        "kda_conv_size": get("linear_attn_config.short_conv_kernel_size", "linear_conv_kernel_dim"),
        "kda_gate": "sigmoid" if lower_bound is not None else "softplus",
        "kda_output_gate": "full_rank" if get("linear_attn_config.use_full_rank_gate") else "low_rank",
        "kda_qk_norm_eps": FIXED_EPS,
        "n_routed_experts": get.required("num_experts", "num_local_experts"),
        "experts_per_token": get.required("num_experts_per_token", "num_experts_per_tok"),
        "n_shared_experts": get("num_shared_experts", "n_shared_experts"),
        "expert_ffn_dim": get.required("moe_intermediate_size"),
        "first_k_dense": _first_k_dense(text, n_layers, get("first_k_dense_replace")),
        "dense_ffn_dim": get.required("intermediate_size"),
        "routed_scaling_factor": get("routed_scaling_factor"),
        "attn_res_block_size": get("attn_res_block_size"),
        "ffn_activation": act if act == "situ" else "swiglu",
        "expert_latent_dim": latent,
    }
    if fields["kda_output_gate"] == "low_rank":
        fields["kda_output_gate_bias"] = False
    if lower_bound is not None:
        fields["kda_gate_lower_bound"] = float(lower_bound)
    if act == "situ":
        # an explicit null beta is 1.0, as Automodel and vLLM read it (`beta or 1.0`); a null linear beta leaves
        # their up branch unbounded, which k3train's SiTU cannot
        beta, linear_beta = get("activation_situ_beta"), get("activation_situ_linear_beta")
        _refuse(linear_beta is None, "activation_situ_linear_beta", get, "k3train's SiTU bounds the up branch")
        fields["situ_beta"], fields["situ_linear_beta"] = float(beta or 1.0), float(linear_beta)
    if fields["experts_per_token"] == 1 and layout == "kimi_k3":
        raise NotExpressible("num_experts_per_token=1: Kimi K3 leaves a single expert's weight unnormalised")
    try:
        KimiK3Config(**fields)
    except (TypeError, ValueError) as exc:
        raise NotExpressible(f"this config.json builds no k3train model: {exc}") from None
    return layout, fields


_MISSING = object()


class _Reader:
    """A config's values by transformers' name or its aliases (the same field under the Kimi and DeepSeek names);
    `linear_attn_config.X` reads that sub-object. A field present (null included) is taken as written; one absent
    takes the layout's ABSENT value, or is refused naming it."""

    def __init__(self, text: dict[str, Any], linear: dict[str, Any], layout: str) -> None:
        self.text, self.linear, self.layout = text, linear, layout

    def _lookup(self, key: str) -> Any:
        if key.startswith("linear_attn_config."):
            return self.linear.get(key.removeprefix("linear_attn_config."), _MISSING)
        return self.text.get(key, _MISSING)

    def __call__(self, name: str, *aliases: str, default: Any = _MISSING) -> Any:
        for key in (name, *aliases):
            value = self._lookup(key)
            if value is not _MISSING:
                return value
        if default is _MISSING:
            default = ABSENT[self.layout][name]
        if isinstance(default, Refused):
            raise HFFormatError(f"config.json has no {name}: a {self.layout} config must give it ({default})")
        return default

    def written(self, name: str) -> Any:
        """The value as written (None when absent), for messages."""
        value = self._lookup(name)
        return None if value is _MISSING else value

    def required(self, name: str, *aliases: str) -> Any:
        value = self(name, *aliases, default=None)
        if value is None:
            raise HFFormatError(f"config.json has no {name}: not a complete Kimi Linear or Kimi K3 config")
        return value


def _refuse(condition: Any, field: str, get: _Reader, why: str) -> None:
    if condition:
        raise NotExpressible(f"{field}={get.written(field)!r}: k3train cannot build it ({why})")


def _layer_types(text: dict[str, Any], linear: dict[str, Any], n_layers: int) -> list[str]:
    if isinstance(text.get("layer_types"), list):  # transformers' own field
        names = {"linear_attention": "kda", "full_attention": "mla"}
        bad = sorted({t for t in text["layer_types"] if t not in names})
        if bad:
            raise NotExpressible(f"layer_types has {bad}: k3train builds linear_attention and full_attention")
        return [names[t] for t in text["layer_types"]]
    kda, full = linear.get("kda_layers"), linear.get("full_attn_layers")
    if kda is None or full is None:
        raise HFFormatError(
            "config.json names no layer types (layer_types, or linear_attn_config.kda_layers and "
            "full_attn_layers): which layers are KDA is unknown"
        )
    if sorted([*kda, *full]) != list(range(1, n_layers + 1)):
        raise NotExpressible(
            f"linear_attn_config.kda_layers + full_attn_layers must list layers 1..{n_layers} once each (1-based)"
        )
    return ["kda" if i + 1 in set(kda) else "mla" for i in range(n_layers)]


def _first_k_dense(text: dict[str, Any], n_layers: int, first_k_dense_replace: int) -> int:
    types = text.get("mlp_layer_types")
    if isinstance(types, list):
        k = next((i for i, t in enumerate(types) if t != "dense"), len(types))
        if any(t == "dense" for t in types[k:]):
            raise NotExpressible(f"mlp_layer_types={types}: k3train's dense layers are a prefix (first_k_dense)")
        return k
    return int(first_k_dense_replace)
