"""conf/model/k3.yaml is Kimi K3 as released: every tensor has the released checkpoint's shape, and the parameter
counts equal a sum computed here from the released layout alone (moonshotai/Kimi-K3's text model, as NVIDIA-NeMo/
Automodel's kimi_k3 and its state-dict adapter lay it out), built on the meta device."""

from __future__ import annotations

import re
import time

import pytest
import torch
from hydra.utils import instantiate

from helpers.config import model_config

# The release, in its own terms.
D, VOCAB, LAYERS, HEADS, HEAD_DIM = 7168, 163840, 93, 96, 128
P = HEADS * HEAD_DIM  # KDA's projection width
MLA_LAYERS = {*range(3, 92, 4), 92}  # 0-based: 1-based 4, 8, ..., 92 and 93
EXPERTS, TOP_K, EXPERT_FFN, LATENT, SHARED_FFN, DENSE_FFN = 896, 16, 3072, 3584, 2 * 3072, 33792
Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 1536, 512, 128, 64, 128


def released_layer(i: int) -> dict[str, tuple[int, ...]]:
    """The released tensors of decoder layer i (under `language_model.model.layers.{i}.`), routed experts per expert.
    A_log holds the 96 real values (the released file pads it to 128 with zeros)."""
    shapes = {
        "input_layernorm.weight": (D,),
        "post_attention_layernorm.weight": (D,),
        "self_attention_res_norm.weight": (D,),
        "self_attention_res_proj.weight": (1, D),
        "mlp_res_norm.weight": (D,),
        "mlp_res_proj.weight": (1, D),
    }
    if i in MLA_LAYERS:
        attn = {
            "q_a_proj.weight": (Q_LORA, D),
            "q_a_layernorm.weight": (Q_LORA,),
            "q_b_proj.weight": (HEADS * (NOPE + ROPE), Q_LORA),
            "kv_a_proj_with_mqa.weight": (KV_LORA + ROPE, D),
            "kv_a_layernorm.weight": (KV_LORA,),
            "kv_b_proj.weight": (HEADS * (NOPE + V_DIM), KV_LORA),
            "g_proj.weight": (HEADS * V_DIM, D),
            "o_proj.weight": (D, HEADS * V_DIM),
        }
    else:
        attn = {
            **{f"{x}_proj.weight": (P, D) for x in "qkv"},
            **{f"{x}_conv1d.weight": (P, 1, 4) for x in "qkv"},
            "A_log": (HEADS,),
            "dt_bias": (P,),
            "f_a_proj.weight": (HEAD_DIM, D),
            "f_b_proj.weight": (P, HEAD_DIM),
            "b_proj.weight": (HEADS, D),
            "g_proj.weight": (P, D),
            "o_norm.weight": (HEAD_DIM,),
            "o_proj.weight": (D, P),
        }
    shapes.update({f"self_attn.{k}": v for k, v in attn.items()})
    if i == 0:
        ffn = {"mlp.gate_proj.weight": (DENSE_FFN, D), "mlp.up_proj.weight": (DENSE_FFN, D)}
        ffn["mlp.down_proj.weight"] = (D, DENSE_FFN)
    else:
        moe = "block_sparse_moe."
        ffn = {
            f"{moe}gate.weight": (EXPERTS, D),
            f"{moe}routed_expert_down_proj.weight": (LATENT, D),
            f"{moe}routed_expert_up_proj.weight": (D, LATENT),
            f"{moe}routed_expert_norm.weight": (LATENT,),
            f"{moe}shared_experts.gate_proj.weight": (SHARED_FFN, D),
            f"{moe}shared_experts.up_proj.weight": (SHARED_FFN, D),
            f"{moe}shared_experts.down_proj.weight": (D, SHARED_FFN),
            f"{moe}experts.*.w1.weight": (EXPERT_FFN, LATENT),
            f"{moe}experts.*.w3.weight": (EXPERT_FFN, LATENT),
            f"{moe}experts.*.w2.weight": (LATENT, EXPERT_FFN),
        }
    shapes.update(ffn)
    return shapes


RELEASED_TOP = {
    "embed_tokens.weight": (VOCAB, D),
    "norm.weight": (D,),
    "output_attn_res_norm.weight": (D,),
    "output_attn_res_proj.weight": (1, D),
    "lm_head.weight": (VOCAB, D),
}

# k3train's name -> the released name (per layer), the map a checkpoint converter follows.
OURS_TO_RELEASED = [
    (r"mixer_norm\.weight", "input_layernorm.weight"),
    (r"ffn_norm\.weight", "post_attention_layernorm.weight"),
    (r"(self_attention_res_norm|self_attention_res_proj|mlp_res_norm|mlp_res_proj)\.weight", r"\1.weight"),
    (r"mixer\.(q|k|v)_conv\.weight", r"self_attn.\1_conv1d.weight"),
    (r"mixer\.q_a_norm\.weight", "self_attn.q_a_layernorm.weight"),
    (r"mixer\.kv_a_norm\.weight", "self_attn.kv_a_layernorm.weight"),
    (r"mixer\.kv_a_proj\.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    (r"mixer\.(.+)", r"self_attn.\1"),
    (r"ffn\.w_(gate|up|down)\.weight", r"mlp.\1_proj.weight"),
    (r"ffn\.router\.weight", "block_sparse_moe.gate.weight"),
    (r"ffn\.latent_(down|up)\.weight", r"block_sparse_moe.routed_expert_\1_proj.weight"),
    (r"ffn\.latent_norm\.weight", "block_sparse_moe.routed_expert_norm.weight"),
    (r"ffn\.shared\.w_(gate|up|down)\.weight", r"block_sparse_moe.shared_experts.\1_proj.weight"),
    (r"ffn\.experts\.w_gate", "block_sparse_moe.experts.*.w1.weight"),
    (r"ffn\.experts\.w_up", "block_sparse_moe.experts.*.w3.weight"),
    (r"ffn\.experts\.w_down", "block_sparse_moe.experts.*.w2.weight"),
]


def released_name(local: str) -> str:
    for pattern, replacement in OURS_TO_RELEASED:
        if re.fullmatch(pattern, local):
            return re.sub(pattern, replacement, local)
    raise AssertionError(f"no released name for {local}")


@pytest.fixture(scope="module")
def k3():
    start = time.perf_counter()
    with torch.device("meta"):
        model = instantiate(model_config("k3"))
    return model, time.perf_counter() - start


def test_k3_builds_on_the_meta_device_in_seconds(k3) -> None:
    model, seconds = k3
    assert seconds < 60, f"{seconds:.1f} s"
    assert all(p.is_meta for p in model.parameters())
    assert [layer.mixer_type for layer in model.layers].count("mla") == len(MLA_LAYERS) == 24
    assert {i for i, layer in enumerate(model.layers) if layer.mixer_type == "mla"} == MLA_LAYERS


def test_every_tensor_has_the_released_shape_and_every_released_tensor_is_there(k3) -> None:
    model, _ = k3
    seen: set[str] = set()
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            _, i, local = name.split(".", 2)
            released, want = released_name(local), released_layer(int(i))
            key = f"layers.{i}.{released}"
            expected = want.get(released)
            if ".experts.*." in released:
                expected = (EXPERTS, *expected)  # k3train stacks the experts: [E, out, in]
        else:
            key, expected = name, RELEASED_TOP.get(name)
        assert expected is not None, f"{name}: no such released tensor"
        assert tuple(p.shape) == expected, f"{name} -> {key}: {tuple(p.shape)} != released {expected}"
        seen.add(key)
    released_keys = set(RELEASED_TOP) | {f"layers.{i}.{k}" for i in range(LAYERS) for k in released_layer(i)}
    assert seen == released_keys, sorted(released_keys ^ seen)[:10]


def test_parameter_counts_equal_the_released_layouts_sum(k3) -> None:
    model, _ = k3

    def numel(shape: tuple[int, ...], name: str) -> int:
        n = 1
        for s in shape:
            n *= s
        return n * (EXPERTS if ".experts.*." in name else 1)

    total = sum(numel(s, k) for k, s in RELEASED_TOP.items())
    total += sum(numel(s, k) for i in range(LAYERS) for k, s in released_layer(i).items())
    idle_experts = (LAYERS - 1) * (EXPERTS - TOP_K) * 3 * EXPERT_FFN * LATENT
    counts = model.param_counts()
    assert counts == {"total": total, "active": total - idle_experts, "embedding": VOCAB * D}
    assert round(total / 1e12, 2) == 2.78 and round(counts["active"] / 1e9) == 105  # "2.8T total / 104B activated"


def test_k3_flops_per_token_take_every_component(k3) -> None:
    model, _ = k3
    flops = model.flops_per_token(4096)["forward"]
    # The active parameters' matmuls alone (2 FLOPs per multiply-add; not the input embedding, a lookup) are a
    # floor; attention over 4096 keys and KDA's state work come on top.
    active_matmul = 2 * (model.param_counts()["active"] - VOCAB * D)
    assert active_matmul < flops < 1.2 * active_matmul
