"""Where a k3_small train step's time goes on CPU, and the kernels chosen for its layers against the plain forms.

    python benchmarks/bench_layers.py [--reps 5]

k3_small (conf/model/k3_small.yaml, vocab 32768) at batch 2 x seq 1024, fp32, this machine's threads:
- forward + backward of each layer kind on random inputs (a KDA, an MLA and a MoE layer, the dense FFN, the
  LM head with the loss as the model computes it, k3train/models/loss.py) and what the model's layers add up to;
- side by side, alternating, median of `reps`: each choice the model makes against the plain form it replaced:
  MLA's zero-padded values (torch's fused CPU attention) against SDPA's math fallback for dk != dv; the short
  convolution with its written-out backward (CausalConvSiLU) against autograd through the shifted multiply-adds
  and against nn.Conv1d; the routed experts' GroupedSwiGLU against autograd
  through `unbind` and a loop; gathering the expert inputs with index_select against indexing; RMSNorm with its
  written-out backward against nn.RMSNorm.
Writes benchmarks/results/layers.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf
from results_file import write_results  # benchmarks/, beside this script

from k3train.models.k3.mla import causal_attention
from k3train.models.k3.moe import GroupedSwiGLU
from k3train.models.kda.layer import CausalConvSiLU, causal_depthwise_conv
from k3train.models.loss import linear_cross_entropy
from k3train.models.norm import RMSNorm
from k3train.runtime.cpu import prepare_cpu_training

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"
RESULTS = Path(__file__).resolve().parent / "results" / "layers.json"
B, T, VOCAB = 2, 1024, 32768


def fwd_bwd_ms(fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> float:
    """Milliseconds of fn() and a backward of a fixed random cotangent."""
    for t in leaves:
        t.grad = None
    t0 = time.perf_counter()
    out = fn()
    out.backward(torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out))
    return (time.perf_counter() - t0) * 1e3


def side_by_side(cases: dict[str, Callable[[], torch.Tensor]], leaves: list[torch.Tensor], reps: int) -> dict:
    """Each case once per round, alternating; median ms over rounds (the first is a warm-up)."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps + 1):
        for name, fn in cases.items():
            times[name].append(fwd_bwd_ms(fn, leaves))
    return {name: statistics.median(ms[1:]) for name, ms in times.items()}


def loop_experts(x, w_gate, w_up, w_down, counts):
    outs = [
        F.silu(xs @ w_gate[e].T) * (xs @ w_up[e].T) @ w_down[e].T for e, xs in enumerate(x.split(counts)) if xs.shape[0]
    ]
    return torch.cat(outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    prepare_cpu_training()  # as training on a CPU does
    torch.manual_seed(0)
    cfg = OmegaConf.load(CONF / "k3_small.yaml")
    cfg.vocab_size = VOCAB
    model = instantiate(cfg).train()
    load_before = os.getloadavg()
    x = torch.randn(B, T, cfg.d_model, requires_grad=True)
    pattern = model.config.layer_pattern
    kinds = {
        "kda": model.layers[pattern.index("kda")].mixer,
        "mla": model.layers[pattern.index("mla")].mixer,
        "moe": model.layers[cfg.first_k_dense].ffn,
        "dense_ffn": model.layers[0].ffn,
    }
    targets = torch.randint(0, VOCAB, (B * T,))
    cases = {name: (lambda m=m: m(x)) for name, m in kinds.items()}
    cases["head_and_loss"] = lambda: linear_cross_entropy(model.norm(x).flatten(0, 1), model.lm_head.weight, targets)
    layers = side_by_side(cases, [x, *model.parameters()], args.reps)
    n_moe = cfg.n_layers - cfg.first_k_dense
    layers["model_estimate"] = (
        pattern.count("kda") * layers["kda"]
        + pattern.count("mla") * layers["mla"]
        + n_moe * layers["moe"]
        + cfg.first_k_dense * layers["dense_ffn"]
        + layers["head_and_loss"]
    )

    H, dk, dv = cfg.mla_n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    q, k, v = (torch.randn(B, H, T, d, requires_grad=True) for d in (dk, dk, dv))
    attention = side_by_side(
        {
            "padded_fused": lambda: causal_attention(q, k, v, dk**-0.5),
            "sdpa_math_fallback": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=dk**-0.5),
        },
        [q, k, v],
        args.reps,
    )

    kda = kinds["kda"]
    h = torch.randn(B, T, cfg.kda_n_heads * cfg.kda_head_dim, requires_grad=True)
    conv = side_by_side(
        {
            "written_backward": lambda: CausalConvSiLU.apply(h, kda.q_conv.weight),
            "autograd_shifted_multiply_adds": lambda: F.silu(
                causal_depthwise_conv(F.pad(h, (0, 0, cfg.kda_conv_size - 1, 0)), kda.q_conv.weight)
            ),
            "conv1d": lambda: F.silu(kda.q_conv(h.transpose(1, 2))[..., :T].transpose(1, 2)),
        },
        [h, kda.q_conv.weight],
        args.reps,
    )

    experts = kinds["moe"].experts
    slots = B * T * cfg.experts_per_token
    counts = torch.distributions.Multinomial(slots, torch.ones(cfg.n_routed_experts)).sample().long().tolist()
    xs = torch.randn(slots, cfg.d_model, requires_grad=True)
    weights = (experts.w_gate, experts.w_up, experts.w_down)
    routed = side_by_side(
        {
            "grouped_swiglu": lambda: GroupedSwiGLU.apply(xs, *weights, counts),
            "autograd_loop": lambda: loop_experts(xs, *(w.unbind(0) for w in weights), counts),
        },
        [xs, *weights],
        args.reps,
    )
    token_of_slot = torch.randint(0, B * T, (slots,))
    tokens = torch.randn(B * T, cfg.d_model, requires_grad=True)
    gather = side_by_side(
        {
            "index_select": lambda: tokens.index_select(0, token_of_slot),
            "indexing": lambda: tokens[token_of_slot],
        },
        [tokens],
        args.reps,
    )

    residual = torch.randn(B, T, cfg.d_model, requires_grad=True)
    ours, plain = RMSNorm(cfg.d_model, eps=cfg.norm_eps), torch.nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    norm = side_by_side(
        {"written_backward": lambda: ours(residual), "nn_rmsnorm": lambda: plain(residual)},
        [residual, ours.weight, plain.weight],
        args.reps,
    )

    result = {
        "model": "k3_small",
        "batch": B,
        "seq_len": T,
        "vocab_size": VOCAB,
        "reps": args.reps,
        "threads": torch.get_num_threads(),
        "fwd_bwd_ms": layers,
        "choices_fwd_bwd_ms": {
            "mla_attention": attention,
            "short_conv": conv,
            "routed_experts": routed,
            "expert_input_gather": gather,
            "rms_norm": norm,
        },
        "load_avg": [load_before, os.getloadavg()],
    }
    write_results(RESULTS, result, echo=True)


if __name__ == "__main__":
    main()
