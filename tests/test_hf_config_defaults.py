"""A config.json says the same model to k3train as to the layout's own reader (issue 40): export writes head_dim, so
no reader guesses it from hidden_size // num_attention_heads; a field a config.json leaves out is read as that
layout's reader reads it (kimi_k3: the released Kimi K3's value; kimi_linear: transformers' KimiLinearConfig
default) or refused naming it, and an explicit value the layout's reader would not build is refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_hf import K3, KIMI_LINEAR, ids, model_with_every_weight_random, relative

from k3train.data.tokenizers import ByteTokenizer
from k3train.hf import HFFormatError
from k3train.hf.write import write_hf
from k3train.models.k3 import KimiK3
from k3train.models.k3.hf_config import NotExpressible, from_hf_config, to_hf_config
from k3train.models.k3.state_dict_adapter import HF_ADAPTER

pytestmark = pytest.mark.usefixtures("one_thread")

# Kimi K3 at a test's size but, in every field that is no size, as released (moonshotai/Kimi-K3 config.json:
# SiTU 4.0/25.0, attention residuals over 12 layers, MLA output gate, full-rank KDA gate, sigmoid decay bound -5,
# 2 shared experts, routed scale 1.0, eps 1e-5, 1,048,576 positions); q_lora_rank set, as the release compresses q.
RELEASE_FORM = {
    **K3,
    "q_lora_rank": 16,
    "situ_beta": 4.0,
    "situ_linear_beta": 25.0,
    "attn_res_block_size": 12,
    "n_shared_experts": 2,
    "routed_scaling_factor": 1.0,
    "norm_eps": 1e-5,
    "mla_latent_norm_eps": 1e-6,
    "kda_gate_lower_bound": -5.0,
    "max_seq_len": 1048576,
}
# The same shape that made Automodel's KimiK3TextConfig refuse k3train's export: 64 // 3 = 21, an odd RoPE dim
THREE_HEADS = {"d_model": 64, "mla_n_heads": 3}


def config_of(fields: dict, layout: str) -> dict:
    return to_hf_config(KimiK3.from_fields(**fields).config, layout, 256, "float32")


def removals(config: dict, text_key: str | None):
    """(dotted name, config without that one field) for every field of the config.json, nested ones included."""
    text = config[text_key] if text_key else config
    for key in list(config):
        if key not in ("model_type", text_key):
            yield key, {k: v for k, v in config.items() if k != key}
    if text_key:
        for key in list(text):
            trimmed = copy.deepcopy(config)
            del trimmed[text_key][key]
            yield key, trimmed
    for key in list(text["linear_attn_config"]):
        trimmed = copy.deepcopy(config)
        del (trimmed[text_key] if text_key else trimmed)["linear_attn_config"][key]
        yield f"linear_attn_config.{key}", trimmed


# --- head_dim --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["kimi_k3", "kimi_linear"])
def test_export_writes_head_dim_the_rotary_dim_that_transformers_rope_check_accepts(layout) -> None:
    transformers = pytest.importorskip("transformers")
    fields = {**(K3 if layout == "kimi_k3" else KIMI_LINEAR), **THREE_HEADS}
    config = config_of(fields, layout)
    text = config["text_config"] if layout == "kimi_k3" else config
    assert text["head_dim"] == fields["qk_rope_head_dim"] == 4
    # Automodel's KimiK3TextConfig: head_dim as written, else hidden_size // num_attention_heads; then transformers'
    # RoPE validation (its rope_theta is 10000), which is where 21 was refused
    checked = transformers.PretrainedConfig(
        head_dim=text.get("head_dim", text["hidden_size"] // text["num_attention_heads"])
    )
    checked.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    checked.validate_rope()


def test_an_odd_rotary_dim_above_4_is_refused_for_kimi_k3_before_anything_is_written() -> None:
    with pytest.raises(NotExpressible, match=r"qk_rope_head_dim=5 \(head_dim\): .* odd rotary dimension"):
        config_of({**K3, "qk_rope_head_dim": 5}, "kimi_k3")


@pytest.mark.slow  # seconds: transformers' import and model
def test_a_three_head_kimi_linear_export_loads_in_transformers_with_its_logits(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    model = model_with_every_weight_random({**KIMI_LINEAR, **THREE_HEADS})
    assert write_hf(HF_ADAPTER, model, ByteTokenizer(), tmp_path, shard_bytes=10**9) == "kimi_linear"
    assert json.loads((tmp_path / "config.json").read_text())["head_dim"] == 4  # written, not left to the reader
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert theirs.config.head_dim == 4 and theirs.config.num_attention_heads == 3
    x = ids()
    with torch.no_grad():
        want, _ = model(x)
        got = theirs(x).logits
    assert relative(got, want) < 1e-4, relative(got, want)


# --- kimi_k3: a missing field is the release's value, or refused --------------------------------------------------


def test_a_release_form_config_missing_any_one_field_reads_as_the_release_or_is_refused_naming_it() -> None:
    config = config_of(RELEASE_FORM, "kimi_k3")
    _, want = from_hf_config(config)
    released = {
        "ffn_activation": "situ",
        "situ_beta": 4.0,
        "situ_linear_beta": 25.0,
        "attn_res_block_size": 12,
        "mla_output_gate": True,
        "kda_output_gate": "full_rank",
        "kda_gate": "sigmoid",
        "n_shared_experts": 2,
        "max_seq_len": 1048576,
    }
    assert {k: want[k] for k in released} == released  # else the loop below would check another model
    read, refused = [], []
    for name, trimmed in removals(config, "text_config"):
        try:
            _, got = from_hf_config(trimmed)
        except HFFormatError as err:
            assert name.split(".")[-1] in str(err), (name, str(err))
            refused.append(name)
            continue
        assert got == want, (name, {k: (got[k], want[k]) for k in want if got.get(k) != want[k]})
        read.append(name)
    # the fields issue 40 found read as another model, and those the release's value cannot stand in for
    assert {"hidden_act", "activation_situ_beta", "activation_situ_linear_beta", "attn_res_block_size"} <= set(read)
    assert {"mla_use_output_gate", "num_shared_experts", "max_position_embeddings"} <= set(read)
    assert {"q_lora_rank", "routed_expert_hidden_size", "linear_attn_config.num_heads"} <= set(refused)
    assert {"linear_attn_config.use_full_rank_gate", "linear_attn_config.gate_lower_bound"} <= set(refused)


def test_a_k3_config_missing_a_refused_field_is_one_line_exit_2_naming_it(tmp_path, capsys) -> None:
    from k3train.import_hf import main as import_main

    model = model_with_every_weight_random(RELEASE_FORM)
    write_hf(HF_ADAPTER, model, ByteTokenizer(), tmp_path / "hf", shard_bytes=10**9)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["text_config"]["linear_attn_config"]["gate_lower_bound"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert import_main([str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3train.import_hf: error: config.json has no linear_attn_config.gate_lower_bound")
    assert "\n" not in err and not (tmp_path / "out").exists()


def test_a_softplus_k3_model_writes_its_gate_as_null_and_reads_back_softplus() -> None:
    fields = {**K3, "kda_gate": "softplus"}
    config = config_of(fields, "kimi_k3")
    assert config["text_config"]["linear_attn_config"]["gate_lower_bound"] is None
    assert from_hf_config(config)[1]["kda_gate"] == "softplus"


def test_kimi_k3_is_situ_only_both_ways() -> None:
    """Automodel's kimi_k3 computes SiTU-GLU whatever hidden_act says: a SwiGLU model is not written as kimi_k3, and a
    kimi_k3 config saying silu is refused, not built as SwiGLU."""
    with pytest.raises(NotExpressible, match="ffn_activation='swiglu': Kimi K3's code computes SiTU-GLU"):
        config_of({**K3, "ffn_activation": "swiglu"}, "kimi_k3")
    config = config_of(K3, "kimi_k3")
    config["text_config"]["hidden_act"] = "silu"
    with pytest.raises(NotExpressible, match="hidden_act='silu': k3train cannot build it"):
        from_hf_config(config)


# --- kimi_linear: a missing field is transformers' default, or refused -------------------------------------------


def as_transformers_reads(hf) -> dict:
    """transformers' KimiLinearConfig in k3train's field names (those the two share)."""
    return {
        "d_model": hf.hidden_size,
        "mla_n_heads": hf.num_attention_heads,
        "q_lora_rank": hf.q_lora_rank,
        "kv_lora_rank": hf.kv_lora_rank,
        "qk_nope_head_dim": hf.qk_nope_head_dim,
        "qk_rope_head_dim": hf.qk_rope_head_dim,
        "v_head_dim": hf.v_head_dim,
        "kda_n_heads": hf.linear_num_heads,
        "kda_head_dim": hf.linear_head_dim,
        "kda_conv_size": hf.linear_conv_kernel_dim,
        "n_shared_experts": hf.num_shared_experts,
        "routed_scaling_factor": hf.routed_scaling_factor,
        "norm_eps": hf.rms_norm_eps,
        "max_seq_len": hf.max_position_embeddings,
        "first_k_dense": hf.mlp_layer_types.count("dense"),
        "layer_types": ["kda" if t == "linear_attention" else "mla" for t in hf.layer_types],
        "dense_ffn_dim": hf.intermediate_size,
        "expert_ffn_dim": hf.moe_intermediate_size,
        "experts_per_token": hf.num_experts_per_tok,
    }


def test_a_kimi_linear_config_missing_any_one_field_reads_as_transformers_reads_it_or_is_refused() -> None:
    transformers = pytest.importorskip("transformers")
    config = config_of(KIMI_LINEAR, "kimi_linear")
    compared = 0
    for name, trimmed in removals(config, None):
        try:
            _, ours = from_hf_config(trimmed)
        except HFFormatError as err:
            assert name.split(".")[-1] in str(err), (name, str(err))
            continue
        theirs = as_transformers_reads(transformers.KimiLinearConfig.from_dict(trimmed))
        assert {k: ours[k] for k in theirs} == theirs, (name, {k: (ours[k], v) for k, v in theirs.items()})
        compared += 1
    assert compared > 20  # most fields are optional, so the comparison ran on most removals


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("attn_res_block_size", 2),
        ("mla_use_output_gate", True),
        ("routed_expert_hidden_size", 16),
        ("linear_attn_config.use_full_rank_gate", True),
        ("linear_attn_config.gate_lower_bound", -5.0),
        ("hidden_act", "situ"),
    ],
)
def test_a_kimi_linear_config_with_a_field_transformers_ignores_set_is_refused_naming_it(field, value) -> None:
    config = config_of(KIMI_LINEAR, "kimi_linear")
    if field.startswith("linear_attn_config."):
        config["linear_attn_config"][field.split(".")[1]] = value
    else:
        config[field] = value
    if field == "hidden_act":
        config["activation_situ_linear_beta"] = 25.0
    with pytest.raises(NotExpressible, match=f"{field}={value!r}: k3train cannot build it"):
        from_hf_config(config)
