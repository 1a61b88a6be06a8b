"""generate, evaluate and export on a real (tiny) run: `python -m` once, then each command's main() in-process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3train import evaluate, export, generate
from k3train.observe.metrics import read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# k3_tiny shrunk (as test_cli.py's resume case): every layer kind, a few seconds of training.
TINY_K3 = [
    "model=k3_tiny",
    "model.d_model=64",
    "model.expert_ffn_dim=32",
    "model.dense_ffn_dim=64",
    "model.kda_chunk_size=16",
    "train.batch_size=2",
    "train.seq_len=32",
    "train.max_steps=2",
    "train.eval_interval=2",
    "train.eval_batches=2",
    "train.progress=lines",
    "schedule.warmup_steps=1",
]
PROMPT = "The cat"


def python_m(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def run_dir(k3_cache, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("generate") / "run"
    env = {**os.environ, "K3TRAIN_CACHE": str(k3_cache)}
    proc = python_m("k3train", *TINY_K3, f"hydra.run.dir={run}", env=env)
    assert proc.returncode == 0, proc.stderr
    return run


def greedy(source, capsys, *extra: str) -> str:
    assert generate.main([str(source), "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "0", *extra]) == 0
    return capsys.readouterr().out


def test_generate_streams_a_continuation_from_the_run_directory(run_dir):
    proc = python_m(
        "k3train.generate",
        str(run_dir),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "8",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--seed",
        "3",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(PROMPT) and len(proc.stdout) > len(PROMPT)
    assert "1 x 8 new tokens" in proc.stderr and "tok/s decoding, incremental" in proc.stderr


def test_generate_samples_and_prompt_files(run_dir, tmp_path, capsys):
    cached = greedy(run_dir, capsys)
    assert greedy(run_dir / "last.pt", capsys, "--no-cache") == cached  # the cache changes nothing greedy picks
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    assert (
        generate.main([str(run_dir), "--prompt-file", str(prompts), "--num-samples", "2", "--max-new-tokens", "4"]) == 0
    )
    out = capsys.readouterr().out
    assert out.count("=== prompt") == 2 and out.count("--- sample") == 4
    assert "\nfirst prompt" in out and "\nsecond prompt" in out


def test_evaluate_reproduces_the_runs_own_eval_loss_and_writes_json(run_dir, tiny_data_dir, capsys):
    final_eval = [e for e in read_metrics(run_dir / "metrics.jsonl") if e["event"] == "eval"][-1]
    # The run evaluated the first 2 val batches of 2 x 32 tokens with these weights: the same numbers come back.
    assert evaluate.main([str(run_dir), "--batch-size", "2", "--seq-len", "32", "--max-batches", "2"]) == 0
    out = capsys.readouterr().out
    # It names what it measured, as training's eval line does, so the two numbers are read side by side.
    assert "the first 2 batches of 2 x 32, 128 tokens of the val split" in out
    path = Path(out.rsplit("-> ", 1)[1].strip())
    assert path.parent == run_dir and path.name.startswith("last.eval.val.")
    result = json.loads(path.read_text())
    assert result["loss"] == pytest.approx(final_eval["loss"], rel=1e-5)
    assert result["perplexity"] == pytest.approx(torch.tensor(result["loss"]).exp().item(), rel=1e-6)
    assert result["tokens"] == 128 and result["step"] == 2
    assert result["bits_per_byte"] == pytest.approx(result["loss"] * 128 / (0.6931471805599453 * result["bytes"]))

    # Another prepared dataset (same byte tokenizer), as training would name it; its whole val split.
    assert (
        evaluate.main(
            [str(run_dir), "data=prepared", f"data.path={tiny_data_dir}", "--seq-len", "16", "--batch-size", "1"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "val: loss" in out and "the whole val split (" in out and "train.eval_batches" in out


def test_evaluate_that_cannot_write_its_result_says_so_in_one_line_and_exits_1(run_dir, capsys, monkeypatch):
    def full_disk(path, write):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(evaluate, "write_atomic", full_disk)
    assert evaluate.main([str(run_dir), "--batch-size", "2", "--seq-len", "32", "--max-batches", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("k3train.evaluate: error: writing ") and "No space left on device" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_export_is_smaller_and_loads_back_into_generate_and_evaluate(run_dir, tmp_path, capsys):
    out = tmp_path / "exported"
    assert export.main([str(run_dir), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # byte tokenizer: no file
    assert (out / "model.safetensors").stat().st_size < (run_dir / "last.pt").stat().st_size / 1.5
    config = json.loads((out / "config.json").read_text())
    assert config["tokenizer"]["name"] == "byte" and config["model"]["d_model"] == 64 and config["step"] == 2
    capsys.readouterr()
    assert greedy(out, capsys) == greedy(run_dir, capsys)

    args = ["--batch-size", "2", "--seq-len", "32", "--max-batches", "2"]
    assert evaluate.main([str(out), *args]) == 0 and evaluate.main([str(run_dir), *args]) == 0
    from_export, from_run = (
        json.loads(Path(line.rsplit("-> ", 1)[1]).read_text()) for line in capsys.readouterr().out.splitlines()
    )
    assert from_export["loss"] == from_run["loss"]


def test_bad_sources_and_targets_fail_with_one_line(run_dir, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep")
    assert export.main([str(run_dir), str(taken)]) == 2
    assert (taken / "mine.txt").read_text() == "keep"
    dcp = tmp_path / "sharded"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"")
    assert generate.main([str(dcp), "--prompt", "x"]) == 2
    assert evaluate.main([str(run_dir), "optim.lr=1"]) == 2
    assert generate.main([str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert evaluate.main([str(run_dir), "--max-batches", "0"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 5
    assert "already exists" in errors[0] and "sharded" in errors[1] and "cannot be read" in errors[1]
    assert "only data overrides" in errors[2] and "does not exist" in errors[3]
    assert "--max-batches=0 must be >= 1" in errors[4]
