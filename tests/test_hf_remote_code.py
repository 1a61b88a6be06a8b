"""What transformers makes of k3train's HF export: a kimi_k3 export (the default k3_tiny's layout) loads through the
code it carries (k3train/models/k3/hf_remote/, trust_remote_code=True) and gives k3train's logits, a kimi_linear
one loads natively without code, the tokenizer travels so AutoTokenizer loads it (a byte-level tokenizer.json for
the byte tokenizer, a BPE model's own), and export says in one line how to load what it wrote."""

from __future__ import annotations

import json
import re

import pytest
import torch
from omegaconf import OmegaConf

from k3train.data.tokenizers import ByteTokenizer, HFTokenizer
from k3train.hf.write import write_hf
from k3train.inference.loading import Loaded
from k3train.inference.writing import export, how_to_load, write_export
from k3train.models.k3.hf_config import AUTO_MAP
from k3train.models.k3.state_dict_adapter import HF_ADAPTER, REMOTE_CODE

from helpers.config import model_config
from helpers.tiny_k3 import TINY, model_with_every_weight_random

pytestmark = pytest.mark.usefixtures("one_thread")

V = ByteTokenizer.vocab_size
TEXT = "Grüße, 世界 — naïve café ✓\n\ttabs & <b>tags</b> 🙂"
# k3_tiny's Kimi K3 components in their other forms, still the kimi_k3 layout (SiTU-GLU): no attention residuals,
# the low-rank KDA output gate with the softplus decay, no MLA gate, query compression, experts at full width
OTHER_FORMS = {
    "attn_res_block_size": None,
    "kda_output_gate": "low_rank",
    "kda_output_gate_bias": False,
    "kda_gate": "softplus",
    "mla_output_gate": False,
    "q_lora_rank": 32,
    "expert_latent_dim": None,
}


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers", reason="transformers not installed: pip install -e '.[test]'")


def k3_tiny_fields(**changes) -> dict:
    fields = OmegaConf.to_container(model_config("k3_tiny"), resolve=True)
    del fields["_target_"]
    return {**fields, "vocab_size": V, **changes}


def ids(T: int = 70) -> torch.Tensor:  # 70 > one 64-step KDA chunk
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))


@pytest.mark.slow  # seconds: transformers' import and its loading of the remote code
@pytest.mark.parametrize("changes", [{}, OTHER_FORMS], ids=["k3_tiny", "other_forms"])
def test_a_kimi_k3_export_loads_with_its_remote_code_and_gives_k3trains_logits(transformers, tmp_path, changes):
    fields = k3_tiny_fields(**changes)
    if not changes:  # k3_tiny has all five components on
        assert fields["attn_res_block_size"] and fields["ffn_activation"] == "situ" and fields["expert_latent_dim"]
        assert fields["mla_output_gate"] and fields["kda_output_gate"] == "full_rank"
    model = model_with_every_weight_random(fields)
    assert write_hf(HF_ADAPTER, model, ByteTokenizer(), tmp_path, shard_bytes=10**9) == "kimi_k3"
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"] == AUTO_MAP
    for source in REMOTE_CODE:  # the code as the repository keeps it, importing nothing of k3train
        assert (tmp_path / source.name).read_text() == source.read_text()
        assert not re.search(r"^\s*(from|import) k3train", source.read_text(), re.MULTILINE)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, trust_remote_code=True, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # every tensor read, none missing or left over
    x = ids()
    with torch.no_grad():
        want, _ = model(x)
        got = theirs.eval()(x).logits
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    with torch.no_grad():  # greedy generation through GenerationMixin continues as k3train's argmax does
        generated = theirs.generate(x[:1, :8], max_new_tokens=3, do_sample=False)
        expected = x[:1, :8]
        for _ in range(3):
            expected = torch.cat([expected, model(expected)[0][:, -1:].argmax(-1)], dim=1)
    assert generated.tolist() == expected.tolist()


@pytest.mark.slow  # seconds: transformers' import
def test_a_kimi_linear_export_carries_no_code_and_loads_natively(transformers, tmp_path) -> None:
    model = model_with_every_weight_random({**TINY, "vocab_size": V, "kda_output_gate_bias": False})
    assert write_hf(HF_ADAPTER, model, ByteTokenizer(), tmp_path, shard_bytes=10**9) == "kimi_linear"
    assert "auto_map" not in json.loads((tmp_path / "config.json").read_text())
    assert not list(tmp_path.glob("*.py"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = ids()
    with torch.no_grad():
        want, _ = model(x)
        got = theirs(x).logits
    assert ((got - want).abs().max() / want.abs().max()) < 1e-4
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer(TEXT)["input_ids"] == ByteTokenizer().encode(TEXT).tolist()


@pytest.mark.slow  # seconds: transformers' import
def test_a_byte_tokenizer_export_holds_a_byte_level_tokenizer_autotokenizer_loads(transformers, tmp_path) -> None:
    byte = ByteTokenizer()
    write_hf(HF_ADAPTER, model_with_every_weight_random(k3_tiny_fields()), byte, tmp_path, shard_bytes=10**9)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
    encoded = tokenizer(TEXT)["input_ids"]  # no BOS or EOS added: the ids are the text's bytes
    assert encoded == byte.encode(TEXT).tolist() and max(encoded) > 127
    assert tokenizer.decode(encoded) == TEXT
    assert len(tokenizer) == V and tokenizer.eos_token == byte.eod_text and tokenizer.eos_token_id == byte.eod_id
    assert [tokenizer.convert_ids_to_tokens(b) is not None for b in range(256)] == [True] * 256
    # Read back by k3train it is the byte tokenizer again, whose identity a run's prepared data names (evaluate and
    # train.init_from compare them), not a BPE file of the same ids.
    from k3train.inference.loading import load

    assert load(tmp_path).tokenizer.identity() == byte.identity()


@pytest.mark.slow  # seconds: transformers' import
def test_a_bpe_tokenizer_export_loads_in_autotokenizer_with_the_same_ids(transformers, tmp_path) -> None:
    from helpers.data import train_tiny_bpe

    bpe = HFTokenizer(train_tiny_bpe(tmp_path / "tokenizer.json"), "<|endoftext|>")
    model = model_with_every_weight_random({**k3_tiny_fields(), "vocab_size": bpe.vocab_size})
    write_hf(HF_ADAPTER, model, bpe, tmp_path / "hf", shard_bytes=10**9)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    assert tokenizer(TEXT)["input_ids"] == bpe.encode(TEXT).tolist()
    assert tokenizer.eos_token_id == bpe.eod_id


def test_export_says_how_to_load_what_it_wrote(tmp_path, capsys) -> None:
    source = tmp_path / "export"
    source.mkdir()
    model = model_with_every_weight_random(k3_tiny_fields())
    write_export(Loaded(model, ByteTokenizer(), "k3train.models.k3.KimiK3.from_fields", None, None, source, 7), source)
    assert export(source, tmp_path / "hf", fmt="hf") == 0
    line = capsys.readouterr().out.splitlines()[-1]
    out = tmp_path / "hf"
    assert line == (
        f'load it with AutoModelForCausalLM.from_pretrained("{out}", trust_remote_code=True) and '
        f'AutoTokenizer.from_pretrained("{out}", trust_remote_code=True)'
    )
    assert {p.name for p in out.glob("*.py")} == {p.name for p in REMOTE_CODE}
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert how_to_load(out, "kimi_linear") == (
        f'load it with AutoModelForCausalLM.from_pretrained("{out}") and AutoTokenizer.from_pretrained("{out}")'
    )
