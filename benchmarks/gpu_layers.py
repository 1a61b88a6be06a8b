"""k3_small's layers on one GPU: forward + backward of one KDA, one MLA and one MoE layer, and of a dense SwiGLU FFN
doing the MoE's active FLOPs, at k3_small's shapes (batch 8 x 2048 tokens, d_model 512) under bf16 autocast; then
the LM head and its loss at vocab 32768, chunked (k3train), fused (FLA) and through whole logits.

The layers are k3_small's own (conf/model/k3_small.yaml built by Hydra, its first KDA mixer, first MLA mixer and
first MoE), KDA through FLA's Triton kernel when flash-linear-attention is installed, else the pure-PyTorch chunk
path (the JSON says which). Each is timed on random inputs with a fixed random output gradient, median of --reps
after a warm-up (which takes FLA's autotuning), gradients set to None between passes as the Trainer leaves them.
FLOPs per token are k3train/models/k3/flops.py's for each layer (kda_macs, mla_macs, moe_macs: 2 FLOPs per
multiply-add, forward + backward = 3 x forward); MLA's max-logit measurement for QK-Clip is off (the Trainer's
work, timed in gpu_train_step.py).

Issue 27's target: the MoE's achieved FLOP/s >= 60% of a dense SwiGLU's at equal active FLOPs. The dense FFN's
width is the MoE's multiply-adds per token (router, latent projections, the k routed and the shared experts) over
3 d_model, so both do the same FLOPs on the same tokens and the ratio of FLOP/s is the ratio of times. k3_small's
experts run SiTU-GLU, whose fp32 tanh and sigmoid cost more than SwiGLU's silu: a dense FFN with the MoE's own
activation is timed too, so the routing's cost and the activation's show apart.

    python benchmarks/gpu_layers.py                 # needs CUDA (and k3train[gpu] for KDA through FLA)
    python benchmarks/gpu_layers.py --dry-run-cpu   # k3_tiny's layers at tiny shapes on CPU in fp32: exercises
                                                    # this script, its numbers say nothing about a GPU
Writes benchmarks/results/gpu_layers.json (the dry run writes to a temporary file unless --out is given).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_kda_speed import guarded, timed  # benchmarks/ is on sys.path when a script there runs
from hydra.utils import instantiate
from results_file import write_results

from k3train.config import model_option
from k3train.models.common.loss import linear_cross_entropy
from k3train.models.common.swiglu import SwiGLU
from k3train.models.k3.flops import kda_macs, mla_macs, moe_macs
from k3train.models.k3.mla import MultiHeadLatentAttention
from k3train.models.k3.moe import MoE
from k3train.models.kda.layer import KimiDeltaAttention
from k3train.observe.mfu import resolve_peak

ROOT = Path(__file__).resolve().parents[1]
MOE_TARGET = 0.6  # issue 27: MoE FLOP/s >= 60% of the dense SwiGLU's at equal active FLOPs
HEAD_VOCAB = 32768  # k3_small_gpu's tokenizer size
DRY_RUN_NOTE = "CPU dry run: k3_tiny's layers at tiny shapes in fp32; these numbers say nothing about a GPU"


def k3_layers(model_name: str, implementation: str, device: torch.device) -> tuple[object, dict[str, torch.nn.Module]]:
    """conf/model/NAME.yaml's config and its first KDA mixer, first MLA mixer and first MoE, in training mode."""
    cfg = model_option(model_name)
    # the layers never see the vocabulary: the byte one keeps the unused embedding and head small
    cfg.vocab_size, cfg.kda_implementation = 257, implementation
    torch.manual_seed(0)
    model = instantiate(cfg).to(device).train()

    def first(kind: type) -> torch.nn.Module:
        return next(m for m in model.modules() if isinstance(m, kind))

    return model.config, {"kda": first(KimiDeltaAttention), "mla": first(MultiHeadLatentAttention), "moe": first(MoE)}


def dense_ffns(config, device: torch.device) -> tuple[int, dict[str, torch.nn.Module]]:
    """The dense FFN width of the MoE's active FLOPs, and a SwiGLU FFN of it (plus one with the MoE's activation
    when that is not SwiGLU)."""
    width = round(moe_macs(config) / (3 * config.d_model))
    torch.manual_seed(1)
    ffns = {"dense_swiglu": SwiGLU(config.d_model, width)}
    if config.ffn_activation != "swiglu":
        ffns[f"dense_{config.ffn_activation}"] = SwiGLU(
            config.d_model,
            width,
            activation=config.ffn_activation,
            situ_beta=config.situ_beta,
            situ_linear_beta=config.situ_linear_beta,
        )
    return width, {name: ffn.to(device).train() for name, ffn in ffns.items()}


def fwd_bwd(layer: torch.nn.Module, B: int, T: int, d: int, device: torch.device, dtype: torch.dtype) -> Callable:
    """One forward + backward of `layer` on a fixed random input (it needs a gradient too, as inside a model) and a
    fixed random output gradient."""
    generator = torch.Generator(device="cpu").manual_seed(2)
    x = torch.randn(B, T, d, generator=generator).to(device).requires_grad_()
    grad_out = torch.randn(B, T, d, generator=generator).to(device, dtype)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            out = layer(x)
        out.backward(grad_out.to(out.dtype))

    return step


def head_and_loss_steps(config, B: int, T: int, device: torch.device, dtype: torch.dtype) -> dict[str, Callable]:
    """The LM head and its cross-entropy at k3_small's head (N = B x T rows, d_model, vocab 32768), forward +
    backward, three ways: k3train's chunked linear_cross_entropy, FLA's fused one (what `auto` takes on CUDA when
    flash-linear-attention is installed), and the whole logits through F.cross_entropy."""
    generator = torch.Generator(device="cpu").manual_seed(3)
    N, V = B * T, HEAD_VOCAB
    hidden = torch.randn(N, config.d_model, generator=generator).to(device).requires_grad_()
    weight = (0.02 * torch.randn(V, config.d_model, generator=generator)).to(device).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=generator).to(device)

    def step(loss_fn: Callable) -> Callable:
        def run() -> None:
            hidden.grad = weight.grad = None
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = loss_fn()
            loss.backward()

        return run

    return {
        "head_loss_chunked": step(lambda: linear_cross_entropy(hidden, weight, targets, implementation="chunked")),
        "head_loss_fla": step(lambda: linear_cross_entropy(hidden, weight, targets, implementation="fla")),
        "head_loss_whole_logits": step(lambda: F.cross_entropy(F.linear(hidden, weight).float(), targets)),
    }


def measure(step: Callable, training_flops: float, device: torch.device, reps: int, peak: float | None) -> dict:
    times = timed(step, device, reps)
    median = statistics.median(times)
    result = {
        "fwd_bwd_ms_median": 1e3 * median,
        "fwd_bwd_ms_all": [1e3 * t for t in times],
        "training_flops": training_flops,
        "achieved_tflops_per_s": training_flops / median / 1e12,
    }
    if peak:
        result["fraction_of_peak"] = training_flops / median / peak
    if device.type == "cuda":  # what one pass adds over the weights and inputs already held
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        result["peak_added_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run-cpu", action="store_true")
    parser.add_argument("--budget-s", type=float, default=60.0, help="time no new layer after this many seconds")
    parser.add_argument("--reps", type=int, default=None, help="timed passes per layer (10; the dry run 3)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    reps = args.reps or (3 if args.dry_run_cpu else 10)

    if args.dry_run_cpu:
        device, dtype, model_name, (B, T), implementation = (
            torch.device("cpu"),
            torch.float32,
            "k3_tiny",
            (2, 64),
            "chunk",
        )
        out = Path(args.out or Path(tempfile.gettempdir()) / "gpu_layers_dryrun.json")
        peak = None  # a CPU calibration would only time this machine
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_layers.py needs CUDA (use --dry-run-cpu to exercise it on CPU)")
        device, dtype, model_name, (B, T) = torch.device("cuda"), torch.bfloat16, "k3_small", (8, 2048)
        try:
            import fla  # noqa: F401 - only whether it is there
        except ImportError:
            implementation = "chunk"
        else:
            implementation = "fla"
        out = Path(args.out or ROOT / "benchmarks" / "results" / "gpu_layers.json")
        peak = resolve_peak(None, device, "bf16").flops_per_s

    config, k3 = k3_layers(model_name, implementation, device)
    dense_width, ffns = dense_ffns(config, device)
    # the target's two first: a spent budget drops the others
    layers = {"moe": k3["moe"], **ffns, "kda": k3["kda"], "mla": k3["mla"]}
    macs_per_token = {"kda": kda_macs(config, T), "mla": mla_macs(config, T), "moe": moe_macs(config)}
    macs_per_token.update({name: 3 * config.d_model * dense_width for name in ffns})
    report: dict = {
        "dry_run_cpu": args.dry_run_cpu,
        **({"note": DRY_RUN_NOTE} if args.dry_run_cpu else {}),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "model": model_name,
        "kda_implementation": implementation,
        "expert_implementation": getattr(config, "expert_implementation", None),  # the config's choice, e.g. auto
        "B": B,
        "T": T,
        "dtype": str(dtype),
        "d_model": config.d_model,
        "dense_ffn_dim": dense_width,
        "multiply_adds_per_token": macs_per_token,
        "peak_flops_per_s": peak,
        "layers": {},
    }
    if args.dry_run_cpu:
        print(DRY_RUN_NOTE, flush=True)
    for name, layer in layers.items():
        if time.perf_counter() - start > args.budget_s:
            report["layers"][name] = {"skipped": f"past the {args.budget_s:.0f} s budget"}
            continue
        step = fwd_bwd(layer, B, T, config.d_model, device, dtype)
        training_flops = 6.0 * macs_per_token[name] * B * T  # 2 FLOPs per multiply-add, forward + backward = 3x
        guarded(report["layers"], name, lambda s=step, f=training_flops: measure(s, f, device, reps, peak))
    for name, step in head_and_loss_steps(config, B, T, device, dtype).items():
        if time.perf_counter() - start > args.budget_s:
            report["layers"][name] = {"skipped": f"past the {args.budget_s:.0f} s budget"}
            continue
        if name == "head_loss_fla" and device.type != "cuda":
            continue  # FLA's Triton kernels need CUDA
        training_flops = 6.0 * config.d_model * HEAD_VOCAB * B * T  # logits, and the two gradient products
        guarded(report["layers"], name, lambda s=step, f=training_flops: measure(s, f, device, reps, peak))
    moe, dense = report["layers"]["moe"], report["layers"].get("dense_swiglu", {})
    if "achieved_tflops_per_s" in moe and "achieved_tflops_per_s" in dense:
        ratio = moe["achieved_tflops_per_s"] / dense["achieved_tflops_per_s"]
        report["moe_flops_per_s_over_dense_swiglu"] = ratio
        # a dry run's ratio is of CPU kernels at tiny shapes: no verdict on the GPU target
        met = None if args.dry_run_cpu else ratio >= MOE_TARGET
        report["target"] = {"moe_over_dense_swiglu_at_least": MOE_TARGET, "met": met}
        same_activation = report["layers"].get(f"dense_{config.ffn_activation}", {})
        if config.ffn_activation != "swiglu" and "achieved_tflops_per_s" in same_activation:
            report["moe_flops_per_s_over_dense_same_activation"] = (
                moe["achieved_tflops_per_s"] / same_activation["achieved_tflops_per_s"]
            )
        verdict = {None: "CPU dry run, no verdict", True: "met", False: "NOT met"}[met]
        print(f"MoE / dense SwiGLU FLOP/s at equal active FLOPs: {ratio:.2f} (target >= {MOE_TARGET}: {verdict})")
    report["wall_s"] = time.perf_counter() - start
    write_results(out, report)


if __name__ == "__main__":
    main()
