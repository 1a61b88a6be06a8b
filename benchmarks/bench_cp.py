"""Context parallelism against one process: k3_small's KDA and MLA layers at seq 8192, and a whole model's memory.

    python benchmarks/bench_cp.py                  # 4-5 minutes on 2 cores
    python benchmarks/bench_cp.py --no-two-threads # cp=1 on 1 thread only
    python benchmarks/bench_cp.py --quick          # a smoke test (seq 256, k3_tiny's memory): writes nothing unless
                                                   # --out is given

Layers: k3_small (conf/model/k3_small.yaml, instantiated by hydra with vocab 257, fp32, seed 0) gives its first KDA
layer's and first MLA layer's mixer, as benchmarks/bench_document_masking.py's `layers()` takes them. Each is run
forward + backward of a fixed random cotangent on one row of --seq positions (batch 1) three ways, alternating step
by step in one pair of gloo processes: cp=1 on 1 thread (rank 0 holds the whole row while rank 1 waits in a
barrier, measured idle), cp=1 on 2 threads (the same cores as the 2 ranks), and cp=2 (set_context_parallel: each
rank its half of the row, 1 thread each). Without documents and with one boundary at 3/8 of the row (the second
document runs across the split, so rank 1 continues its state and conv window). The first step's cp=2 outputs and
input gradients are checked against cp=1's on the whole row.

Counting: this process wraps what ContextParallel.gather calls (all_gather_single_autograd) and labels each call by
its caller: KDA's [M | F] summaries and its slices' document ends (context_parallel_chunk_kda), the conv tails and
their document ids (previous_tail), MLA's latent and its document ids. Bytes are those handed to torch.distributed
(k3train.plan's convention: an all-gather's output, a reduce-scatter's input: its backward, timed by hooks on the
all_gather_into_tensor autograd node); a rank sends and receives (ranks - 1) / ranks of that (on 2 ranks, exactly
the one piece the other rank holds). Each collective is timed after an untimed barrier (its seconds are the
exchange; the barrier's are `wait`). chunk_kda is wrapped too: its forward, and its autograd node's backward, per
pass (cp=1's one pass over the row; cp=2's zero-state and identity passes per rank).

Memory: a whole model (k3_small, or --memory-model) in fresh processes under MALLOC_MMAP_THRESHOLD_=131072 (every
tensor past 128 KiB is its own mapping, returned when freed, so the resident memory follows the bytes alive; see
benchmarks/bench_plan.py), training mode, 1 thread a rank, after a short warm-up step: the resident memory the
forward (to the loss) adds, and the peak the backward reaches over it (the kernel's high-water mark reset after the
forward), cp=1 on the whole row of --memory-seq against cp=2 with half each (the MoE's Quantile Balancing over both
ranks, as a run's data-parallel group makes it). Split by part from the resident memory at each block's and each
mixer's start and end (hooks), and chunk_kda's share of the KDA mixers' (each call's growth: what it saves and
returns).
Writes benchmarks/results/cp.json (or --out) with the CPU, torch's SIMD level, the load average and thread counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

# As `python -m k3train` does (k3train/runtime/cpu.py), before torch loads OpenMP: idle threads sleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from process_memory import peak_mib, reset_peak, rss_mib  # noqa: E402  benchmarks/, beside this script

from k3train.config import model_option

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "cp.json"
RANKS = 2
VOCAB = 257  # the built-in byte-level corpus
MiB = 2**20
LIVE = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # benchmarks/bench_plan.py: resident memory follows the bytes alive
CONFIGS = ("cp1_1thread", "cp1_2threads", "cp2")
DOCS = ("none", "one_boundary")


# ---- counting: the exchanges of a timed step, with their bytes and seconds ----------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.active, self.events = False, []

    def start(self) -> None:
        self.events, self.active = [], True

    def add(self, kind: str, phase: str, s: float, **bytes_) -> None:
        if self.active:
            self.events.append({"kind": kind, "phase": phase, "s": s, **bytes_})

    def wait_for_peers(self, group, phase: str) -> None:
        """Untimed for the exchange: the other rank reaches the collective too (kept as `wait`)."""
        t0 = time.perf_counter()
        dist.barrier(group=group)
        self.add("wait", phase, time.perf_counter() - t0)


REC = Recorder()


def _node_named(out: torch.Tensor, name: str):
    """The autograd node whose name contains `name` at or under out.grad_fn (breadth first, a few levels)."""
    level = [out.grad_fn]
    for _ in range(8):
        for node in level:
            if node is not None and name in node.name():
                return node
        level = [n for node in level if node is not None for n, _ in node.next_functions]
    raise RuntimeError(f"no {name} autograd node under {out.grad_fn}: torch or k3train changed")


def _time_backward(node, on_done, before=None) -> None:
    """on_done(seconds, CPU seconds, grad_inputs, grad_outputs) around `node`'s backward; before(): untimed, first."""
    start: dict = {}

    def pre(grad_outputs):
        if before is not None:
            before()
        start["t"], start["cpu"] = time.perf_counter(), time.process_time()

    def post(grad_inputs, grad_outputs):
        on_done(time.perf_counter() - start["t"], time.process_time() - start["cpu"], grad_inputs, grad_outputs)

    node.register_prehook(pre)
    node.register_hook(post)


def _label(caller, t: torch.Tensor) -> str:
    """What an exchange carries, from the function that called ContextParallel.gather."""
    ids = not t.is_floating_point()
    name = caller.f_code.co_name
    if name == "previous_tail":
        return "conv tail: document ids" if ids else "conv tail: q, k, v inputs"
    if name == "context_parallel_chunk_kda":
        return "KDA: slices' document ends" if ids else "KDA: summaries [M | F]"
    if "mla" in caller.f_code.co_filename:
        return "MLA: document ids" if ids else "MLA: latent [c_kv | k_rope]"
    return f"other: {name}"


def counted_gather(real):
    """k3train.models.common.context_parallel's all_gather_single_autograd, counted and timed (forward and backward)."""

    def gather(t, gather_dim, group, tag=""):
        if not REC.active:
            return real(t, gather_dim=gather_dim, group=group, tag=tag)
        kind = _label(sys._getframe(2), t)  # 0: here, 1: ContextParallel.gather, 2: its caller
        share = (dist.get_world_size(group) - 1) / dist.get_world_size(group)
        REC.wait_for_peers(group, "forward")
        t0 = time.perf_counter()
        out = real(t, gather_dim=gather_dim, group=group, tag=tag)
        if hasattr(out, "trigger_wait"):  # an AsyncCollectiveTensor: the exchange finishes at the first use
            out.trigger_wait()
        payload = out.numel() * out.element_size()
        REC.add(kind, "forward", time.perf_counter() - t0, payload=payload, sent=payload * share)
        if out.requires_grad:  # its backward: a reduce-scatter of the gradient of what was gathered

            def done(s, cpu, grad_inputs, grad_outputs):
                rs = grad_outputs[0].numel() * grad_outputs[0].element_size()
                REC.add(kind, "backward", s, payload=rs, sent=rs * share)

            _time_backward(
                _node_named(out, "all_gather_into_tensor"), done, lambda: REC.wait_for_peers(group, "backward")
            )
        return out

    return gather


def timed_chunk_kda(real, where: str):
    """chunk_kda's forward and its kernel's backward (the _ChunkKDA node), labelled by pass."""

    def chunk_kda(q, k, v, g, beta, *args, **kwargs):
        if not REC.active:
            return real(q, k, v, g, beta, *args, **kwargs)
        if where == "layer":
            label = "one pass (cp=1)"
        else:
            label = "zero-state pass" if kwargs.get("initial_state") is None else "identity pass (cp's second)"
        kind, t0, cpu = f"chunk_kda: {label}", time.perf_counter(), time.process_time()
        o, S = real(q, k, v, g, beta, *args, **kwargs)
        REC.add(kind, "forward", time.perf_counter() - t0, cpu=time.process_time() - cpu)
        if o.requires_grad:
            _time_backward(_node_named(o, "ChunkKDA"), lambda s, c, gi, go: REC.add(kind, "backward", s, cpu=c))
        return o, S

    return chunk_kda


def install_counters() -> None:
    from k3train.models import context_parallel
    from k3train.models.kda import context_parallel as kda_cp
    from k3train.models.kda import layer as kda_layer

    context_parallel.all_gather_single_autograd = counted_gather(context_parallel.all_gather_single_autograd)
    kda_cp.chunk_kda = timed_chunk_kda(kda_cp.chunk_kda, "cp")
    kda_layer.chunk_kda = timed_chunk_kda(kda_layer.chunk_kda, "layer")


# ---- what each rank runs ------------------------------------------------------------------------------------------


def build_model(name: str, seq: int):
    """The model as conf/model/<name>.yaml builds it (vocab 257, fp32, seed 0; max_seq_len at least seq)."""
    from hydra.utils import instantiate

    cfg = model_option(name)
    torch.manual_seed(0)
    return instantiate(cfg, vocab_size=VOCAB, max_seq_len=max(seq, cfg.max_seq_len))


def document_ids(T: int, docs: str) -> torch.Tensor | None:
    """None, or one boundary at 3/8 of the row: the second document runs across the split at T/2."""
    if docs == "none":
        return None
    ids = torch.zeros(1, T, dtype=torch.long)
    ids[:, 3 * T // 8 :] = 1
    return ids


def _fwd_bwd(layer, x, ids, cot) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(x, ids)
    y.backward(cot)
    return y.detach(), x.grad


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return float((got - want).abs().max() / want.abs().max())


def layer_runs(args, rank: int, world: int) -> dict:
    """KDA and MLA, each case's three configurations once a round, rotating their order round by round."""
    from k3train.models.common.context_parallel import ContextParallel, set_context_parallel

    model = build_model("k3_small", args.seq)
    layers = {
        "KDA": next(b.mixer for b in model.layers if b.mixer_type == "kda"),
        "MLA": next(b.mixer for b in model.layers if b.mixer_type != "kda"),
    }
    d, T, half = layers["KDA"].d_model, args.seq, args.seq // world
    del model
    cp, mine = ContextParallel(dist.group.WORLD), slice(rank * half, (rank + 1) * half)
    gen = torch.Generator().manual_seed(1)
    x, cot = torch.randn(1, T, d, generator=gen), torch.randn(1, T, d, generator=gen)
    configs = [c for c in CONFIGS if args.two_threads or c != "cp1_2threads"]
    steps: dict = {}
    checks: dict = {}
    for i in range(args.warmup + args.steps):
        for name, layer in layers.items():
            for docs in args.docs:
                ids = document_ids(T, docs)
                whole = None
                for config in configs[i % len(configs) :] + configs[: i % len(configs)]:
                    dist.barrier()
                    if config == "cp2":
                        set_context_parallel(layer, cp)
                        inputs = (x[:, mine], None if ids is None else ids[:, mine], cot[:, mine])
                    else:
                        set_context_parallel(layer, None)
                        inputs = (x, ids, cot)
                    threads = 2 if config == "cp1_2threads" else 1
                    torch.set_num_threads(threads)
                    record: dict = {}
                    if config == "cp2" or rank == 0:
                        REC.start()
                        cpu, wall = time.process_time(), time.perf_counter()
                        y, gx = _fwd_bwd(layer, *inputs)
                        record = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
                        record["events"], REC.active = REC.events, False
                        if config != "cp2":
                            whole = (y, gx)
                    else:  # rank 1 while rank 0 holds the whole row: waiting, its CPU time says how idle
                        cpu = time.process_time()
                        dist.barrier()
                        record = {"idle_cpu_s": time.process_time() - cpu}
                    torch.set_num_threads(1)
                    if config != "cp2" and rank == 0:
                        dist.barrier()
                    if i >= args.warmup:
                        steps.setdefault(f"{name} | {docs} | {config}", []).append(record)
                    if config == "cp2" and i == 0:  # cp=2 against cp=1 on the whole row, the first round
                        parts = [[torch.empty_like(t) for _ in range(world)] for t in (y, gx)]
                        dist.all_gather(parts[0], y)
                        dist.all_gather(parts[1], gx)
                        if whole is not None:
                            checks[f"{name} | {docs}"] = {
                                "output": _close(torch.cat(parts[0], dim=1), whole[0]),
                                "input_grad": _close(torch.cat(parts[1], dim=1), whole[1]),
                            }
    return {"steps": steps, "checks": checks}


def _layer_rank_main(rank: int, world: int, args, init_file: str, out_dir: str) -> None:
    from k3train.runtime.cpu import prepare_cpu_training

    prepare_cpu_training()  # as training on a CPU does (malloc keeps freed memory, denormals flush)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(minutes=10)
    )
    try:
        install_counters()
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(layer_runs(args, rank, world)))
    finally:
        dist.destroy_process_group()


def _memory_rank_main(rank: int, world: int, args, init_file: str, out_dir: str) -> None:
    """One rank of cp=world (world 1: one process, the whole row): a warm-up step, then forward and backward."""
    from k3train.models.common.context_parallel import ContextParallel, set_context_parallel
    from k3train.models.k3.moe import MoE
    from k3train.runtime.cpu import prepare_cpu_training

    prepare_cpu_training()  # under MALLOC_MMAP_THRESHOLD_ malloc is left as the environment sets it
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(minutes=10)
        )
    try:
        model = build_model(args.memory_model, args.memory_seq).train()
        if world > 1:
            for moe in (m for m in model.modules() if isinstance(m, MoE)):
                moe.process_group = dist.group.WORLD  # Quantile Balancing over both halves' tokens
            set_context_parallel(model, ContextParallel(dist.group.WORLD))
        gen = torch.Generator().manual_seed(2)
        x, y = (torch.randint(0, VOCAB, (1, args.memory_seq), generator=gen) for _ in range(2))
        half = args.memory_seq // world
        x, y = x[:, rank * half : (rank + 1) * half], y[:, rank * half : (rank + 1) * half]
        _, loss = model(x[:, :64], targets=y[:, :64])  # warm-up: thread pools, gloo's buffers, lazy tables
        loss.backward()
        model.zero_grad(set_to_none=True)
        del loss
        gc.collect()
        marks, passes = watch_layers(model), watch_chunk_kda()
        if world > 1:
            dist.barrier()
        before = rss_mib()
        marks.append(("start", before))
        reset = reset_peak()
        t0 = time.perf_counter()
        _, loss = model(x, targets=y)
        forward_s, after_forward, forward_peak = time.perf_counter() - t0, rss_mib(), peak_mib()
        marks.append(("end", after_forward))
        reset_peak()
        t0 = time.perf_counter()
        loss.backward()
        backward_s, backward_peak = time.perf_counter() - t0, peak_mib()
        grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        result = {
            "rank": rank,
            "positions": x.shape[1],
            "rss_before_mib": round(before, 1),
            "forward_added_mib": round(after_forward - before, 1),
            "forward_added_by_part_mib": by_part(marks),
            "kda_chunk_passes_added_mib": {k: round(v, 1) for k, v in passes.items()},  # within "kda"
            "forward_peak_added_mib": round(forward_peak - before, 1) if reset else None,
            "backward_peak_added_mib": round(backward_peak - before, 1) if reset else None,
            "rss_after_backward_added_mib": round(rss_mib() - before, 1),
            "gradients_mib": round(grads / MiB, 1),
            "forward_s": round(forward_s, 2),
            "backward_s": round(backward_s, 2),
            "peak_reset": reset,
        }
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        if world > 1:
            dist.destroy_process_group()


def watch_layers(model) -> list:
    """(label, RSS MiB) at each block's and each mixer's start and end of every forward after this call."""
    marks: list = []
    for i, block in enumerate(model.layers):
        for module, name in ((block, "block"), (block.mixer, block.mixer_type)):
            module.register_forward_pre_hook(lambda m, a, k=(i, name): marks.append(((*k, "in"), rss_mib())))
            module.register_forward_hook(lambda m, a, o, k=(i, name): marks.append(((*k, "out"), rss_mib())))
    return marks


def watch_chunk_kda() -> dict:
    """{pass: MiB} that chunk_kda's calls of every later forward leave resident (what they save and return)."""
    from k3train.models.kda import context_parallel as kda_cp
    from k3train.models.kda import layer as kda_layer

    added: dict = {}

    def watched(real, where: str):
        def chunk_kda(*args, **kwargs):
            label = where if where == "one pass (cp=1)" else ("zero-state pass" if kwargs.get("initial_state") is None
                                                              else "identity pass")  # fmt: skip
            before = rss_mib()
            out = real(*args, **kwargs)
            added[label] = added.get(label, 0.0) + rss_mib() - before
            return out

        return chunk_kda

    kda_cp.chunk_kda = watched(kda_cp.chunk_kda, "cp")
    kda_layer.chunk_kda = watched(kda_layer.chunk_kda, "one pass (cp=1)")
    return added


def by_part(marks: list) -> dict:
    """What the forward left resident, by part: the KDA and MLA mixers, the rest of the blocks (norms, FFN/MoE,
    residuals), the embedding before the first block, the head and loss after the last."""
    at = dict(marks)
    blocks = sorted({k[0] for k in at if isinstance(k, tuple)})
    out = {"embedding": at[(blocks[0], "block", "in")] - at["start"], "kda": 0.0, "mla": 0.0, "rest of the blocks": 0.0}
    for i in blocks:
        kind = next(k[1] for k in at if isinstance(k, tuple) and k[0] == i and k[1] != "block")
        mixer = at[(i, kind, "out")] - at[(i, kind, "in")]
        out[kind] += mixer
        out["rest of the blocks"] += at[(i, "block", "out")] - at[(i, "block", "in")] - mixer
    out["head and loss"] = at["end"] - at[(blocks[-1], "block", "out")]
    return {k: round(v, 1) for k, v in out.items()}


def spawn(main, world: int, args, env: dict | None = None) -> list[dict]:
    """main(rank, world, args, init_file, out_dir) on `world` spawned processes (env added to theirs only)."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(main, args=(world, args, str(Path(tmp) / "init"), tmp), nprocs=world)
            return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


# ---- summing up ---------------------------------------------------------------------------------------------------


def summarise(ranks: list[dict], args) -> dict:
    """Per layer and documents: each configuration's median wall and CPU ms per rank; for cp=2 its exchanges by
    kind (bytes of one step, median ms) and compute (wall - exchanges - waits); chunk_kda's passes."""
    out: dict = {}
    for key in ranks[0]["steps"]:
        name, docs, config = key.split(" | ")
        row = out.setdefault(name, {}).setdefault(docs, {})
        per_rank = [r["steps"][key] for r in ranks]
        if config != "cp2":
            steps = per_rank[0]
            row[config] = {
                "wall_ms": round(1e3 * statistics.median(s["wall_s"] for s in steps), 1),
                "cpu_ms": round(1e3 * statistics.median(s["cpu_s"] for s in steps), 1),
                "passes": _kinds(steps, "chunk_kda"),
                "idle_rank_cpu_ms": round(1e3 * statistics.median(s["idle_cpu_s"] for s in per_rank[1]), 1),
            }
            continue
        row[config] = {
            "wall_ms_per_rank": [round(1e3 * statistics.median(s["wall_s"] for s in steps), 1) for steps in per_rank],
            "cpu_ms_per_rank": [round(1e3 * statistics.median(s["cpu_s"] for s in steps), 1) for steps in per_rank],
            "exchanges_per_rank": [_kinds(steps, "", exclude=("chunk_kda", "wait")) for steps in per_rank],
            "passes_per_rank": [_kinds(steps, "chunk_kda") for steps in per_rank],
            "wait_ms_per_rank": [_total_ms(steps, "wait") for steps in per_rank],
        }
        exchange = [_total_ms(steps, "", exclude=("chunk_kda", "wait")) for steps in per_rank]
        row[config]["exchange_ms_per_rank"] = exchange
        row[config]["compute_ms_per_rank"] = [
            round(w - e - c, 1)
            for w, e, c in zip(row[config]["wall_ms_per_rank"], exchange, row[config]["wait_ms_per_rank"], strict=True)
        ]
    for docs_rows in out.values():
        for row in docs_rows.values():
            one, cpu = row["cp1_1thread"]["wall_ms"], row["cp1_1thread"]["cpu_ms"]
            row["cp2_over_cp1_1thread"] = round(max(row["cp2"]["wall_ms_per_rank"]) / one, 3)
            row["cp2_over_cp1_1thread_cpu"] = round(max(row["cp2"]["cpu_ms_per_rank"]) / cpu, 3)  # the larger rank's
            row["cp2_both_ranks_over_cp1_1thread_cpu"] = round(sum(row["cp2"]["cpu_ms_per_rank"]) / cpu, 3)
            if "cp1_2threads" in row:
                two = row["cp1_2threads"]["wall_ms"]
                row["cp2_over_cp1_2threads"] = round(max(row["cp2"]["wall_ms_per_rank"]) / two, 3)
    return out


def _steps_by_kind(steps: list[dict], prefix: str, exclude: tuple[str, ...] = ()) -> dict:
    """{kind: {phase: [per step: [seconds, payload, sent, calls, CPU seconds]]}}"""
    out: dict = {}
    for i, step in enumerate(steps):
        for ev in step["events"]:
            if not ev["kind"].startswith(prefix) or ev["kind"].startswith(exclude):
                continue
            per_step = out.setdefault(ev["kind"], {}).setdefault(ev["phase"], [[0.0, 0, 0.0, 0, 0.0] for _ in steps])
            acc = per_step[i]
            acc[0] += ev["s"]
            acc[1] += ev.get("payload", 0)
            acc[2] += ev.get("sent", 0)
            acc[3] += 1
            acc[4] += ev.get("cpu", 0.0)
    return out


def _kinds(steps: list[dict], prefix: str, exclude: tuple[str, ...] = ()) -> dict:
    """Per kind and phase: median ms, bytes handed to torch.distributed, bytes sent (= received), calls a step."""

    def row(per_step: list) -> dict:
        out = {"ms": round(1e3 * statistics.median(s[0] for s in per_step), 2)}
        if prefix == "chunk_kda":
            out["cpu_ms"] = round(1e3 * statistics.median(s[4] for s in per_step), 2)
        else:
            out.update(payload=per_step[0][1], sent=per_step[0][2], calls=per_step[0][3])
        return out

    return {
        kind: {phase: row(per_step) for phase, per_step in phases.items()}
        for kind, phases in _steps_by_kind(steps, prefix, exclude).items()
    }


def _total_ms(steps: list[dict], prefix: str, exclude: tuple[str, ...] = ()) -> float:
    totals = [sum(ev["s"] for ev in s["events"] if ev["kind"].startswith(prefix) and not ev["kind"].startswith(exclude))
              for s in steps]  # fmt: skip
    return round(1e3 * statistics.median(totals), 1)


def memory_table(one: list[dict], two: list[dict]) -> dict:
    def ratio(key: str) -> float | None:
        if one[0][key] is None or not one[0][key]:
            return None
        return round(max(r[key] for r in two) / one[0][key], 3)

    return {
        "cp1": one[0],
        "cp2": two,
        "cp2_over_cp1": {k: ratio(k) for k in ("forward_added_mib", "backward_peak_added_mib")},
    }


# ---- the table ----------------------------------------------------------------------------------------------------


def _kib(b: float) -> str:
    return f"{b / 1024:10.3f}"


def print_tables(result: dict) -> None:
    layers, T = result["layers"], result["seq_len"]
    print(
        f"\nper layer, forward + backward of one row of {T} (batch 1), {result['layer_model']}'s shapes, fp32; "
        f"median of {result['steps']} steps; ms of wall time (CPU ms); cp2/cp1: the slower rank's wall (CPU) over "
        "1 thread's, and both ranks' CPU over it"
    )
    head = f"{'':<24}{'cp=1 1 thread':>16}{'cp=1 2 threads':>16}{'cp=2 rank 0':>16}{'cp=2 rank 1':>16}"
    print(head + f"{'cp2/cp1':>14}{'both ranks':>11}")
    for name, rows in layers.items():
        for docs, row in rows.items():
            cells = [f"{row[c]['wall_ms']:.0f} ({row[c]['cpu_ms']:.0f})" if c in row else "-" for c in CONFIGS[:2]]
            cp2 = row["cp2"]
            cells += [f"{w:.0f} ({c:.0f})" for w, c in zip(cp2["wall_ms_per_rank"], cp2["cpu_ms_per_rank"])]
            ratio = f"{row['cp2_over_cp1_1thread']:.2f} ({row['cp2_over_cp1_1thread_cpu']:.2f})"
            print(f"{name + ', docs ' + docs:<24}" + "".join(f"{c:>16}" for c in cells) + f"{ratio:>14}"
                  + f"{row['cp2_both_ranks_over_cp1_1thread_cpu']:>11.2f}")  # fmt: skip
    print("\ncp=2 per rank: compute / exchanges / barrier waits, ms (wall = their sum)")
    for name, rows in layers.items():
        for docs, row in rows.items():
            cp2 = row["cp2"]
            parts = "   ".join(
                f"rank {r}: {c:.0f} / {e:.1f} / {w:.1f}"
                for r, (c, e, w) in enumerate(
                    zip(cp2["compute_ms_per_rank"], cp2["exchange_ms_per_rank"], cp2["wait_ms_per_rank"])
                )
            )
            print(f"  {name + ', docs ' + docs:<24}{parts}")
    print("\nKDA's chunked passes (chunk_kda forward + its kernel's backward, ms of wall time (CPU ms))")

    def pass_ms(kind: str, phases: dict) -> str:
        wall, cpu = (sum(p[key] for p in phases.values()) for key in ("ms", "cpu_ms"))
        return f"{kind.split(': ')[1]} {wall:.0f} ({cpu:.0f})"

    for docs, row in layers.get("KDA", {}).items():
        cells = [pass_ms(k, v) for k, v in row["cp1_1thread"]["passes"].items()]
        for r, passes in enumerate(row["cp2"]["passes_per_rank"]):
            cells += [f"rank {r}: " + ", ".join(pass_ms(k, v) for k, v in passes.items())]
        print(f"  docs {docs:<14}" + "; ".join(cells))
    print("\nexchanged per layer per step by each rank (KiB = 1024 bytes; handed to torch.distributed, and sent = "
          "received; ms: the exchange after a barrier)")  # fmt: skip
    print(f"  {'':<52}{'fwd all-gather':>15}{'bwd reduce-sc.':>15}{'sent':>11}{'calls':>6}{'ms r0':>8}{'ms r1':>8}")
    for name, rows in layers.items():
        for docs, row in rows.items():
            ex = row["cp2"]["exchanges_per_rank"]
            total_sent = 0.0
            for kind, phases in ex[0].items():
                fwd, bwd = phases.get("forward", {}), phases.get("backward", {})
                sent = fwd.get("sent", 0) + bwd.get("sent", 0)
                total_sent += sent
                ms = [sum(p["ms"] for p in r[kind].values()) for r in ex]
                print(f"  {name + ', docs ' + docs + ': ' + kind:<52}{_kib(fwd.get('payload', 0)):>15}"
                      f"{_kib(bwd.get('payload', 0)):>15}{_kib(sent):>11}"
                      f"{fwd.get('calls', 0) + bwd.get('calls', 0):>6}{ms[0]:>8.2f}{ms[1]:>8.2f}")  # fmt: skip
            print(f"  {name + ', docs ' + docs + ': total sent':<52}{'':>30}{_kib(total_sent):>11}")
    checks = result["checks"]
    print("\ncp=2 against cp=1 on the whole row (max |diff| / max |cp=1|):")
    for k, v in checks.items():
        print(f"  {k}: output {v['output']:.1e}, input gradient {v['input_grad']:.1e}")
    mem = result["memory"]
    print(
        f"\nmemory: whole {result['memory_model']}, one row of {result['memory_seq']}, 1 thread a rank, "
        f"MALLOC_MMAP_THRESHOLD_=131072 (MiB)"
    )
    print(f"  {'':<16}{'positions':>10}{'before':>9}{'fwd adds':>10}{'bwd peak adds':>15}{'grads':>8}{'fwd s':>7}"
          f"{'bwd s':>7}")  # fmt: skip
    for label, r in [("cp=1", mem["cp1"])] + [(f"cp=2 rank {r['rank']}", r) for r in mem["cp2"]]:
        peak = "-" if r["backward_peak_added_mib"] is None else f"{r['backward_peak_added_mib']:.1f}"
        print(f"  {label:<16}{r['positions']:>10}{r['rss_before_mib']:>9.1f}{r['forward_added_mib']:>10.1f}{peak:>15}"
              f"{r['gradients_mib']:>8.1f}{r['forward_s']:>7.1f}{r['backward_s']:>7.1f}")  # fmt: skip
    print(f"  cp=2 (larger rank) / cp=1: {mem['cp2_over_cp1']}")
    parts = mem["cp1"]["forward_added_by_part_mib"]
    print(f"  what the forward left resident, by part (MiB): {'':<6}" + "".join(f"{k:>20}" for k in parts))
    for label, r in [("cp=1", mem["cp1"])] + [(f"cp=2 rank {r['rank']}", r) for r in mem["cp2"]]:
        print(f"  {label:<52}" + "".join(f"{v:>20.1f}" for v in r["forward_added_by_part_mib"].values()))
    print("  of the KDA mixers', chunk_kda's passes (MiB): " + "; ".join(
        f"{label} {', '.join(f'{k} {v:.1f}' for k, v in r['kda_chunk_passes_added_mib'].items())}"
        for label, r in [("cp=1", mem["cp1"])] + [(f"cp=2 rank {r['rank']}", r) for r in mem["cp2"]]
    ))  # fmt: skip


# ---- main ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192, help="one row's positions for the layers (cp=2: half a rank)")
    ap.add_argument("--steps", type=int, default=4, help="timed rounds (each case's configurations once a round)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--no-documents", dest="documents", action="store_false", help="skip the one-boundary case")
    ap.add_argument("--no-two-threads", dest="two_threads", action="store_false", help="skip cp=1 on 2 threads")
    ap.add_argument("--memory-model", default="k3_small", help="conf/model/<name>.yaml for the memory probe")
    ap.add_argument("--memory-seq", type=int, default=4096, help="one row's positions for the memory probe")
    ap.add_argument("--quick", action="store_true", help="smoke test: seq 256, 1 step, k3_tiny's memory at 256")
    ap.add_argument("--out", type=Path, help=f"the JSON (default {RESULTS.relative_to(ROOT)}; --quick: none)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seq, args.steps, args.warmup, args.memory_model, args.memory_seq = 256, 1, 0, "k3_tiny", 256
    args.docs = DOCS if args.documents else DOCS[:1]
    from k3train.runtime.cpu import cpu_description

    t_start = time.perf_counter()
    machine = cpu_description()
    load = {"before": [round(x, 2) for x in os.getloadavg()]}
    ranks = spawn(_layer_rank_main, RANKS, args)
    load["after_layers"] = [round(x, 2) for x in os.getloadavg()]
    one = spawn(_memory_rank_main, 1, args, env=LIVE)
    two = spawn(_memory_rank_main, RANKS, args, env=LIVE)
    load["after_memory"] = [round(x, 2) for x in os.getloadavg()]
    result = {
        "what": "context parallelism: k3_small's KDA and MLA layers forward + backward on one row, cp=1 (one "
        "process, 1 and 2 threads) against cp=2 (2 gloo ranks, half the row each, 1 thread each): time, bytes each "
        "rank exchanges by kind, chunk_kda's passes; and a whole model's resident memory a forward adds per rank",
        "command": " ".join(["python benchmarks/bench_cp.py", *(sys.argv[1:] if argv is None else argv)]),
        "layer_model": "k3_small",
        "seq_len": args.seq,
        "batch": 1,
        "document_layouts": {"none": "one sequence", "one_boundary": "a document boundary at 3/8 of the row"},
        "precision": "fp32",
        "ranks": RANKS,
        "threads": {"cp1_1thread": 1, "cp1_2threads": 2, "cp2_per_rank": 1, "memory_per_rank": 1},
        "steps": args.steps,
        "warmup": args.warmup,
        "machine": machine,
        "torch": torch.__version__,
        "backend": "gloo",
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        "layers": summarise(ranks, args),
        "checks": ranks[0]["checks"],
        "memory_model": args.memory_model,
        "memory_seq": args.memory_seq,
        "memory_allocator": LIVE,
        "memory": memory_table(one, two),
        "load_average": load,
        "loadavg_file_after": Path("/proc/loadavg").read_text().strip(),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    print_tables(result)
    print(f"\nload average {load}; {machine['cpu_model']}, {machine['torch_cpu_capability']}; {result['seconds']} s")
    sys.path.insert(0, str(HERE))
    from results_file import write_unless_quick

    write_unless_quick(args.out, args.quick, RESULTS, result)
    return result


if __name__ == "__main__":
    main()
