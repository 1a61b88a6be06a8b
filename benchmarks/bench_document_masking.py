"""What document masking costs on CPU at k3_small's shapes, and the MLA attention choice it rests on.

    python benchmarks/bench_document_masking.py [--reps 5] [--seq-len 1024]

k3_small (conf/model/k3_small.yaml) at batch 2 x seq 1024, fp32, forward + backward of a fixed random cotangent,
cases side by side and alternating, the least over `reps` rounds after a warm-up of the process's CPU time and of the
wall time. On one thread (the default, --threads) the CPU time is the work itself, which other processes on a shared
machine barely change; the wall time on a busy machine is mostly theirs. Documents per row (LAYOUTS): one boundary
in the middle; documents of 256 and of 64 tokens, row 1's boundaries half a document later than row 0's; and a mix
of long and short documents (MIXED's lengths, scaled to the row, row 1 in reverse order).
- MLA's attention core (8 heads, dk 96, dv 64): without documents (today's causal kernel), then with them by each
  candidate: one SDPA call over the batch with a dense [B, 1, T, T] block-diagonal causal mask; one masked call per
  row (document_attention with tiles of a whole row); per document (tiles of 1); tiles of >= 128, 256 and 512
  positions. flex_attention is not a candidate: torch 2.13 has no CPU backward for it (NotImplementedError, eager or
  compiled), and torch.nn.attention.varlen has no CPU kernel.
- chunk_kda (8 heads, K = V = 64, chunk 64) without and with document_ids;
- k3_small's KDA and MLA layers whole, without and with document_ids (MLA with the chosen MIN_DOCUMENT_TILE).
Writes benchmarks/results/document_masking.json (document_masking_threads<N>.json with --threads N > 1);
docs/decisions/document-masking.md reads them.
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
from results_file import write_results  # benchmarks/, beside this script

from k3train.config import model_option
from k3train.models.common.attention import MIN_DOCUMENT_TILE, causal_attention, document_attention
from k3train.models.common.documents import block_causal_mask
from k3train.models.kda.chunk import chunk_kda
from k3train.runtime.cpu import cpu_description, prepare_cpu_training

RESULTS = Path(__file__).resolve().parent / "results" / "document_masking.json"
B = 2
LAYOUTS = ("one_boundary_mid_row", "every_256", "every_64", "mixed")
MIXED = (600, 40, 200, 100, 20, 64)  # per 1024 positions


def fwd_bwd_ms(fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor], cotangent: dict) -> tuple[float, float]:
    """(CPU, wall) milliseconds of fn() and its backward of a random cotangent (drawn once per output shape)."""
    for t in leaves:
        t.grad = None
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    if out.shape not in cotangent:
        cotangent[out.shape] = torch.randn_like(out)
    out.backward(cotangent[out.shape])
    return (time.process_time() - cpu) * 1e3, (time.perf_counter() - wall) * 1e3


def side_by_side(cases: dict[str, Callable[[], torch.Tensor]], leaves: list[torch.Tensor], reps: int) -> dict:
    """Each case once per round, alternating; the least CPU and wall ms over the rounds after the first (a warm-up),
    and the median wall ms."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    cotangent: dict = {}
    for _ in range(reps + 1):
        for name, fn in cases.items():
            times[name].append(fwd_bwd_ms(fn, leaves, cotangent))
    return {
        name: {
            "cpu_ms": min(cpu for cpu, _ in ms[1:]),
            "wall_ms": min(wall for _, wall in ms[1:]),
            "median_wall_ms": statistics.median(wall for _, wall in ms[1:]),
        }
        for name, ms in times.items()
    }


def show(label: str, times: dict) -> None:
    print(label, {name: round(t["cpu_ms"], 1) for name, t in times.items() if isinstance(t, dict)}, flush=True)


def document_ids(T: int, layout: str) -> torch.Tensor:
    """[B, T] document_ids of one of LAYOUTS."""
    starts = torch.zeros(B, T, dtype=torch.long)
    if layout == "one_boundary_mid_row":
        starts[:, T // 2] = 1
    elif layout.startswith("every_"):
        length = int(layout.removeprefix("every_"))
        for b, row in enumerate(starts):
            row[(b * length // 2) or length :: length] = 1
    else:
        for row, lengths in zip(starts, (MIXED, MIXED[::-1])):
            ends = torch.tensor(lengths).cumsum(0)[:-1] * T // sum(lengths)
            row[ends] = 1
    return starts.cumsum(1)


def dense_mask_attention(q, k, v, scale, ids):
    """One SDPA call over the batch with the block-diagonal causal mask as a dense [B, 1, T, T] bool (what
    document_attention does off the CPU)."""
    return causal_attention(q, k, v, scale, block_causal_mask(ids).unsqueeze(1))


def mla_candidates(T: int, H: int, dk: int, dv: int, reps: int) -> dict:
    q, k, v = (torch.randn(B, H, T, d, requires_grad=True) for d in (dk, dk, dv))
    scale = dk**-0.5
    out = {}
    for layout in LAYOUTS:
        ids = document_ids(T, layout)
        cases = {
            "no_documents": lambda: causal_attention(q, k, v, scale),
            "dense_mask_one_call": lambda ids=ids: dense_mask_attention(q, k, v, scale, ids),
            "masked_call_per_row": lambda ids=ids: document_attention(q, k, v, scale, ids, min_tile=T),
            "per_document": lambda ids=ids: document_attention(q, k, v, scale, ids, min_tile=1),
            **{
                f"tiles_{m}": lambda ids=ids, m=m: document_attention(q, k, v, scale, ids, min_tile=m)
                for m in (128, 256, 512)
            },
        }
        reference = dense_mask_attention(q, k, v, scale, ids)
        for name, fn in cases.items():  # every candidate computes the same attention
            if name != "no_documents":
                torch.testing.assert_close(fn(), reference, rtol=1e-4, atol=1e-5, msg=name)
        out[layout] = {"documents_per_row": (ids[:, -1] + 1).tolist(), **side_by_side(cases, [q, k, v], reps)}
        show(f"mla_attention {layout}", out[layout])
    return out


def kda_chunk(T: int, H: int, K: int, C: int, reps: int) -> dict:
    q = F.normalize(torch.randn(B, T, H, K), dim=-1).requires_grad_()
    k = F.normalize(torch.randn(B, T, H, K), dim=-1).requires_grad_()
    v = torch.randn(B, T, H, K, requires_grad=True)
    g = (-5 * torch.rand(B, T, H, K)).requires_grad_()  # k3_small's sigmoid gate lies in (-5, 0)
    beta = torch.rand(B, T, H, requires_grad=True)
    out = {}
    for layout in LAYOUTS:
        ids = document_ids(T, layout)
        cases = {
            "no_documents": lambda: chunk_kda(q, k, v, g, beta, chunk_size=C)[0],
            "documents": lambda ids=ids: chunk_kda(q, k, v, g, beta, chunk_size=C, document_ids=ids)[0],
        }
        out[layout] = side_by_side(cases, [q, k, v, g, beta], reps)
        show(f"chunk_kda {layout}", out[layout])
    return out


def layers(cfg, T: int, reps: int) -> dict:
    model = instantiate(cfg, vocab_size=257)  # the layers exactly as k3_small builds them
    kda = next(layer.mixer for layer in model.layers if layer.mixer_type == "kda")
    mla = next(layer.mixer for layer in model.layers if layer.mixer_type != "kda")
    x = torch.randn(B, T, cfg.d_model, requires_grad=True)
    out = {}
    for name, layer in (("kda_layer", kda), ("mla_layer", mla)):
        for layout in LAYOUTS:
            ids = document_ids(T, layout)
            cases = {
                "no_documents": lambda layer=layer: layer(x),
                "documents": lambda layer=layer, ids=ids: layer(x, ids),
            }
            out.setdefault(name, {})[layout] = side_by_side(cases, [x, *layer.parameters()], reps)
            show(f"{name} {layout}", out[name][layout])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: see the docstring)")
    parser.add_argument("--only", choices=("mla", "kda", "layers"), help="one section (default: all)")
    args = parser.parse_args()
    prepare_cpu_training()  # as training on a CPU does
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = model_option("k3_small")
    T = args.seq_len
    load_before = os.getloadavg()
    sections = {
        "mla_attention": lambda: mla_candidates(
            T, cfg.mla_n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, args.reps
        ),
        "chunk_kda": lambda: kda_chunk(T, cfg.kda_n_heads, cfg.kda_head_dim, cfg.kda_chunk_size, args.reps),
        "layers": lambda: layers(cfg, T, args.reps),
    }
    chosen = {"mla": "mla_attention", "kda": "chunk_kda", "layers": "layers"}.get(args.only)
    result = {
        "shapes": {"batch": B, "seq_len": T, "model": "k3_small", "dtype": "fp32"},
        "min_document_tile": MIN_DOCUMENT_TILE,
        "cpu": cpu_description(),
        "threads": torch.get_num_threads(),
        "reps": args.reps,
        **{name: run() for name, run in sections.items() if chosen in (None, name)},
        "load_avg": [load_before, os.getloadavg()],
    }
    write_results(RESULTS if args.threads == 1 else RESULTS.with_stem(f"{RESULTS.stem}_threads{args.threads}"), result)


if __name__ == "__main__":
    main()
