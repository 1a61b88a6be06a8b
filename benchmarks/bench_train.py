"""The Trainer as a whole: its overhead over a bare loop, and what checkpoints cost.

    python benchmarks/bench_train.py [--rounds 5 --steps 10]

- Framework overhead: the Trainer's fit() against a hand-written loop doing the same work on the same model,
  optimizer, schedule, data and QK-Clip (batch -> forward -> backward -> clip -> step -> QK-Clip -> zero_grad),
  in alternating rounds of `steps` updates, so load from other processes hits both alike. What the Trainer adds:
  loss and grad-norm reads, the train events (model and optimizer diagnostics, metrics.jsonl), progress lines.
  Round-to-round noise on a shared 2-core machine is several percent, so the Trainer's own time is also measured
  directly (trainer_accounting: fit() minus the time inside the shared work).
- Checkpoints: the Trainer's save (write, fsync, rename, previous.pt) and a resume into a freshly built Trainer
  (torch.load(weights_only=True), every part restored), in MB/s, and save + resume as a share of the wall time
  of `checkpoint_interval` updates.
Writes benchmarks/results/train.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from results_file import write_results  # benchmarks/, beside this script

from k3train.checkpoint.checkpointer import Checkpointer
from k3train.config import register_configs
from k3train.data import TokenData
from k3train.models.protocol import document_inputs
from k3train.observe.metrics import MetricsLogger
from k3train.optim import qk_clip
from k3train.run.build import _build_named, build_meta
from k3train.runtime.cpu import prepare_cpu_training
from k3train.runtime.distributed import current_world
from k3train.train.callbacks import Callback
from k3train.train.step import DataParallelStep
from k3train.train.trainer import Loaders, Trainer

RESULTS = Path(__file__).resolve().parent / "results" / "train.json"


def composed(*overrides: str) -> DictConfig:
    """The config `python -m k3train OVERRIDES` runs (the quickstart's with none)."""
    register_configs()
    with initialize_config_module(config_module="k3train.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def build_trainer(cfg: DictConfig, run_dir: Path, data: TokenData, device: torch.device | None = None) -> Trainer:
    """The Trainer build.py builds from cfg, without Hydra's runtime (no run directory claim, no sinks), on `device`
    (the CPU unless given). `data`: anything with TokenData's vocab_size, identity() and loaders()."""
    device = device or torch.device("cpu")
    train_cfg = OmegaConf.to_object(cfg.train)
    torch.manual_seed(train_cfg.seed)
    model = instantiate(cfg.model, vocab_size=data.vocab_size).to(device)  # before the optimizer, as build.py
    optimizer = instantiate(cfg.optim)(model)
    precision = instantiate(cfg.precision)
    train_loader, val_loader = data.loaders(train_cfg.batch_size, train_cfg.seq_len)
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = build_meta(model, optimizer, train_cfg, precision, data, current_world())
    return Trainer(
        step=DataParallelStep(model, precision, device),
        optimizer=optimizer,
        schedule_factory=instantiate(cfg.schedule),
        loaders=Loaders(train_loader, val_loader),
        config=train_cfg,
        metrics=MetricsLogger(run_dir / "metrics.jsonl"),
        checkpointer=Checkpointer(run_dir, meta, train_cfg.keep_last_k),
        callbacks=_build_named(cfg.callbacks, Callback, "callbacks"),
    )


def trainer_round(trainer: Trainer, steps: int) -> float:
    """Seconds per update of trainer.fit() over `steps` updates (its closing checkpoint left out)."""
    trainer.config.stop_after = steps
    trainer.save = lambda wait=None: None  # fit() saves when a session ends: the checkpoint benchmark's business
    with contextlib.redirect_stdout(io.StringIO()):
        t0 = time.perf_counter()
        trainer.fit()
        return (time.perf_counter() - t0) / steps


def bare_round(trainer: Trainer, steps: int, tau: float | None) -> float:
    """Seconds per update of the same work, written out by hand."""
    model, optimizer, loader = trainer.model, trainer.optimizer, trainer.train_loader
    clip = trainer.config.clip_norm
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.schedule.apply(optimizer, trainer.state.step)
        x, y, document_ids = loader.next_batch()
        _, loss = model(x, targets=y, **document_inputs(model, document_ids, x.device))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if tau is not None:
            qk_clip.qk_clip_(model, tau)
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / steps


def framework_overhead(data: TokenData, rounds: int, steps: int, overrides: tuple[str, ...] = ()) -> dict:
    cfg = composed(
        "train.eval_interval=0",
        "train.checkpoint_interval=0",
        "train.max_steps=1000000",
        "train.progress=lines",
        *overrides,
    )
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(cfg, Path(tmp), data)
        tau = cfg.callbacks.qk_clip.tau if "qk_clip" in cfg.callbacks else None
        bare_round(trainer, 1, tau)  # warm-up, both paths
        trainer_round(trainer, 1)
        times: dict[str, list[float]] = {"trainer": [], "bare": []}
        for _ in range(rounds):  # alternating, so load from other processes hits both alike
            times["trainer"].append(trainer_round(trainer, steps))
            times["bare"].append(bare_round(trainer, steps, tau))
        accounting = trainer_accounting(trainer, steps * 2)
    ratios = sorted(t / b - 1 for t, b in zip(times["trainer"], times["bare"]))
    return {
        "overrides": list(overrides),
        "batch_size": cfg.train.batch_size,
        "seq_len": cfg.train.seq_len,
        "rounds": rounds,
        "steps_per_round": steps,
        "step_s": times,
        "trainer_step_s_median": statistics.median(times["trainer"]),
        "bare_step_s_median": statistics.median(times["bare"]),
        "overhead_median_of_rounds": statistics.median(ratios),
        "overhead_of_rounds_quartiles": [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]],
        "overhead_best_over_best": min(times["trainer"]) / min(times["bare"]) - 1,
        "accounting": accounting,
        "load_avg": [load_before, os.getloadavg()],
    }


def trainer_accounting(trainer: Trainer, steps: int) -> dict:
    """The Trainer's own time, measured directly: a fit() of `steps` updates minus the time spent in the work the
    bare loop also does (batches, forward, backward, gradient norm and clipping, optimizer step, QK-Clip,
    zero_grad, the schedule). What is left is its bookkeeping: loss and norm reads, train events, progress,
    stop checks. Unlike the A/B rounds, load from other processes barely moves it (it scales only the small rest).
    """
    shared = {"s": 0.0}

    def timed(fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                shared["s"] += time.perf_counter() - t0

        return wrapper

    patches = [
        (trainer.step, "forward"),  # the model's forward, as the update step calls it
        (trainer.train_loader, "next_batch"),
        (trainer.optimizer, "step"),
        (trainer.optimizer, "zero_grad"),
        (trainer.schedule, "apply"),
        (torch.autograd, "backward"),
        (torch.nn.utils, "get_total_norm"),
        (torch.nn.utils, "clip_grads_with_norm_"),
        *((callback, "after_optimizer_step") for callback in trainer.callbacks.values()),
    ]
    originals = [(obj, name, obj.__dict__[name] if name in vars(obj) else None) for obj, name in patches]
    for obj, name in patches:
        setattr(obj, name, timed(getattr(obj, name)))
    try:
        step_s = trainer_round(trainer, steps)
    finally:
        for obj, name, original in originals:
            if original is None:
                delattr(obj, name)  # an instance attribute we added over a class method
            else:
                setattr(obj, name, original)
    own_s = step_s - shared["s"] / steps
    return {
        "steps": steps,
        "step_s": step_s,
        "shared_work_s_per_step": shared["s"] / steps,
        "trainer_own_s_per_step": own_s,
        "trainer_own_share": own_s / step_s,
    }


def checkpoint_cost(data: TokenData, model: str, overrides: tuple[str, ...] = ()) -> dict:
    """Two updates (the second timed: step_s), two saves (the second also keeps previous.pt), one resume into a
    fresh Trainer; share = (save + resume) / (checkpoint_interval x step_s), a resume per interval being the
    worst case (a preempted job resumes at most once per checkpoint it wrote)."""
    cfg = composed(f"model={model}", "train.eval_interval=0", "train.progress=lines", *overrides)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(cfg, Path(tmp), data)
        trainer.train_step()  # warm-up; fills the optimizer's state
        t0 = time.perf_counter()
        trainer.train_step()
        step_s = time.perf_counter() - t0
        saves = []
        for _ in range(2):
            t0 = time.perf_counter()
            size = trainer.checkpointer.save(trainer.state.step)
            saves.append(time.perf_counter() - t0)
        del trainer
        fresh = build_trainer(cfg, Path(tmp), data)
        t0 = time.perf_counter()
        fresh.resume(Path(tmp) / "last.pt")
        resume_s = time.perf_counter() - t0
    interval = cfg.train.checkpoint_interval
    save_s = statistics.median(saves)
    return {
        "model": model,
        "overrides": list(overrides),
        "bytes": size,
        "save_s": saves,
        "resume_s": resume_s,
        "save_mb_per_s": size / save_s / 1e6,
        "load_mb_per_s": size / resume_s / 1e6,
        "checkpoint_interval": interval,
        "step_s": step_s,
        "share_of_wall": (save_s + resume_s) / (interval * step_s),
        "load_avg": [load_before, os.getloadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    prepare_cpu_training()  # as training on a CPU does
    data = TokenData.builtin()
    overhead = framework_overhead(data, args.rounds, args.steps)
    result = {"framework_overhead": overhead, "checkpoint_k3_tiny": checkpoint_cost(data, "k3_tiny")}
    write_results(RESULTS, result, echo=True)


if __name__ == "__main__":
    main()
