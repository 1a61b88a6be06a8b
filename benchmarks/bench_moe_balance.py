"""Quantile Balancing: ties at the old bias and how even the loads get, before and after the tie-break.

"before" is the rule without a tie-break (r = (k+1)-th largest of s + b, minus s, for every expert); "after" is
k3train.models.k3.moe.required_bias. Both feed the same quantile step (moe.quantile_bias) and mean-centring.
Router logits are randn + linspace(-2, 2) over experts (as in tests/test_moe.py: at step 0 the top experts get
~3x their share). Per case (tokens N, experts n, top-k):
- ties: tokens whose r equals the expert's old bias exactly, and how often the m-th and (m+1)-th smallest r are
  equal (the new bias then stays the old one and the whole tied block stays out);
- admitted: tokens with r below the new bias, against m = N k / n (the docstring's claim: exactly m);
- fixed batch: QB repeated on ONE batch; min/max expert load after 10 and 30 steps;
- fresh stream: a new batch every step; per step the worst |load / mean - 1|; the first step from which every
  later one is within +-20%; the share of steps within +-20% (steps 10+);
- noise floor: the same fresh stream routed with a converged bias held fixed (QB on 50k-token batches), which no rule
  that sets the bias from the previous batch can beat.

    python benchmarks/bench_moe_balance.py [--seeds 5] [--steps 60]
Writes benchmarks/results/moe_balance.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch
from results_file import write_results  # benchmarks/, beside this script

from k3train.models.k3.moe import quantile_bias, required_bias

RESULTS = Path(__file__).resolve().parent / "results" / "moe_balance.json"
CASES = [(256, 16, 2), (2048, 8, 2), (2048, 16, 2)]  # (tokens, experts, top-k)
SKEW = 2.0


def required_bias_untied(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """The rule before the tie-break: one cutoff, the (k+1)-th largest, for every expert."""
    return torch.topk(scores + bias, k + 1, dim=-1).values[:, -1:] - scores


RULES = {"before": required_bias_untied, "after": required_bias}


def batch_scores(gen: torch.Generator, n_tokens: int, n_experts: int) -> torch.Tensor:
    logits = torch.randn(n_tokens, n_experts, generator=gen) + torch.linspace(-SKEW, SKEW, n_experts)
    return torch.sigmoid(logits)


def loads(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    experts = torch.topk(scores + bias, k, dim=-1).indices
    return torch.bincount(experts.reshape(-1), minlength=scores.shape[1])


def worst_deviation(load: torch.Tensor) -> float:
    return (load / load.float().mean() - 1).abs().max().item()


def qb_step(rule, scores: torch.Tensor, bias: torch.Tensor, k: int) -> dict:
    """One QB update: the new (centred) bias and what the tie and admission counts were."""
    N, n = scores.shape
    m = min(max(round(N * k / n), 1), N - 1)
    required = rule(scores, bias, k)
    raw = quantile_bias(required, k)
    lowest = torch.topk(required, m + 1, dim=0, largest=False).values
    return {
        "bias": raw - raw.mean(),
        "tied_at_old_bias": (required == bias).sum(0).tolist(),  # per expert
        "quantile_in_tie": (lowest[m - 1] == lowest[m]).sum().item(),  # experts
        "admitted": (required < raw).sum(0).tolist(),  # per expert, vs m
    }


def first_settled(worst: list[float], tol: float = 0.2) -> int | None:
    settled = [i for i in range(len(worst)) if max(worst[i:]) <= tol]
    return settled[0] if settled else None


def fresh_stream(rule, n_tokens: int, n_experts: int, k: int, steps: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    bias = torch.zeros(n_experts)
    worst, cv, same_batch, tied, in_tie, admitted = [], [], [], [], 0, []
    for step in range(steps):
        scores = batch_scores(gen, n_tokens, n_experts)
        load = loads(scores, bias, k)
        worst.append(worst_deviation(load))
        cv.append((load.float().std() / load.float().mean()).item())
        update = qb_step(rule, scores, bias, k)
        bias = update["bias"]
        same_batch.append(worst_deviation(loads(scores, bias, k)))  # the batch the bias was set from
        if step > 0:  # at step 0 every bias is 0, so every expert's r ties there trivially
            tied += update["tied_at_old_bias"]
            in_tie += update["quantile_in_tie"]
            admitted += update["admitted"]
    tail = slice(10, None)
    return {
        "settled_step": first_settled(worst),
        "median_worst_dev": statistics.median(worst[tail]),
        "median_load_cv": statistics.median(cv[tail]),
        "share_within_20pct": sum(w <= 0.2 for w in worst[tail]) / len(worst[tail]),
        "same_batch_median_worst_dev": statistics.median(same_batch[tail]),
        "tied_at_old_bias_max": max(tied),
        "tied_at_old_bias_median": statistics.median(tied),
        "quantile_in_tie_share": in_tie / ((steps - 1) * n_experts),
        "admitted_min": min(admitted),
        "admitted_max": max(admitted),
    }


def fixed_batch(rule, n_tokens: int, n_experts: int, k: int, seed: int) -> dict:
    scores = batch_scores(torch.Generator().manual_seed(seed), n_tokens, n_experts)
    bias, out = torch.zeros(n_experts), {}
    for step in range(1, 31):
        bias = qb_step(rule, scores, bias, k)["bias"]
        if step in (10, 30):
            load = loads(scores, bias, k)
            out[f"load_min_max_step{step}"] = [load.min().item(), load.max().item()]
    return out


def noise_floor(n_tokens: int, n_experts: int, k: int, steps: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    bias = torch.zeros(n_experts)
    for _ in range(15):
        bias = qb_step(required_bias, batch_scores(gen, 50_000, n_experts), bias, k)["bias"]
    worst = [worst_deviation(loads(batch_scores(gen, n_tokens, n_experts), bias, k)) for _ in range(steps)]
    return {"median_worst_dev": statistics.median(worst), "share_within_20pct": sum(w <= 0.2 for w in worst) / steps}


def summarise(runs: list[dict]) -> dict:
    """Per metric: the list over seeds."""
    return {key: [r[key] for r in runs] for key in runs[0]}


def bench_case(n_tokens: int, n_experts: int, k: int, seeds: int, steps: int) -> dict:
    result: dict = {"tokens": n_tokens, "experts": n_experts, "top_k": k, "m": round(n_tokens * k / n_experts)}
    for name, rule in RULES.items():
        result[name] = {
            "fresh_stream": summarise([fresh_stream(rule, n_tokens, n_experts, k, steps, s) for s in range(seeds)]),
            "fixed_batch": summarise([fixed_batch(rule, n_tokens, n_experts, k, s) for s in range(seeds)]),
        }
    result["noise_floor_fixed_bias"] = summarise([noise_floor(n_tokens, n_experts, k, steps, s) for s in range(seeds)])
    print(f"N={n_tokens:5d} n={n_experts:2d} k={k} m={result['m']}")
    for name in RULES:
        f = result[name]["fresh_stream"]
        print(
            f"  {name:6s} tied<= {max(f['tied_at_old_bias_max']):4d}  quantile in a tie "
            f"{statistics.mean(f['quantile_in_tie_share']):5.1%}  admitted {min(f['admitted_min'])}-"
            f"{max(f['admitted_max'])}  same-batch worst {statistics.mean(f['same_batch_median_worst_dev']):.3f}  "
            f"fresh worst {statistics.mean(f['median_worst_dev']):.3f} cv {statistics.mean(f['median_load_cv']):.3f}"
            f"  within 20% {statistics.mean(f['share_within_20pct']):5.1%}  settled {f['settled_step']}  "
            f"fixed-batch step10 {result[name]['fixed_batch']['load_min_max_step10']}"
        )
    floor = result["noise_floor_fixed_bias"]
    print(
        f"  floor  fresh worst {statistics.mean(floor['median_worst_dev']):.3f}  "
        f"within 20% {statistics.mean(floor['share_within_20pct']):5.1%}"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    out = {
        "benchmark": __doc__.split("\n\n")[0],
        "torch": torch.__version__,
        "seeds": args.seeds,
        "steps": args.steps,
        "logit_skew": SKEW,
        "load_avg_at_start": os.getloadavg(),
        "cases": [bench_case(*case, args.seeds, args.steps) for case in CASES],
    }
    write_results(RESULTS, out)


if __name__ == "__main__":
    main()
