"""Export with a Hugging Face tokenizer: tokenizer.json travels with the weights, and the export decodes as the run
did. The run directory is written by hand (a checkpoint, .hydra/config.yaml, run.json), as training leaves it."""

import dataclasses
import json

import pytest
import torch
from omegaconf import OmegaConf

from k3train import export, generate
from k3train.checkpoint.checkpointer import FORMAT_VERSION
from k3train.data import TokenData
from k3train.inference.loading import load
from k3train.models.k3 import KimiK3, KimiK3Config

from helpers.data import make_dataset, train_tiny_bpe
from helpers.tiny_k3 import TINY

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def hf_run(tmp_path):
    from k3train.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(train_tiny_bpe(tmp_path / "tokenizer.json"), "<|endoftext|>")
    data = TokenData(make_dataset(tmp_path, tokenizer=tokenizer))
    torch.manual_seed(0)
    fields = {**TINY, "n_layers": 2, "kda_mla_ratio": "1:1", "dense_ffn_dim": 32, "tie_embeddings": True}
    model = KimiK3(KimiK3Config(**{**fields, "vocab_size": data.vocab_size}))
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    config = {
        "model": {"_target_": "k3train.models.k3.KimiK3.from_fields"},
        "data": {"_target_": "k3train.data.TokenData", "path": str(data.path)},
        "train": {"seq_len": 32},
    }
    OmegaConf.save(OmegaConf.create(config), run / ".hydra" / "config.yaml")
    (run / "run.json").write_text(json.dumps({"data": data.identity()}))
    meta = {"format_version": FORMAT_VERSION, "step": 7, "model_config": dataclasses.asdict(model.config)}
    torch.save({"meta": meta, "model": model.state_dict()}, run / "last.pt")
    return run, tokenizer


def test_export_carries_the_hugging_face_tokenizer(hf_run, tmp_path, capsys):
    run, tokenizer = hf_run
    assert export.main([str(run), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == tokenizer.path.read_bytes()
    exported = load(tmp_path / "out")
    assert exported.tokenizer.identity() == tokenizer.identity() and exported.step == 7
    assert exported.model.lm_head.weight is exported.model.embed_tokens.weight  # tied again after safetensors
    capsys.readouterr()
    args = ["--prompt", "the cat", "--max-new-tokens", "6", "--temperature", "0"]
    assert generate.main([str(run), *args]) == 0
    from_run = capsys.readouterr().out
    assert generate.main([str(tmp_path / "out"), *args]) == 0
    assert capsys.readouterr().out == from_run and from_run.startswith("the cat")
