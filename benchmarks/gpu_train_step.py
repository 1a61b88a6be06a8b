"""k3_small against its dense peer on one GPU: train steps through the Trainer, bf16, Muon + AdamW, QK-Clip.

Each case builds what `python -m k3train model=NAME precision=bf16 train.batch_size=B train.seq_len=T` builds
(bench_train.build_trainer: model, optimizer, schedule, callbacks and the Trainer) and times Trainer.train_step, the
whole update (forward, backward, gradient norm and clipping, the MuonAdamW step, QK-Clip where the model has MLA),
on one batch of random tokens at vocab 32768 already on the GPU, the same tokens for every model, after warm-up. It
reports tokens/s, peak memory and MFU (the model's training FLOPs per token against the GPU's datasheet peak for
bf16, as the Trainer logs it: k3train/observe/mfu.py), and per batch shape the ratios k3_small / dense_peer.

dense_peer (conf/model/dense_peer.yaml, k3train/models/dense.py) is a Llama-style dense transformer of k3_small's
active parameters, d_model and depth: the tokens/s ratio is what KDA, MLA and the MoE cost at equal active
parameters. The peer attends over the whole sequence in every layer, so it does more FLOPs per token (440 M to
k3_small's 351 M at seq_len 2048); the MFU ratio compares each model's use of the GPU. k3_small runs with KDA
through FLA's Triton kernel (`fla`, needs k3train[gpu]) and through the pure-PyTorch `chunk` path.

Cases run in order of importance and none starts past --budget-s: k3_small/fla and dense_peer at 8 x 2048 first,
then both with train.compile=true (torch.compile on the forward; the warm-up's seconds, compilation included, are
reported as warmup_s). The results file is rewritten after every case.

    python benchmarks/gpu_train_step.py                 # needs CUDA (and k3train[gpu] for the fla cases)
    python benchmarks/gpu_train_step.py --dry-run-cpu   # k3_tiny and a tiny dense_peer at tiny shapes on CPU in
                                                        # fp32: exercises this script, says nothing about a GPU
Writes benchmarks/results/gpu_train_step.json (the dry run writes to a temporary file unless --out is given).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_train import build_trainer, composed  # benchmarks/ is on sys.path when a script there runs
from results_file import write_results

from k3train.data import Batch

ROOT = Path(__file__).resolve().parents[1]
PEER = "dense_peer"
DRY_RUN_NOTE = (
    "CPU dry run: k3_tiny and a tiny dense_peer at tiny shapes in fp32; these numbers say nothing about a GPU"
)
# (model, KDA implementation or None, B, T, train.compile), most important first: a spent budget drops the last
GPU_CASES = [
    ("k3_small", "fla", 8, 2048, False),
    (PEER, None, 8, 2048, False),
    ("k3_small", "fla", 8, 2048, True),  # torch.compile on the whole forward (the Trainer's train.compile=true)
    (PEER, None, 8, 2048, True),
    ("k3_small", "chunk", 8, 2048, False),
    ("k3_small", "fla", 16, 2048, False),
    (PEER, None, 16, 2048, False),
]
GPU_VOCAB = 32768  # k3_small_gpu's tokenizer size: the LM head as a real run has it
DRY_RUN_CASES = [("k3_tiny", "chunk", 2, 64, False), (PEER, None, 2, 64, False)]
DRY_RUN_VOCAB = 257
# the dry run's peer, shrunk to k3_tiny's width and depth so that the CPU pass stays short
DRY_RUN_PEER = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.ffn_dim=256"]


class RandomTokens:
    """What build_trainer needs of TokenData, for one fixed batch of random tokens: the timing is of the update,
    not of reading data (TokenDataLoader's cursor and host-to-device copy are left out)."""

    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0):
        self.vocab_size, self.device, self.seed = vocab_size, device, seed

    def identity(self) -> dict:
        return {"fingerprint": f"random tokens, seed {self.seed}", "val_fingerprint": None}

    def loaders(self, batch_size: int, seq_len: int) -> tuple[SameBatch, SameBatch]:
        generator = torch.Generator().manual_seed(self.seed)
        tokens = torch.randint(0, self.vocab_size, (batch_size, seq_len + 1), generator=generator)
        batch = Batch(tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device))
        return SameBatch(batch), SameBatch(batch)


class SameBatch:
    """A TokenDataLoader that hands out the same batch (no document boundaries) for ever."""

    def __init__(self, batch: Batch):
        self.batch = batch
        self.global_tokens_per_batch = batch.inputs.numel()

    def next_batch(self) -> Batch:
        return self.batch

    def batches_remaining(self) -> int:
        return sys.maxsize

    def reset(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"cursor": 0}

    def load_state_dict(self, state: dict) -> None:
        pass


def run_case(
    model_name: str,
    implementation: str | None,
    B: int,
    T: int,
    data: RandomTokens,
    device: torch.device,
    precision: str,
    steps: int,
    overrides: list[str],
    compiled: bool = False,
) -> dict:
    cfg = composed(
        f"model={model_name}",
        f"precision={precision}",
        f"train.batch_size={B}",
        f"train.seq_len={T}",
        "train.max_steps=1000000",  # a plan the timed steps never reach
        "optim.orthogonality_check_interval=1000000000",  # Muon's diagnostics off: time the update alone
        *([f"model.kda_implementation={implementation}"] if implementation else []),
        *(["train.compile=true"] if compiled else []),
        *overrides,
    )
    with tempfile.TemporaryDirectory() as run_dir:  # the Trainer's checkpointer and metrics: never written here
        trainer = build_trainer(cfg, Path(run_dir), data, device)

        def step() -> None:
            trainer.train_step()
            if device.type == "cuda":
                torch.cuda.synchronize()  # the optimizer step and QK-Clip run after train_step's last host read

        warmup_start = time.perf_counter()
        for _ in range(3):  # warm-up: FLA's autotuning, torch.compile's compilation, the allocator's pools, Muon's
            step()
        warmup_s = time.perf_counter() - warmup_start
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        tokens_per_s = B * T / median
        model, mfu = trainer.model, trainer.mfu
        result = {
            "model": model_name,
            "kda_implementation": implementation,
            "compiled": compiled,
            "warmup_s": warmup_s,
            "B": B,
            "T": T,
            "precision": precision,
            "step_s_median": median,
            "step_s_all": times,
            "tokens_per_s": tokens_per_s,
            "params": model.param_counts(),
            "model_flops_per_token": mfu.flops_per_token["training"],
            "mfu": mfu.of(tokens_per_s),
            "peak_flops_per_s": mfu.peak.flops_per_s,
            "peak_source": mfu.peak.source,
        }
        if device.type == "cuda":
            result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(
        f"{case_label(result):16s} B={B} T={T}: {median * 1e3:8.1f} ms/step  {tokens_per_s:10,.0f} tok/s"
        + (f"  MFU {result['mfu']:.1%}" if result["mfu"] is not None else "")
        + (f"  peak {result['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in result else ""),
        flush=True,
    )
    return result


def case_label(result: dict) -> str:
    implementation = result["kda_implementation"]
    label = f"{result['model']}/{implementation}" if implementation else result["model"]
    return label + ("+compile" if result.get("compiled") else "")


def ratios_to_peer(results: list[dict]) -> list[dict]:
    """For each K3-shaped case, its figures over the dense peer's at the same batch shape."""
    peers = {(r["B"], r["T"], r.get("compiled")): r for r in results if r["model"] == PEER}
    out = []
    for r in results:
        peer = peers.get((r["B"], r["T"], r.get("compiled")))
        if r["model"] == PEER or peer is None:
            continue
        ratio = {"model": case_label(r), "over": PEER, "B": r["B"], "T": r["T"]}
        for key in ("tokens_per_s", "step_s_median", "mfu", "peak_memory_gib"):
            if r.get(key) is not None and peer.get(key):
                ratio[key] = r[key] / peer[key]
        out.append(ratio)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run-cpu", action="store_true")
    parser.add_argument("--budget-s", type=float, default=150.0, help="start no new case after this many seconds")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per case (10; the dry run 2)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    if args.dry_run_cpu:
        device, precision, cases, vocab, steps = torch.device("cpu"), "fp32", DRY_RUN_CASES, DRY_RUN_VOCAB, 2
        out = Path(args.out or tempfile.mkstemp(suffix=".json")[1])
        print(DRY_RUN_NOTE, flush=True)
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_train_step.py needs CUDA (use --dry-run-cpu to exercise it on CPU)")
        device, precision, cases, vocab, steps = torch.device("cuda"), "bf16", GPU_CASES, GPU_VOCAB, 10
        out = Path(args.out or ROOT / "benchmarks" / "results" / "gpu_train_step.json")
    steps = args.steps or steps
    data = RandomTokens(vocab, device)

    start, results, errors = time.time(), [], {}
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    for model_name, implementation, B, T, compiled in cases:
        key = f"{model_name}/{implementation}/B{B}/T{T}" if implementation else f"{model_name}/B{B}/T{T}"
        key += "/compile" if compiled else ""
        if time.time() - start > args.budget_s:
            errors[key] = "skipped: time budget spent"
            continue
        overrides = DRY_RUN_PEER if args.dry_run_cpu and model_name == PEER else []
        try:
            results.append(
                run_case(model_name, implementation, B, T, data, device, precision, steps, overrides, compiled)
            )
        except Exception as exc:  # noqa: BLE001 - record and go on: one failure must not hide the others
            errors[key] = f"{type(exc).__name__}: {exc}"
            print(f"{key}: {errors[key]}", flush=True)
        gc.collect()  # the Trainer's cycles, so that the next case starts from an empty GPU
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # after every case: a part killed at gpu_all's time limit keeps the cases it finished
        report = {
            "dry_run_cpu": args.dry_run_cpu,
            **({"note": DRY_RUN_NOTE} if args.dry_run_cpu else {}),
            "environment": env,
            "results": results,
            "ratios_to_dense_peer": ratios_to_peer(results),
            "errors": errors,
        }
        write_results(out, report)
    for ratio in report["ratios_to_dense_peer"]:
        print(
            f"{ratio['model']} / {PEER} at B={ratio['B']} T={ratio['T']}: "
            + ", ".join(f"{key} {value:.2f}x" for key, value in ratio.items() if isinstance(value, float)),
            flush=True,
        )


if __name__ == "__main__":
    main()
