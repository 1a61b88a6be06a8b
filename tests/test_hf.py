"""The Hugging Face format both ways (k3train/hf/): transformers loads what k3train writes and gives its logits, k3train
reads what transformers writes and gives transformers' logits, a K3-shaped model round-trips bit for bit, a
synthetic released-K3 directory (MXFP4 experts, padded A_log, prefixed keys, vision keys) imports, trains from
train.init_from and generates, and every kind of bad input is refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from k3train.data.tokenizers import ByteTokenizer
from k3train.hf import HFFormatError
from k3train.hf.mxfp4 import MXFP4_FORMAT, decode_mxfp4, encode_mxfp4
from k3train.hf.read import read_hf
from k3train.hf.shards import write_shards
from k3train.hf.write import write_hf
from k3train.models.k3 import KimiK3
from k3train.models.k3.hf_config import NotExpressible, from_hf_config, layout_for, to_hf_config
from k3train.models.k3.state_dict_adapter import HF_ADAPTER, KEEP_FP32, hf_names, to_hf

from helpers.tiny_k3 import TINY, model_with_every_weight_random

pytestmark = pytest.mark.usefixtures("one_thread")

V = 257  # the byte tokenizer's vocabulary
KIMI_LINEAR = {**TINY, "vocab_size": V, "kda_output_gate_bias": False}
# Kimi K3's components at a size where the routed experts' inputs (latent 32, ffn 32) are MXFP4 groups of 32
K3 = {
    **KIMI_LINEAR,
    "d_model": 64,
    "expert_ffn_dim": 32,
    "attn_res_block_size": 2,
    "ffn_activation": "situ",
    "expert_latent_dim": 32,
    "mla_output_gate": True,
    "kda_output_gate": "full_rank",
    "kda_output_gate_bias": None,
    "kda_gate": "sigmoid",
}


def ids(seed: int = 0, T: int = 70) -> torch.Tensor:  # 70 > one 64-step KDA chunk
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# --- transformers ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers", reason="transformers not installed: pip install -e '.[test]'")


@pytest.mark.slow  # seconds: a subprocess, transformers' import or a whole run built
def test_transformers_loads_a_kimi_linear_export_and_gives_its_logits(transformers, tmp_path) -> None:
    model = model_with_every_weight_random(KIMI_LINEAR)
    assert write_hf(HF_ADAPTER, model, ByteTokenizer(), tmp_path, shard_bytes=200_000) == "kimi_linear"
    assert (tmp_path / "model.safetensors.index.json").is_file()  # several shards at this size
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = ids()
    with torch.no_grad():
        want, _ = model(x)
        got = theirs(x).logits
    assert relative(got, want) < 1e-4, relative(got, want)


@pytest.mark.slow  # seconds: a subprocess, transformers' import or a whole run built
def test_a_transformers_kimi_linear_imports_and_gives_transformers_logits(transformers, tmp_path) -> None:
    config = transformers.KimiLinearConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
        routed_scaling_factor=1.5, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
        pad_token_id=None, bos_token_id=None, eos_token_id=None, model_max_length=128,
        layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3,
        linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4},
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = transformers.KimiLinearForCausalLM(config).eval()
    with torch.no_grad():  # their init leaves the norms at 1 and the router bias at 0
        for name, p in theirs.named_parameters():
            if "norm" in name or "layernorm" in name:
                p.mul_(1 + 0.2 * torch.randn_like(p))
        for name, b in theirs.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    theirs.save_pretrained(tmp_path)
    ours = read_hf(HF_ADAPTER, tmp_path, say=lambda _: None)
    assert ours.layout == "kimi_linear" and ours.model.config.routed_scaling_factor == 1.5
    x = ids(1)
    with torch.no_grad():
        want = theirs(x).logits
        got, _ = ours.model(x)
    assert relative(got, want) < 1e-4, relative(got, want)


# --- K3 round trip ---------------------------------------------------------------------------------------------------


def test_k3_round_trip_is_bitwise_in_fp32_and_within_bf16_rounding_in_bf16(tmp_path) -> None:
    model = model_with_every_weight_random(K3)
    assert layout_for(model.config) == "kimi_k3"
    write_hf(HF_ADAPTER, model, ByteTokenizer(), tmp_path / "fp32", shard_bytes=100_000)
    config = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["text_config"]["linear_attn_config"]["full_attn_layers"] == [4]
    back = read_hf(HF_ADAPTER, tmp_path / "fp32", say=lambda _: None).model
    assert back.config.architecture() == model.config.architecture()
    mine, theirs = model.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
    write_hf(HF_ADAPTER, model, ByteTokenizer(), tmp_path / "bf16", shard_bytes=10**9, dtype="bf16")
    back = read_hf(HF_ADAPTER, tmp_path / "bf16", say=lambda _: None).model.state_dict()
    kept = kept_in_fp32(model)
    assert {n.split(".")[-2] for n in kept} >= {"mixer", "router"}  # A_log, dt_bias, ...; the router
    for name, tensor in mine.items():
        assert torch.equal(back[name], tensor if name in kept else tensor.to(torch.bfloat16).float()), name


def kept_in_fp32(model: KimiK3) -> set[str]:
    """k3train's names of the tensors a bf16 export keeps in fp32 (the Kimi K3 adapter's KEEP_FP32)."""
    names = hf_names(model.config, "kimi_k3", model.state_dict())
    return {slot.name for hf_name, slot in names.items() if hf_name.endswith(KEEP_FP32)}


# --- a synthetic release ---------------------------------------------------------------------------------------------


def write_release(model: KimiK3, out: Path) -> dict[str, torch.Tensor]:
    """The released K3's form of `model`: bf16, routed experts as MXFP4 pairs, vision keys beside the text model, the
    quantization_config of compressed-tensors. Returns the decoded expert weights the import must produce."""
    out.mkdir()
    experts: dict[str, torch.Tensor] = {}

    def tensors():
        for name, t in to_hf(model.state_dict(), model.config, "kimi_k3"):
            if ".experts." in name:
                packed, scale = encode_mxfp4(t)
                experts[name] = decode_mxfp4(packed, scale, dtype=torch.float32)
                yield name.removesuffix(".weight") + ".weight_packed", packed
                yield name.removesuffix(".weight") + ".weight_scale", scale
            else:
                yield name, t if name.endswith(KEEP_FP32) else t.to(torch.bfloat16)
        yield "vision_tower.blocks.0.weight", torch.zeros(4, 4)
        yield "mm_projector.proj.weight", torch.zeros(4, 4)

    write_shards(tensors(), out, max_shard_bytes=60_000)
    config = to_hf_config(model.config, "kimi_k3", 256, "bfloat16")
    config["text_config"]["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": MXFP4_FORMAT,
        "config_groups": {"group_0": {"format": MXFP4_FORMAT, "targets": ["Linear"]}},
        "ignore": ["re:.*shared_experts.*"],
    }
    (out / "config.json").write_text(json.dumps(config))
    return experts


def test_a_release_shaped_k3_directory_imports_with_mxfp4_experts_and_skips_vision(tmp_path) -> None:
    model = model_with_every_weight_random(K3)
    experts = write_release(model, tmp_path / "release")
    index = json.loads((tmp_path / "release" / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.endswith("A_log") for k in index) and any(k.endswith(".weight_packed") for k in index)
    said: list[str] = []
    back = read_hf(HF_ADAPTER, tmp_path / "release", say=said.append)
    assert back.skipped == 2 and said == ["skipped 2 tensors outside the text model (e.g. mm_projector.proj.weight)"]
    state = back.model.state_dict()
    for hf_name, decoded in experts.items():  # ...layers.L.block_sparse_moe.experts.e.w1.weight
        layer, e = int(hf_name.split(".layers.")[1].split(".")[0]), int(hf_name.split(".experts.")[1].split(".")[0])
        stacked = {"w1": "w_gate", "w3": "w_up", "w2": "w_down"}[hf_name.split(".")[-2]]
        assert torch.equal(state[f"layers.{layer}.ffn.experts.{stacked}"][e], decoded), hf_name
    kept = kept_in_fp32(model)
    for name, tensor in model.state_dict().items():  # A_log exact through its 128-padding; the rest bf16-rounded
        if ".experts." not in name:
            assert torch.equal(state[name], tensor if name in kept else tensor.to(torch.bfloat16).float()), name


# --- bad input -------------------------------------------------------------------------------------------------------


def hf_dir(tmp_path: Path, fields: dict = KIMI_LINEAR, edit=None, config_edit=None) -> Path:
    """A kimi_linear directory of a tiny model; edit(tensors: dict) and config_edit(config) change it first."""
    model = model_with_every_weight_random(fields)
    tensors = dict(to_hf(model.state_dict(), model.config, layout_for(model.config)))
    config = to_hf_config(model.config, layout_for(model.config), 256, "float32")
    if edit:
        edit(tensors)
    if config_edit:
        config_edit(config)
    out = tmp_path / "hf"
    out.mkdir()
    write_shards(tensors.items(), out, max_shard_bytes=100_000)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_unexpected_and_missing_tensors_are_listed_first_five(tmp_path) -> None:
    def edit(t):
        for i in range(6):
            t[f"model.extra.{i}.weight"] = torch.zeros(2)
        for name in [n for n in t if ".experts." in n][:7]:
            del t[name]

    with pytest.raises(HFFormatError) as err:
        read_hf(HF_ADAPTER, hf_dir(tmp_path, edit=edit), say=lambda _: None)
    message = str(err.value)
    assert "6 unexpected (the first five: model.extra.0.weight, model.extra.1.weight" in message
    assert "7 missing (the first five: model.layers.1.block_sparse_moe.experts.0.w1.weight" in message


def test_a_shape_mismatch_names_the_tensor(tmp_path) -> None:
    def edit(t):
        t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)

    with pytest.raises(HFFormatError, match=r"model.layers.0.self_attn.q_proj.weight has shape \[3, 3\]"):
        read_hf(HF_ADAPTER, hf_dir(tmp_path, edit=edit), say=lambda _: None)


def test_an_unsupported_quantization_is_refused(tmp_path) -> None:
    def config_edit(c):
        c["quantization_config"] = {"quant_method": "fp8", "format": "float-quantized"}

    with pytest.raises(HFFormatError, match="quantization 'fp8'.*k3train reads unquantized weights"):
        read_hf(HF_ADAPTER, hf_dir(tmp_path, config_edit=config_edit), say=lambda _: None)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_key_value_heads", 1, "num_key_value_heads=1: k3train cannot build it"),
        ("moe_renormalize", False, "moe_renormalize=False"),
        ("num_expert_group", 4, "topk_group=1: k3train cannot build it \\(below num_expert_group=4"),
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("mla_use_nope", False, "mla_use_nope=False"),
        ("model_type", "llama", "model_type='llama': k3train reads kimi_linear and kimi_k3"),
    ],
)
def test_configs_k3train_cannot_build_are_refused_naming_the_field(field, value, message) -> None:
    model = KimiK3.from_fields(**KIMI_LINEAR)
    config = to_hf_config(model.config, "kimi_linear", 256, "float32")
    config[field] = value
    with pytest.raises(NotExpressible, match=message):
        from_hf_config(config)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({**KIMI_LINEAR, "kda_output_gate_bias": None}, "kda_output_gate_bias is not false"),
        ({**KIMI_LINEAR, "kda_qk_norm_eps": 1e-5}, "kda_qk_norm_eps=1e-05"),
        ({**KIMI_LINEAR, "mla_rope": True}, "mla_rope=true"),
        ({**KIMI_LINEAR, "norm_eps": 1e-5}, "mla_latent_norm_eps=1e-05 \\(effective\\)"),
        ({**K3, "experts_per_token": 1}, "experts_per_token=1"),
    ],
)
def test_models_a_layout_cannot_say_are_refused_naming_the_field(fields, message) -> None:
    model = KimiK3.from_fields(**fields)
    with pytest.raises(NotExpressible, match=message):
        to_hf_config(model.config, layout_for(model.config), 256, "float32")
    with pytest.raises(NotExpressible, match="transformers' kimi_linear has only"):
        to_hf_config(KimiK3.from_fields(**K3).config, "kimi_linear", 256, "float32")


def test_the_clis_refuse_bad_input_with_exit_2_and_write_nothing(tmp_path, capsys) -> None:
    from k3train.export import main as export_main
    from k3train.import_hf import main as import_main

    source = hf_dir(tmp_path)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert import_main([str(source), str(taken)]) == 2
    assert [p.name for p in taken.iterdir()] == ["keep.txt"] and "already exists" in capsys.readouterr().err
    shards = sorted(source.glob("model-*.safetensors"))
    shards[1].unlink()
    assert import_main([str(source), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists() and f"{shards[1].name}, named by" in capsys.readouterr().err
    assert import_main([str(taken), str(tmp_path / "out")]) == 2  # no HF directory at all
    assert "is no Hugging Face" in capsys.readouterr().err
    assert export_main([str(source), str(tmp_path / "out"), "--format", "hf", "--shard-size", "lots"]) == 2
    assert "--shard-size 'lots'" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_import_hf_writes_an_export_generate_and_evaluate_read(tmp_path, capsys) -> None:
    from k3train.import_hf import main as import_main
    from k3train.inference.loading import load

    source = hf_dir(tmp_path)
    assert import_main([str(source), str(tmp_path / "out")]) == 0
    exported = load(tmp_path / "out")
    direct = load(source)  # an HF directory reads as is, too
    assert isinstance(exported.tokenizer, ByteTokenizer) and exported.step is None
    x = ids(2, T=20)
    with torch.no_grad():
        assert torch.equal(exported.model(x)[0], direct.model(x)[0])
    import k3train

    assert torch.equal(k3train.load_model(tmp_path / "out")(x)[0], direct.model(x)[0])
    from k3train.export import main as export_main

    assert export_main([str(tmp_path / "out"), str(tmp_path / "again")]) == 2  # an export is copied, not exported
    assert "already a k3train export" in capsys.readouterr().err and not (tmp_path / "again").exists()
    assert export_main([str(tmp_path / "out"), str(tmp_path / "hf_again"), "--format", "hf"]) == 0  # but converts


# --- train.init_from -------------------------------------------------------------------------------------------------


def model_overrides(fields: dict) -> list[str]:
    """`model.FIELD=VALUE` for every field but the vocabulary (the data's), as Hydra reads them."""

    def yaml(v):
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else f"'{v}'" if ":" in str(v) else v

    return [f"model.{k}={yaml(v)}" for k, v in fields.items() if k != "vocab_size"]


@pytest.mark.slow  # seconds: a subprocess, transformers' import or a whole run built
def test_a_release_trains_from_init_from_and_generates(monkeypatch, tmp_path, tiny_data_dir) -> None:
    from k3train.inference.sampling import Sampler, generate

    from helpers.config import built_run

    model = model_with_every_weight_random(K3)
    write_release(model, tmp_path / "release")
    released = read_hf(HF_ADAPTER, tmp_path / "release", say=lambda _: None).model.state_dict()
    _, parts = built_run(
        monkeypatch, tmp_path / "run", tiny_data_dir, *model_overrides(K3),
        f"train.init_from={tmp_path / 'release'}", "train.max_steps=1", model="k3_tiny",
    )  # fmt: skip
    trainer = parts["trainer"]
    start = trainer.model.state_dict()
    for name, tensor in released.items():
        assert torch.equal(start[name], tensor), name  # step 0 holds the release's weights
    assert trainer.state.step == 0
    before = {k: v.clone() for k, v in start.items()}
    trainer.train_step()
    assert trainer.state.step == 1
    assert not torch.equal(trainer.model.state_dict()["layers.0.ffn.w_up.weight"], before["layers.0.ffn.w_up.weight"])
    tokens = list(generate(trainer.model.eval(), torch.tensor([[1, 2, 3]]), 5, Sampler(temperature=0)))
    assert len(tokens) == 5 and all(t.shape == (1,) and 0 <= int(t) < V for t in tokens)


def test_init_from_a_different_model_is_refused_naming_the_field(monkeypatch, tmp_path, tiny_data_dir) -> None:
    from helpers.config import built_run

    source = hf_dir(tmp_path)  # kimi_linear-form, d_model 32
    other = {**KIMI_LINEAR, "dense_ffn_dim": 64}
    with pytest.raises(ValueError, match=r"its model has dense_ffn_dim=48, this run's 64; pick the model config"):
        built_run(
            monkeypatch, tmp_path / "run", tiny_data_dir, *model_overrides(other), f"train.init_from={source}",
            model="kimi_linear_tiny",
        )  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_a_bpe_tokenizer_travels_with_the_hf_export(tmp_path) -> None:
    from k3train.data.tokenizers import HFTokenizer
    from k3train.inference.loading import load

    from helpers.data import train_tiny_bpe

    tokenizer = HFTokenizer(train_tiny_bpe(tmp_path / "tokenizer.json"), "<|endoftext|>")
    model = model_with_every_weight_random({**KIMI_LINEAR, "vocab_size": tokenizer.vocab_size})
    write_hf(HF_ADAPTER, model, tokenizer, tmp_path / "hf", shard_bytes=10**9)
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == tokenizer.eod_id
    back = load(tmp_path / "hf").tokenizer
    assert isinstance(back, HFTokenizer) and back.identity()["eod_id"] == tokenizer.eod_id
    assert back.encode("def f(): pass").tolist() == tokenizer.encode("def f(): pass").tolist()


@pytest.mark.slow
def test_a_trained_kimi_linear_tiny_run_exported_as_hf_gives_transformers_its_logits(transformers, run_cli, tmp_path):
    """The issue's external check end to end: `python -m k3train model=kimi_linear_tiny` for a few steps, `python -m
    k3train.export RUN OUT --format hf`, transformers' AutoModelForCausalLM on OUT against k3train on the run."""
    import subprocess
    import sys

    import k3train

    run = tmp_path / "run"
    proc = run_cli(
        "model=kimi_linear_tiny", "train.max_steps=3", "train.eval_interval=0", "train.eval_batches=1",
        "train.cpu_threads=1", f"hydra.run.dir={run}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "hf"
    export = subprocess.run(
        [sys.executable, "-m", "k3train.export", str(run), str(out), "--format", "hf", "--shard-size", "2MB"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert export.returncode == 0, export.stderr
    assert "as kimi_linear" in export.stdout and (out / "model.safetensors.index.json").is_file()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = k3train.load_model(run)
    x = ids(3)
    with torch.no_grad():
        want, _ = ours(x)
        got = theirs(x).logits
    assert relative(got, want) < 1e-4, relative(got, want)


def test_tied_embeddings_are_written_twice_and_read_back_as_the_layout_says(tmp_path) -> None:
    """kimi_k3 says whether the model ties them; kimi_linear cannot (transformers 5.24 never ties): untied there."""
    for fields, tied_back in ((K3, True), (KIMI_LINEAR, False)):
        model = model_with_every_weight_random({**fields, "tie_embeddings": True})
        out = tmp_path / str(tied_back)
        write_hf(HF_ADAPTER, model, ByteTokenizer(), out, shard_bytes=10**9)
        assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is tied_back
        back = read_hf(HF_ADAPTER, out, say=lambda _: None).model
        assert back.config.tie_embeddings is tied_back
        assert torch.equal(back.lm_head.weight, model.embed_tokens.weight)
        assert torch.equal(back.embed_tokens.weight, model.embed_tokens.weight)
