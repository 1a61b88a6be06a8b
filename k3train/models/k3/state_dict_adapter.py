"""Kimi K3's Hugging Face adapter (HF_ADAPTER, the family's side of k3train/hf/adapter.py): k3train's parameter
names <-> the Hugging Face checkpoint names of the same tensors, in both layouts, and config.json through
hf_config.py.

k3train's Kimi K3 names were taken from the released checkpoint, so most keys only gain a prefix: `model.` in
kimi_linear, `language_model.model.` in kimi_k3 (and `lm_head.weight` / `language_model.lm_head.weight`). What else
differs:

    layers.L.mixer_norm / ffn_norm            layers.L.input_layernorm / post_attention_layernorm
    layers.L.mixer.*                          layers.L.self_attn.*
      KDA {q,k,v}_conv                          {q,k,v}_conv1d
      KDA A_log [H]                             kimi_linear: [1, 1, H, 1]; kimi_k3: [H] zero-padded to a multiple of 128
      MLA q_a_norm / kv_a_norm / kv_a_proj      q_a_layernorm / kv_a_layernorm / kv_a_proj_with_mqa
    dense layers.L.ffn.w_{gate,up,down}       layers.L.mlp.{gate,up,down}_proj
    MoE layers.L.ffn.                         layers.L.block_sparse_moe.
      router / expert_bias                      gate.weight / gate.e_score_correction_bias
      experts.w_gate|w_up|w_down [E, ...]       experts.{e}.w1|w3|w2.weight, one tensor per expert
      shared.w_{gate,up,down}                   shared_experts.{gate,up,down}_proj
      latent_down / latent_norm / latent_up     routed_expert_down_proj / routed_expert_norm / routed_expert_up_proj

Sources: transformers' conversion mapping for kimi_linear and Automodel's kimi_k3 state_dict_adapter.py
(prefixes, expert names, the A_log padding),
https://github.com/huggingface/transformers/blob/main/src/transformers/models/kimi_linear/modeling_kimi_linear.py
https://github.com/NVIDIA-NeMo/Automodel/blob/main/nemo_automodel/components/models/kimi_k3/state_dict_adapter.py
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from k3train.hf import HFFormatError
from k3train.hf.adapter import Slot
from k3train.models.k3 import hf_config, mup
from k3train.models.k3.config import KimiK3Config
from k3train.models.k3.model import KimiK3

A_LOG_PAD = 128  # the released K3 stores A_log [H] in a [ceil(H / 128) * 128] tensor
PREFIX = {
    "kimi_linear": ("model.", "lm_head.weight"),
    "kimi_k3": ("language_model.model.", "language_model.lm_head.weight"),
}
KDA = {"q_conv.weight": "q_conv1d.weight", "k_conv.weight": "k_conv1d.weight", "v_conv.weight": "v_conv1d.weight"}
MLA = {"q_a_norm.": "q_a_layernorm.", "kv_a_norm.": "kv_a_layernorm.", "kv_a_proj.": "kv_a_proj_with_mqa."}
DENSE = {"w_gate.": "gate_proj.", "w_up.": "up_proj.", "w_down.": "down_proj."}
MOE = {
    "router.weight": "gate.weight",
    "expert_bias": "gate.e_score_correction_bias",
    "latent_down.weight": "routed_expert_down_proj.weight",
    "latent_norm.weight": "routed_expert_norm.weight",
    "latent_up.weight": "routed_expert_up_proj.weight",
}
EXPERTS = {"experts.w_gate": "w1", "experts.w_up": "w3", "experts.w_down": "w2"}
# The code a kimi_k3 export carries for transformers' trust_remote_code=True (config.json's auto_map names it):
# source files kept beside this module, shipped as package data, importing only torch and transformers
REMOTE_CODE = tuple(
    Path(__file__).with_name("hf_remote") / name for name in ("configuration_kimi_k3.py", "modeling_kimi_k3.py")
)
LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# transformers' save_pretrained (5.24) writes a dense layer's FFN under block_sparse_moe., as it does the MoE's
DENSE_AS_MOE = re.compile(r"(.*layers\.\d+\.)block_sparse_moe\.((?:gate|up|down)_proj\.weight)")


def hf_names(cfg: KimiK3Config, layout: str, k3_names: Iterable[str]) -> dict[str, Slot]:
    """Every HF name of the model's tensors in `layout` -> its Slot; k3_names: the model's state_dict keys."""
    model_prefix, lm_head = PREFIX[layout]
    pattern = cfg.layer_pattern
    out: dict[str, Slot] = {}
    for name in k3_names:
        if name == "lm_head.weight":
            out[lm_head] = Slot(name)
            continue
        match = LAYER.fullmatch(name)
        if match is None:  # embed_tokens, norm, output_attn_res_*: the same name under the prefix
            out[model_prefix + name] = Slot(name)
            continue
        layer, rest = int(match[1]), match[2]
        base = f"{model_prefix}layers.{layer}."
        if rest.startswith("ffn.experts."):
            w = EXPERTS[rest.removeprefix("ffn.")]
            for e in range(cfg.n_routed_experts):
                out[f"{base}block_sparse_moe.experts.{e}.{w}.weight"] = Slot(name, e)
            continue
        out[base + _layer_rest(rest, pattern[layer], cfg.is_moe_layer(layer))] = Slot(name)
    return out


def _layer_rest(rest: str, mixer: str, moe: bool) -> str:
    if rest.startswith("mixer_norm."):
        return "input_layernorm." + rest.removeprefix("mixer_norm.")
    if rest.startswith("ffn_norm."):
        return "post_attention_layernorm." + rest.removeprefix("ffn_norm.")
    if rest.startswith("mixer."):
        sub = rest.removeprefix("mixer.")
        if sub == "g_b_proj.bias":
            raise HFFormatError("the low-rank output gate's bias (g_b_proj.bias) has no Hugging Face counterpart")
        renames = KDA if mixer == "kda" else MLA
        for old, new in renames.items():
            if sub.startswith(old):
                sub = new + sub.removeprefix(old)
                break
        return "self_attn." + sub
    if rest.startswith("ffn."):
        sub = rest.removeprefix("ffn.")
        if not moe:
            return "mlp." + _rename_prefix(sub, DENSE)
        if sub in MOE:
            return "block_sparse_moe." + MOE[sub]
        if sub.startswith("shared."):
            return "block_sparse_moe.shared_experts." + _rename_prefix(sub.removeprefix("shared."), DENSE)
        raise HFFormatError(f"no Hugging Face name for the MoE tensor ffn.{sub}")
    return rest  # the attention-residual mixes keep their names


def _rename_prefix(name: str, renames: dict[str, str]) -> str:
    for old, new in renames.items():
        if name.startswith(old):
            return new + name.removeprefix(old)
    raise HFFormatError(f"no Hugging Face name for {name}")


def canonical(name: str, plan: dict[str, Slot]) -> str:
    """An HF name as hf_names spells it: another writer's spelling of the same tensor is mapped back."""
    if name not in plan and (match := DENSE_AS_MOE.fullmatch(name)):
        return f"{match[1]}mlp.{match[2]}"
    return name


def to_hf(state: dict[str, torch.Tensor], cfg: KimiK3Config, layout: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of a k3train state dict, experts one by one, A_log in the HF shape. Under
    mup the logits' multiplier is folded into the final norm's gain (the formats have no field for it): the same
    logits from a standard model."""
    for hf_name, slot in hf_names(cfg, layout, state).items():
        tensor = state[slot.name]
        if slot.name == "norm.weight" and mup.output_multiplier(cfg) != 1.0:
            tensor = tensor * mup.output_multiplier(cfg)
        if slot.expert is not None:
            tensor = tensor[slot.expert]
        elif slot.name.endswith("mixer.A_log"):
            tensor = a_log_to_hf(tensor, layout)
        elif slot.name == "lm_head.weight" and cfg.tie_embeddings:
            tensor = tensor.clone()  # written twice (the formats do not tie), and safetensors refuses shared storage
        yield hf_name, tensor.contiguous()


def a_log_to_hf(a_log: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "kimi_linear":
        return a_log.reshape(1, 1, -1, 1)
    padded = a_log.new_zeros(math.ceil(a_log.numel() / A_LOG_PAD) * A_LOG_PAD)
    padded[: a_log.numel()] = a_log
    return padded


def a_log_from_hf(tensor: torch.Tensor, n_heads: int, layout: str, name: str) -> torch.Tensor:
    """The HF A_log back to [n_heads]; HFFormatError if its shape is not the layout's or the padding is not zero."""
    flat = tensor.reshape(-1)
    if layout == "kimi_linear":
        if tuple(tensor.shape) not in ((1, 1, n_heads, 1), (n_heads,)):
            raise HFFormatError(f"{name} has shape {list(tensor.shape)}, expected [1, 1, {n_heads}, 1]")
        return flat
    padded = math.ceil(n_heads / A_LOG_PAD) * A_LOG_PAD
    if flat.numel() not in (n_heads, padded):
        raise HFFormatError(f"{name} has {flat.numel()} entries, expected {n_heads} heads padded to {padded}")
    if flat[n_heads:].any():
        raise HFFormatError(f"{name}: the padding past its {n_heads} heads is not zero; the layout is not K3's")
    return flat[:n_heads]


# Written in fp32 whatever the export's dtype, as both references keep them (the KDA decay parameters and short
# convolutions, its output norm, the router and its bias: transformers' `_keep_in_fp32_modules_strict`, Automodel's
# kimi_k3 state_dict_adapter `_FP32_KEY_PARTS`); Hugging Face name endings.
KEEP_FP32 = ("A_log", "dt_bias", "_conv1d.weight", "o_norm.weight", ".gate.weight", "e_score_correction_bias")


class KimiK3StateDictAdapter:
    """KimiK3 <-> transformers' kimi_linear and the released Kimi K3's kimi_k3 (k3train/hf/adapter.py's HFAdapter)."""

    model_types = hf_config.LAYOUTS  # each layout's config.json names it as its model_type
    model_class = KimiK3
    keep_fp32 = KEEP_FP32

    def layout(self, model: KimiK3) -> str:
        layout = hf_config.layout_for(model.config)
        hf_config.to_hf_config(model.config, layout, None, "float32")  # refuses what the layout cannot say
        return layout

    def to_hf_config(self, model: KimiK3, layout: str, eos_token_id: int | None, dtype: str) -> dict[str, Any]:
        return hf_config.to_hf_config(model.config, layout, eos_token_id, dtype)

    def to_hf(self, model: KimiK3, layout: str) -> Iterator[tuple[str, torch.Tensor]]:
        return to_hf(model.state_dict(), model.config, layout)

    def remote_code(self, layout: str) -> tuple[Path, ...]:
        """The files written beside the weights for trust_remote_code=True: none for kimi_linear, which
        transformers builds itself; hf_remote/'s for kimi_k3, which it does not know."""
        return REMOTE_CODE if layout == "kimi_k3" else ()

    def from_hf_config(self, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return hf_config.from_hf_config(config)

    def build(self, fields: dict[str, Any]) -> KimiK3:
        return KimiK3.from_fields(**fields)

    def hf_names(self, model: KimiK3, layout: str) -> dict[str, Slot]:
        return hf_names(model.config, layout, model.state_dict())

    def canonical(self, name: str, plan: dict[str, Slot]) -> str:
        return canonical(name, plan)

    def outside_model(self, name: str, layout: str) -> bool:
        # the released K3 is a vision-language model: vision_tower.*, mm_projector.* beside the text model
        return layout == "kimi_k3" and not name.startswith("language_model.")

    def may_be_absent(self, name: str, model: KimiK3) -> bool:
        return model.config.tie_embeddings and name.endswith("lm_head.weight")

    def from_hf(self, slot: Slot, name: str, tensor: torch.Tensor, target: torch.Tensor, layout: str) -> torch.Tensor:
        if slot.name.endswith("mixer.A_log"):
            return a_log_from_hf(tensor, target.numel(), layout, name)
        return tensor


HF_ADAPTER = KimiK3StateDictAdapter()
