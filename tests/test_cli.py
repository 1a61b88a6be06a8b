"""`python -m k3train` in subprocesses: exit status, event order, manifest, checkpoint, resume, bad input."""

import importlib.util
import json

import pytest
import torch
from fault_harness import K3_TINY

from k3train.checkpoint.checkpointer import load_checkpoint
from k3train.observe.metrics import read_metrics

pytestmark = pytest.mark.slow

SHAPE = [
    "train.batch_size=2",
    "train.seq_len=32",
    "train.log_interval=1",
    "train.eval_batches=2",
    "train.progress=lines",
    "schedule.warmup_steps=2",
]
TINY = ["model=smoke_test_lm", *SHAPE]  # the plumbing model keeps CLI tests fast


def events(run_dir):
    return read_metrics(run_dir / "metrics.jsonl")


def test_smoke_run_writes_ordered_events_manifest_and_checkpoint(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        *TINY, "train.max_steps=6", "train.eval_interval=3", "train.checkpoint_interval=3", f"hydra.run.dir={run_dir}"
    )
    assert proc.returncode == 0, proc.stderr
    assert "[plumbing: smoke_test_lm]" in proc.stdout  # never passed off as model results
    kinds = [e["event"] for e in events(run_dir)]
    assert kinds == ["session"] + ["train"] * 3 + ["eval", "checkpoint"] + ["train"] * 3 + ["eval", "checkpoint", "end"]
    train = [e for e in events(run_dir) if e["event"] == "train"]
    assert [e["step"] for e in train] == [1, 2, 3, 4, 5, 6]
    assert [e["tokens"] for e in train] == [64 * s for s in range(1, 7)]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "peak_memory_mb"):
        assert key in train[0], key
    assert events(run_dir)[-1]["reason"] == "max_steps"

    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["config"]["train"]["max_steps"] == 6
    assert manifest["model"]["config"]["model_type"] == "smoke_test_lm"
    assert manifest["model"]["params"]["total"] > 0
    assert manifest["data"]["fingerprint"] and manifest["environment"]["torch"] == torch.__version__
    assert [s["end_reason"] for s in manifest["sessions"]] == ["max_steps"]
    assert (run_dir / ".hydra" / "config.yaml").exists()

    ckpt = load_checkpoint(run_dir / "last.pt")
    parts = {"meta", "model", "optimizer", "scaler", "trainer", "plan", "train_loader", "val_loader", "rng", "guard"}
    assert set(ckpt) == parts
    assert ckpt["trainer"]["step"] == 6 and ckpt["trainer"]["tokens"] == 6 * 64
    assert ckpt["train_loader"]["cursor"] == 6 * 64 and ckpt["val_loader"]["cursor"] == 0
    assert ckpt["meta"]["recipe"]["global_batch_size"] == 2
    assert ckpt["meta"]["data"]["fingerprint"] == manifest["data"]["fingerprint"]


# The Kimi K3 case shrinks k3_tiny and uses Muon + AdamW with QK-Clip at a threshold under the initial max logits
# (~0.09), so the optimizer state, the Quantile Balancing buffers and QK-Clip's weight edits all have to survive
# the resume: the fault trials' k3_tiny.
K3_RESUME = K3_TINY


# fp16 on CPU with accumulation, until a small dataset runs out: the GradScaler's state, the micro-batch cursors
# and the schedule's plan must survive too. The scale doubles after every clean update, so it overflows, skips
# updates (which consume data but not steps) and differs from its initial value at the resume.
FP16_ACCUM = [
    "model=smoke_test_lm",
    "precision=fp16",
    "precision.growth_interval=1",
    "precision.init_scale=1048576",
    "train.gradient_accumulation_steps=2",
    "data=prepared",
]


@pytest.mark.parametrize(
    "model", [["model=smoke_test_lm"], K3_RESUME, FP16_ACCUM], ids=["smoke_test_lm", "k3_tiny", "fp16_accum"]
)
def test_exact_resume_in_a_new_process(run_cli, tmp_path, model, tiny_data_dir):
    """N steps straight == N/2 steps, exit, resume in a NEW process, N/2 more: bitwise on CPU.

    The split run is the README's time-sliced command run twice, unchanged: resume=auto train.stop_after=N/2
    (N rounded up to even, so the second slice reaches the end)."""
    n = 8
    limit = [f"data.path={tiny_data_dir}", "train.max_steps=null"] if model is FP16_ACCUM else [f"train.max_steps={n}"]
    common = [
        *SHAPE,
        *model,
        *limit,
        "train.eval_interval=3",
        "train.checkpoint_interval=0",
        "train.deterministic=true",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_cli(*common, f"hydra.run.dir={straight}").returncode == 0
    n = load_checkpoint(straight / "last.pt")["trainer"]["step"]  # 8, or wherever the data ran out
    half = (n + 1) // 2
    sliced = [*common, "resume=auto", f"train.stop_after={half}", f"hydra.run.dir={split}"]
    first = run_cli(*sliced)
    assert first.returncode == 0, first.stderr
    assert load_checkpoint(split / "last.pt")["trainer"]["step"] == half
    second = run_cli(*sliced)
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout

    def losses(run_dir):
        return {e["step"]: e["loss"] for e in events(run_dir) if e["event"] == "train"}

    assert losses(split) == losses(straight)  # every step, both sessions, exactly equal floats
    if model is K3_RESUME:
        clipped = [e["qk_clip"]["n_clipped"] for e in events(straight) if e["event"] == "train"]
        assert sum(clipped) > 0, "tau=0.05 must clip some heads, or this case does not test QK-Clip's resume"
        # A model that counts its FLOPs: a fraction of the calibrated CPU peak in every train event, and run.json
        # says where the peak came from.
        assert all(0 < e["mfu"] < 1 for e in events(straight) if e["event"] == "train")
        flops = json.loads((straight / "run.json").read_text())["flops"]
        assert flops["peak_source"].startswith("calibration: fp32 matmul") and flops["peak_flops_per_s"] > 0
        assert flops["flops_per_token"]["training"] == 3 * flops["flops_per_token"]["forward"] > 0
    evals = lambda d: [(e["step"], e["loss"]) for e in events(d) if e["event"] == "eval"]  # noqa: E731
    assert evals(split) == evals(straight)
    a, b = load_checkpoint(straight / "last.pt"), load_checkpoint(split / "last.pt")
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    for pid, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["optimizer"]["state"][pid][key])), key
    assert a["train_loader"] == b["train_loader"] and a["val_loader"] == b["val_loader"]
    assert a["plan"] == b["plan"] and a["trainer"] == b["trainer"] and a["scaler"] == b["scaler"]
    if model is FP16_ACCUM:
        assert a["trainer"]["skipped_updates"] > 0, "the scaler never overflowed: this case tests too little"
    assert a["rng"]["python"] == b["rng"]["python"] and torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    assert torch.equal(a["rng"]["numpy"]["keys"], b["rng"]["numpy"]["keys"])
    sessions = json.loads((split / "run.json").read_text())["sessions"]
    end = "end_of_data" if model is FP16_ACCUM else "max_steps"
    assert [(s["end_reason"], s["resume_step"]) for s in sessions] == [("stop_after", None), (end, half)]
    kinds = [e["event"] for e in events(split)]
    assert kinds.count("session") == 2 and kinds.count("resume") == 1


def test_resume_refuses_an_incompatible_checkpoint_and_touches_nothing(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli(*TINY, "train.max_steps=2", f"hydra.run.dir={run_dir}").returncode == 0
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    proc = run_cli(
        *TINY, "train.max_steps=4", "model.d_model=32", "train.batch_size=3", "resume=auto", f"hydra.run.dir={run_dir}"
    )
    assert proc.returncode == 2
    assert "d_model was 64, now 32" in proc.stderr and "global_batch_size was 2, now 3" in proc.stderr
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_max_steps_may_change_on_resume(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli(*TINY, "train.max_steps=2", f"hydra.run.dir={run_dir}").returncode == 0
    proc = run_cli(*TINY, "train.max_steps=4", "resume=auto", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    assert load_checkpoint(run_dir / "last.pt")["trainer"]["step"] == 4


def test_a_fresh_run_never_overwrites_an_existing_one(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli(*TINY, "train.max_steps=2", f"hydra.run.dir={run_dir}").returncode == 0
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    proc = run_cli(*TINY, "train.max_steps=2", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2 and "resume=auto" in proc.stderr
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.batch_szie=4", "batch_szie"),
        ("optim=sgd", "optim"),
        ("resume=/nonexistent/last.pt", "no such checkpoint"),
        ("train.device=cuda:0", "CUDA is not available") if not torch.cuda.is_available() else ("train.seed=x", "seed"),
        ("train.seq_len=8192", "max_seq_len"),
        ("data=prepared data.path=/nonexistent/data", "does not exist"),
        ("model=k3_tiny model.kda_mla_ratio=abc", "must look like '3:1'"),
        (
            "model=k3_tiny model.kda_implementation=fla",
            "k3train: error: KDA implementation='fla' needs flash-linear-attention",
        )
        if importlib.util.find_spec("fla") is None
        else ("train.seed=x", "seed"),
    ],
)
def test_bad_input_fails_before_any_work_with_a_clear_message(run_cli, tmp_path, override, message):
    run_dir = tmp_path / "run"
    proc = run_cli(*TINY, "train.max_steps=2", *override.split(), f"hydra.run.dir={run_dir}")
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not any((run_dir / name).exists() for name in ("last.pt", "run.json", "metrics.jsonl"))


def test_divergence_stops_with_a_clear_message(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        *TINY, "train.max_steps=20", "optim.lr=1e30", "train.max_consecutive_skips=3", f"hydra.run.dir={run_dir}"
    )
    assert proc.returncode == 1
    assert "non-finite updates in a row" in proc.stderr
    log = events(run_dir)
    assert [e["event"] for e in log].count("skip") == 3 and log[-1]["reason"] == "diverged"
    assert json.loads((run_dir / "run.json").read_text())["sessions"][-1]["end_reason"] == "diverged"


def test_profiler_writes_a_trace(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        *TINY,
        "train.max_steps=4",
        "profile.enabled=true",
        "profile.wait=1",
        "profile.warmup=1",
        "profile.active=1",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr
    traces = list((run_dir / "profile").glob("*.json"))
    assert traces and traces[0].stat().st_size > 0


def test_kimi_k3_run_records_diagnostics_and_changes_every_weight(run_cli, tmp_path):
    """The default model family through the CLI: Muon + AdamW groups, MoE and optimizer diagnostics in the
    metrics, and every parameter moved away from its (seeded, reproducible) initial value."""
    from k3train.models.k3 import KimiK3
    from k3train.train.rng import seed_everything

    run_dir = tmp_path / "run"
    proc = run_cli(*SHAPE, *K3_RESUME[:-1], "train.max_steps=3", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    assert "plumbing" not in proc.stdout
    assert [e["event"] for e in events(run_dir)] == ["session", "train", "train", "train", "eval", "checkpoint", "end"]
    train = [e for e in events(run_dir) if e["event"] == "train"]
    assert any(k.startswith("moe/") and k.endswith("/load_max") for k in train[-1]["model"])
    assert any(k.endswith("/update_rms") for k in train[-1]["optimizer"])
    assert set(train[-1]["lr"]) >= {"muon_attention", "muon_experts", "adamw_embed"}
    assert train[-1]["qk_clip"]["max_logit"]
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["model"]["class"] == "KimiK3"
    assert manifest["model"]["params"]["active"] < manifest["model"]["params"]["total"]
    assert {g["kind"] for g in manifest["optimizer"]} == {"muon", "adamw"}

    seed_everything(manifest["config"]["train"]["seed"])
    initial = KimiK3.from_fields(**manifest["model"]["config"]).state_dict()
    trained = load_checkpoint(run_dir / "last.pt")["model"]
    unchanged = [
        n
        for n, p in KimiK3.from_fields(**manifest["model"]["config"]).named_parameters()
        if p.requires_grad and torch.equal(initial[n], trained[n])  # layer 0's unused attention mix is frozen
    ]
    assert not unchanged, f"parameters never updated: {unchanged}"


def test_output_layout_for_runs_and_sweeps(run_cli, tmp_path, monkeypatch):
    """Single runs land in <root>/runs/<date>/<time>/, multirun jobs in <root>/sweeps/<date>/<time>/<job.num>/."""
    monkeypatch.setenv("K3TRAIN_OUTPUTS", str(tmp_path))
    assert run_cli(*TINY, "train.max_steps=1").returncode == 0
    runs = list(tmp_path.glob("runs/*/*/run.json"))
    assert len(runs) == 1 and (runs[0].parent / "last.pt").exists()

    proc = run_cli("-m", *TINY, "train.max_steps=1", "optim.lr=1e-3,2e-3")
    assert proc.returncode == 0, proc.stderr
    jobs = sorted(tmp_path.glob("sweeps/*/*/*/run.json"))
    assert [p.parent.name for p in jobs] == ["0", "1"]
    lrs = [json.loads(p.read_text())["config"]["optim"]["lr"] for p in jobs]
    assert lrs == [1e-3, 2e-3]
    assert all((p.parent / "metrics.jsonl").exists() and (p.parent / "last.pt").exists() for p in jobs)


def test_a_diverged_job_does_not_end_the_sweep(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("K3TRAIN_OUTPUTS", str(tmp_path))
    proc = run_cli("-m", *TINY, "train.max_steps=3", "train.max_consecutive_skips=1", "optim.lr=1e30,1e-3")
    assert proc.returncode != 0 and "diverged" in proc.stderr  # the sweep reports the failed job...
    jobs = {p.parent.name: json.loads(p.read_text()) for p in tmp_path.glob("sweeps/*/*/*/run.json")}
    assert [jobs[k]["sessions"][-1]["end_reason"] for k in sorted(jobs)] == ["diverged", "max_steps"]  # ...and ran on


def test_optimizer_settings_may_change_on_resume(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    assert (
        run_cli(*TINY, "optim=adamw", "train.max_steps=2", "optim.lr=1e-3", f"hydra.run.dir={run_dir}").returncode == 0
    )
    proc = run_cli(
        *TINY,
        "optim=adamw",
        "train.max_steps=4",
        "optim.lr=2e-3",
        "optim.weight_decay=0.0",
        "resume=auto",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr
    resume = next(e for e in events(run_dir) if e["event"] == "resume")
    assert resume["changed_settings"]["decay.initial_lr"] == [1e-3, 2e-3]
    assert resume["changed_settings"]["decay.weight_decay"] == [0.1, 0.0]
    groups = load_checkpoint(run_dir / "last.pt")["optimizer"]["param_groups"]
    assert {g["initial_lr"] for g in groups} == {2e-3} and {g["weight_decay"] for g in groups} == {0.0}
    manifest = json.loads((run_dir / "run.json").read_text())
    assert {g["initial_lr"] for g in manifest["optimizer"]} == {2e-3}  # run.json agrees with what ran


def test_sigterm_checkpoints_at_an_update_boundary_and_resume_continues_exactly(k3_cache, run_cli, tmp_path):
    """Preemption: SIGTERM mid-run -> checkpoint at the next update boundary, the process ends by the signal, and
    resume=auto continues to the same losses as a run that was never interrupted. A constant schedule makes the
    lr independent of max_steps, so the uninterrupted reference can stop where the resumed run stops."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import REPO

    common = [
        *TINY,
        "schedule=warmup_constant",
        "train.log_interval=1",
        "train.eval_interval=0",
        "train.checkpoint_interval=0",
        "train.deterministic=true",
    ]
    run_dir, straight = tmp_path / "run", tmp_path / "straight"
    env = {**os.environ, "K3TRAIN_CACHE": str(k3_cache), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "k3train", *common, "train.max_steps=1000000", f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:  # the first step line: training is under way; the run is far from its end
        if "| loss " in line:
            proc.send_signal(signal.SIGTERM)
            break
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, stderr  # ended by the signal, as the scheduler expects
    end = events(run_dir)[-1]
    assert end["event"] == "end" and end["reason"] == "signal:SIGTERM" and end["step"] >= 1
    assert load_checkpoint(run_dir / "last.pt")["trainer"]["step"] == end["step"]
    assert json.loads((run_dir / "run.json").read_text())["sessions"][-1]["end_reason"] == "signal:SIGTERM"

    n = end["step"] + 5
    assert run_cli(*common, f"train.max_steps={n}", "resume=auto", f"hydra.run.dir={run_dir}").returncode == 0
    assert run_cli(*common, f"train.max_steps={n}", f"hydra.run.dir={straight}").returncode == 0
    losses = lambda d: {e["step"]: e["loss"] for e in events(d) if e["event"] == "train"}  # noqa: E731
    assert losses(run_dir) == losses(straight) and len(losses(straight)) == n


def test_a_refused_run_leaves_the_existing_runs_hydra_files_alone(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli(*TINY, "train.max_steps=2", f"hydra.run.dir={run_dir}").returncode == 0
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    proc = run_cli(*TINY, "train.max_steps=3", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_resume_from_an_earlier_checkpoint_of_the_same_run(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    assert (
        run_cli(
            *TINY, "train.max_steps=4", "train.checkpoint_interval=2", "train.keep_last_k=2", f"hydra.run.dir={run_dir}"
        ).returncode
        == 0
    )
    assert (run_dir / "step_0000002.pt").exists()
    proc = run_cli(*TINY, "train.max_steps=4", f"resume={run_dir / 'step_0000002.pt'}", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    resume = [e for e in events(run_dir) if e["event"] == "resume"]
    assert resume[-1]["step"] == 2 and load_checkpoint(run_dir / "last.pt")["trainer"]["step"] == 4
