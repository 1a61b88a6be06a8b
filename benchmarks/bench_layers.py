"""Where a k3_small train step's time goes on CPU, and the kernels chosen for its layers against the plain forms.

    python benchmarks/bench_layers.py [--reps 5]

k3_small (conf/model/k3_small.yaml, vocab 32768) at batch 2 x seq 1024, fp32, this machine's threads:
- forward + backward of each layer kind on random inputs (a KDA, an MLA and a MoE layer, the dense FFN, the
  LM head with the loss as the model computes it, k3train/models/common/loss.py) and what the model's layers add up to;
- side by side, alternating, median of `reps`: each choice the model makes against the plain form it replaced:
  MLA's zero-padded values (torch's fused CPU attention) against SDPA's math fallback for dk != dv; the short
  convolution with its written-out backward (CausalConvSiLU) against autograd through the shifted multiply-adds
  and against nn.Conv1d; the routed experts' GroupedSwiGLU (its per-expert loop, the CPU's choice) against autograd
  through `unbind` and a loop and against its grouped-GEMM form (F.grouped_mm, the choice for bf16 on CUDA);
  gathering the expert inputs with index_select against indexing; RMSNorm with its written-out backward against
  nn.RMSNorm;
- Kimi K3's components, each on against off at k3_small's shapes (the same layer built without it, side by side):
  the KDA full-rank output gate against the low-rank one, MLA's output gate, SiTU-GLU against SwiGLU in the MoE and
  the dense FFN, the latent MoE against experts at d_model, and the attention-residual mixes (each mix point at the
  number of sources it has in k3_small, against the residual add it replaces); each difference times its count in
  the model, as a share of the model's estimated step.
Writes benchmarks/results/layers.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from results_file import write_results  # benchmarks/, beside this script

from k3train.config import model_option
from k3train.models.common.attention import causal_attention
from k3train.models.common.loss import linear_cross_entropy
from k3train.models.common.norm import RMSNorm
from k3train.models.k3 import attn_res
from k3train.models.k3 import model as k3_model
from k3train.models.k3.moe import GroupedSwiGLU
from k3train.models.kda.layer import CausalConvSiLU, causal_depthwise_conv
from k3train.runtime.cpu import prepare_cpu_training

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


def variant(cfg, **fields) -> torch.nn.Module:
    """k3_small's layers with `fields` changed: 4 layers (a dense FFN, MoE, 3 KDA and an MLA), the same shapes."""
    c = cfg.copy()
    c.n_layers = 4
    for key, value in fields.items():
        c[key] = value
    torch.manual_seed(0)
    return instantiate(c).train()


def mix_source_counts(model: torch.nn.Module) -> list[int]:
    """How many sources each attention-residual mix point of the model reads, from one short forward."""
    counts: list[int] = []

    def counting(sources, *args):
        counts.append(len(sources))
        return attn_res.attn_res_mix(sources, *args)

    with mock.patch.object(k3_model, "attn_res_mix", counting), torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    return counts


def k3_components(cfg, model: torch.nn.Module, x: torch.Tensor, model_ms: float, reps: int) -> dict:
    """Each K3 component on (k3_small) against off: fwd+bwd ms of the layer with and without it, side by side, and
    (on - off) x its count in k3_small as a share of the model's estimated step (model_ms)."""
    on, pattern = variant(cfg), model.config.layer_pattern
    kda_i, mla_i, moe_i = on.config.layer_pattern.index("kda"), on.config.layer_pattern.index("mla"), cfg.first_k_dense
    n_moe, n_dense = cfg.n_layers - cfg.first_k_dense, cfg.first_k_dense
    low_rank = variant(cfg, kda_output_gate="low_rank").layers[kda_i].mixer
    swiglu = variant(cfg, ffn_activation="swiglu")
    ungated = variant(cfg, mla_output_gate=False).layers[mla_i].mixer
    pairs = {  # component: (layer on, layer off, count in k3_small)
        "kda_full_rank_gate": (on.layers[kda_i].mixer, low_rank, pattern.count("kda")),
        "mla_output_gate": (on.layers[mla_i].mixer, ungated, pattern.count("mla")),
        "situ_moe": (on.layers[moe_i].ffn, swiglu.layers[moe_i].ffn, n_moe),
        "situ_dense_ffn": (on.layers[0].ffn, swiglu.layers[0].ffn, n_dense),
        "latent_moe": (on.layers[moe_i].ffn, variant(cfg, expert_latent_dim=None).layers[moe_i].ffn, n_moe),
    }
    out = {}
    for name, (layer_on, layer_off, count) in pairs.items():
        ms = side_by_side(
            {"on": lambda m=layer_on: m(x), "off": lambda m=layer_off: m(x)},
            [x, *layer_on.parameters(), *layer_off.parameters()],
            reps,
        )
        out[name] = {**ms, "count": count, "share_of_step": count * (ms["on"] - ms["off"]) / model_ms}
    # attention residuals: every mix point at its number of sources, against the residual add it replaces
    counts = mix_source_counts(model)
    norm_w, proj_w = torch.ones(cfg.d_model, requires_grad=True), torch.randn(1, cfg.d_model, requires_grad=True)
    sources = [torch.randn_like(x, requires_grad=True) for _ in range(max(counts))]
    cases = {
        f"mix_{n}": lambda n=n: attn_res.attn_res_mix(sources[:n], norm_w, proj_w, cfg.norm_eps) for n in set(counts)
    }
    cases["residual_add"] = lambda: sources[0] + sources[1]
    ms = side_by_side(cases, [*sources, norm_w, proj_w], reps)
    total_on = sum(ms[f"mix_{n}"] for n in counts)
    total_off = (len(counts) - 1) * ms["residual_add"]  # ordinary residuals: an add per layer input but the first
    out["attn_res"] = {**ms, "mix_points": len(counts), "sources_per_mix": counts}
    out["attn_res"]["share_of_step"] = (total_on - total_off) / model_ms
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    prepare_cpu_training()  # as training on a CPU does
    torch.manual_seed(0)
    cfg = model_option("k3_small")
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
    xs = torch.randn(slots, experts.w_gate.shape[-1], requires_grad=True)  # the latent width in a latent MoE
    weights = (experts.w_gate, experts.w_up, experts.w_down)
    routed = side_by_side(
        {
            "grouped_swiglu": lambda: GroupedSwiGLU.apply(xs, *weights, counts),
            "grouped_swiglu_grouped_mm": lambda: GroupedSwiGLU.apply(xs, *weights, torch.tensor(counts)),
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

    components = k3_components(cfg, model, x, layers["model_estimate"], args.reps)

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
        "k3_components": components,
        "load_avg": [load_before, os.getloadavg()],
    }
    write_results(RESULTS, result, echo=True)


if __name__ == "__main__":
    main()
