"""Expert parallelism's token all-to-alls against FSDP's expert-weight traffic: k3_small's MoE on 2 gloo ranks.

    python benchmarks/bench_ep.py                 # one MoE layer (EP=2 and FSDP, alternating steps), then a whole
                                                  # k3_small forward + backward under each; ~3 minutes on 2 cores
    python benchmarks/bench_ep.py --no-model      # the MoE layer only
    python benchmarks/bench_ep.py --quick         # a smoke test: 32 tokens a rank, one step, no whole model; writes
                                                  # nothing unless --out is given

Both ranks build k3_small (conf/model/k3_small.yaml, vocab 257, fp32, seed 0) and take its first MoE layer:
- EP=2: `MoE.shard_experts`, as KimiK3's parallelize calls it (k3train/models/k3/parallelize.py): each rank
  keeps 32 of the 64 routed experts and sends its token slots to them and back (k3train/models/k3/moe/dispatch.py:
  a counts all-to-all, then the slots at the latent width, their gate weights, and the combine; the backward sends
  the gradients back the same way).
- FSDP: the layer's routed experts as one fully_shard unit inside the MoE (the root), reshard_after_forward=True as
  conf/parallel/fsdp.yaml: they are all-gathered before the forward and again before the backward, and their
  gradients reduce-scattered. (k3train's FSDP makes the whole transformer block the unit, whose one all-gather
  carries the experts with the attention; here the experts' own collective is measured. The whole-model step runs
  k3train's FSDP as it is: DDP(ep=2) with its all-reduce against FSDP over whole blocks; forward, backward and
  finish_gradients, no optimizer step.)
Both copies are in training mode with Quantile Balancing over both ranks' tokens (the model's real router), see the
same random hidden states (seeded per rank and step) and route identically; each step is forward + backward of a
random cotangent. The two configurations alternate step by step, so the machine's load falls on both alike.

Counting: this process wraps the collectives the code calls, forward and backward: all_to_all_single_autograd and
dist.all_to_all_single in moe/dispatch.py (the backward's all-to-all timed by hooks on its autograd node),
dist.all_gather_single / reduce_scatter_single (what FSDP2 calls), Quantile Balancing's all-gather, and the DDP
buckets (a comm hook: bytes only, DDP launches them beside the backward). Bytes are those of the tensor handed to
torch.distributed, k3train.plan's convention (an all-to-all's or reduce-scatter's input, an all-gather's output),
checked against split sizes x row width x dtype size for every all-to-all; `leaving` is what goes to the other rank
(an all-to-all's, from its splits; an all-gather's or reduce-scatter's, a ring's (G - 1) / G share, not measured).
Each timed collective waits first, untimed, for the other rank (a barrier), so its seconds are the exchange and not
a wait for a slower peer; the spread of expert compute between ranks (the routing's imbalance) is reported beside.
Expert compute is GroupedSwiGLU's forward and backward, minus any collective run inside it.

The plan's bytes (k3train.plan.comm.plan_comm for the same config on meshes 2x1x2 and 1x2x1, per layer: its
totals over the 11 MoE layers / 11) stand beside the counted ones: issue 25 asks that they be equal; every figure
that differs (bytes, bytes leaving, calls) is listed at the end. Beside them the plan's seconds for `--gpu cpu`
(its link: a timed memory copy), which gloo over loopback does not reach. The step times include the barriers.
Writes benchmarks/results/ep.json (or --out) with the CPU, torch's SIMD level and the load average.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "ep.json"
RANKS = 2
MODEL = "k3_small"
VOCAB = 257  # the built-in byte-level corpus
MiB = 2**20

AG_NAME = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
RS_NAME = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
A2A_LABELS = ("dispatch", "gate weights", "combine")  # the autograd all-to-alls of one AllToAllDispatch round


# ---- counting: every collective of a timed step, with its bytes and seconds -------------------------------------


class Recorder:
    """Collectives (and expert compute) while `active`: kind, forward or backward, seconds, bytes."""

    def __init__(self) -> None:
        self.active = False
        self.phase = "forward"
        self.events: list[dict] = []
        self.comm_s = 0.0  # running total: taken out of the expert compute a collective runs inside
        self.expert_unit_numel: int | None = None  # the FSDP unit holding one layer's routed experts
        self.a2a_seq = 0

    def start(self) -> None:
        self.events, self.comm_s, self.active, self.phase = [], 0.0, True, "forward"

    def wait_for_peers(self, group) -> None:
        """Untimed: the other rank reaches the collective too, so its seconds are the exchange alone."""
        if self.active:
            dist.barrier(group=group)

    def timed(self, group, call):
        """(seconds, Work or None) of one collective, `call()`, waited on, after the untimed wait for peers."""
        self.wait_for_peers(group)
        t0 = time.perf_counter()
        work = call()
        if work is not None:  # async_op: this measures the exchange itself, not what overlaps it
            work.wait()
        return time.perf_counter() - t0, work

    def add(self, **event) -> None:
        if self.active:
            self.events.append(event)
            if event["kind"] != "expert compute":
                self.comm_s += event["s"]


REC = Recorder()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _node_of(out: torch.Tensor, name: str):
    """The autograd node named `name` at or just under out.grad_fn (the functional collective wraps its result)."""
    node, seen = out.grad_fn, 0
    while node is not None and name not in node.name() and seen < 3:
        node, seen = node.next_functions[0][0], seen + 1
    if node is None or name not in node.name():
        raise RuntimeError(f"no {name} autograd node under {out.grad_fn}: torch changed the functional collective")
    return node


def _time_backward(node, on_done) -> None:
    """on_done(seconds, grad_inputs, grad_outputs, comm_seconds_inside) after `node`'s backward."""
    start: dict = {}

    def pre(grad_outputs):
        start["comm"], start["t"] = REC.comm_s, time.perf_counter()

    def post(grad_inputs, grad_outputs):
        on_done(time.perf_counter() - start["t"], grad_inputs, grad_outputs, REC.comm_s - start["comm"])

    node.register_prehook(pre)
    node.register_hook(post)


def timed_all_to_all_autograd(real):
    def all_to_all(x, output_split_sizes, input_split_sizes, group, tag=""):
        if not REC.active:
            return real(x, output_split_sizes, input_split_sizes, group, tag)
        label = A2A_LABELS[min(REC.a2a_seq, len(A2A_LABELS) - 1)]
        REC.a2a_seq += 1
        me = dist.get_rank(group)
        row = x.element_size() * math.prod(x.shape[1:])  # bytes of one slot: latent width x dtype size, or 1 weight
        REC.wait_for_peers(group)
        t0 = time.perf_counter()
        out = real(x, output_split_sizes, input_split_sizes, group, tag)
        if hasattr(out, "trigger_wait"):  # an AsyncCollectiveTensor: the exchange finishes at the first use
            out.trigger_wait()
        seconds = time.perf_counter() - t0

        def record(phase, seconds, sent, received, send_splits, recv_splits):
            REC.add(
                kind=f"EP all-to-all: {label}",
                phase=phase,
                s=seconds,
                payload=_nbytes(sent),
                from_splits=sum(send_splits) * row,
                received=_nbytes(received),
                received_from_splits=sum(recv_splits) * row,
                leaving=(sum(send_splits) - send_splits[me]) * row,
                send_splits=list(send_splits),
            )

        record("forward", seconds, x, out, input_split_sizes, output_split_sizes)
        if out.requires_grad:
            node = _node_of(out, "all_to_all_single")

            def pre(grad_outputs):
                REC.wait_for_peers(group)

            node.register_prehook(pre)  # registered first: runs before the timer starts
            _time_backward(
                node,
                lambda s, gi, go, _: record("backward", s, go[0], gi[0], output_split_sizes, input_split_sizes),
            )
        return out

    return all_to_all


def timed_all_to_all_single(real):
    """dist.all_to_all_single: in moe/dispatch.py only the slot counts, the first exchange of a dispatch."""

    def all_to_all_single(output, input, *args, **kwargs):
        if not REC.active:
            return real(output, input, *args, **kwargs)
        REC.a2a_seq = 0  # a new dispatch
        group = kwargs.get("group")
        seconds, work = REC.timed(group, lambda: real(output, input, *args, **kwargs))
        ranks = dist.get_world_size(group)
        REC.add(
            kind="EP all-to-all: slot counts",
            phase="forward",
            s=seconds,
            payload=_nbytes(input),
            from_splits=_nbytes(input),
            received=_nbytes(output),
            received_from_splits=_nbytes(output),
            leaving=_nbytes(input) * (ranks - 1) // ranks,  # one count per expert, E / ranks to each rank
        )
        return work

    return all_to_all_single


def timed_fsdp(real, name: str, payload_arg: str):
    """FSDP2's dist.all_gather_single / reduce_scatter_single: bytes of `payload_arg`, labelled by unit."""
    import inspect

    signature = inspect.signature(real)

    def collective(*args, **kwargs):
        if not REC.active:
            return real(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        group = bound.arguments.get("group")
        tensor = bound.arguments[payload_arg]
        seconds, work = REC.timed(group, lambda: real(*args, **kwargs))
        unit = "experts" if tensor.numel() == REC.expert_unit_numel else "other units"
        ranks = dist.get_world_size(group)
        REC.add(
            kind=f"FSDP {name}: {unit}",
            phase=REC.phase,
            s=seconds,
            payload=_nbytes(tensor),
            leaving=_nbytes(tensor) * (ranks - 1) // ranks,  # a ring's share (gloo's algorithm is its own)
        )
        return work

    return collective


QB = ("Quantile Balancing all-gather", "Quantile Balancing all-to-all")  # the plan's kinds


def timed_qb_gather(real):
    """Quantile Balancing's all-gathers (moe/balancing.py's _all_gather_single): the loads and the candidate biases."""

    def gather(out, local, group=None, async_op=False):
        if not REC.active:
            return real(out, local, group=group, async_op=async_op)
        seconds, work = REC.timed(group, lambda: real(out, local, group=group, async_op=async_op))
        ranks = dist.get_world_size(group)
        REC.add(
            kind="Quantile Balancing all-gather",
            phase="forward",
            s=seconds,
            payload=_nbytes(out),
            leaving=_nbytes(out) * (ranks - 1) // ranks,  # a ring's share
        )
        return work

    return gather


def timed_qb_all_to_all(real):
    """Quantile Balancing's all-to-all (moe/balancing.py's _all_to_all_single): each rank's candidates to their
    experts' rank."""

    def all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        def call():
            return real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        if not REC.active:
            return call()
        seconds, work = REC.timed(group, call)
        mine = input_split_sizes[dist.get_rank(group)] * input.element_size() if input_split_sizes else 0
        REC.add(kind="Quantile Balancing all-to-all", phase="forward", s=seconds, payload=_nbytes(input),
                leaving=_nbytes(input) - mine)  # fmt: skip
        return work

    return all_to_all


def timed_grouped_swiglu(real):
    class TimedGroupedSwiGLU:
        """GroupedSwiGLU.apply, its forward and its backward timed (minus collectives run inside)."""

        @staticmethod
        def apply(x, *args):
            if not REC.active:
                return real.apply(x, *args)
            comm, t0 = REC.comm_s, time.perf_counter()
            y = real.apply(x, *args)
            rows = x.shape[0]
            REC.add(kind="expert compute", phase="forward", s=time.perf_counter() - t0 - (REC.comm_s - comm), rows=rows)
            if y.requires_grad:
                _time_backward(
                    y.grad_fn,
                    lambda s, gi, go, c: REC.add(kind="expert compute", phase="backward", s=s - c, rows=rows),
                )
            return y

    return TimedGroupedSwiGLU


def install_counters() -> None:
    """Wrap the collectives k3train calls (in this process only)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: F401 - loaded before patching

    from k3train.models.k3.moe import balancing, experts
    from k3train.models.k3.moe import dispatch as expert_parallel

    expert_parallel.all_to_all_single_autograd = timed_all_to_all_autograd(expert_parallel.all_to_all_single_autograd)
    dist.all_to_all_single = timed_all_to_all_single(dist.all_to_all_single)
    setattr(dist, AG_NAME, timed_fsdp(getattr(dist, AG_NAME), "all-gather", "output_tensor"))
    setattr(dist, RS_NAME, timed_fsdp(getattr(dist, RS_NAME), "reduce-scatter", "input"))
    balancing._all_gather_single = timed_qb_gather(balancing._all_gather_single)
    balancing._all_to_all_single = timed_qb_all_to_all(balancing._all_to_all_single)
    experts.GroupedSwiGLU = timed_grouped_swiglu(experts.GroupedSwiGLU)  # RoutedExperts.forward calls it


def counting_ddp_hook(process_group, bucket):
    """DDP's all-reduce as it is (default_hooks.allreduce_hook), its bucket's bytes counted (not timed)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    REC.add(kind="DDP all-reduce", phase="backward", s=0.0, payload=_nbytes(bucket.buffer()))
    return default_hooks.allreduce_hook(process_group, bucket)


# ---- what each rank runs ----------------------------------------------------------------------------------------


def build_model(model_cfg: dict):
    from hydra.utils import instantiate

    torch.manual_seed(0)
    return instantiate(model_cfg)


def first_moe(model):
    from k3train.models.k3.moe import MoE

    return next(m for m in model.modules() if isinstance(m, MoE))


def _step(run, *, moe=None) -> dict:
    """One forward + backward (`run()`) with the recorder on, the ranks lined up first."""
    dist.barrier()
    REC.start()
    t0 = time.perf_counter()
    run()
    wall = time.perf_counter() - t0
    REC.active = False
    out = {"wall_s": wall, "events": REC.events}
    if moe is not None and moe.last_load is not None:
        out["global_load"] = [int(v) for v in moe.last_load.tolist()]
    return out


def layer_runs(args, rank: int, world: int, model_cfg: dict) -> dict:
    """One MoE layer, EP=2 and FSDP, alternating step by step on the same inputs."""
    from torch.distributed.fsdp import fully_shard

    from k3train.runtime.parallel_dims import ParallelDims

    model = build_model(model_cfg)
    layer = first_moe(model).train()
    del model
    d = layer.router.weight.shape[1]

    ep = copy.deepcopy(layer)  # as KimiK3's parallelize splits each MoE (k3train/models/k3/parallelize.py)
    ep_dims = ParallelDims.for_strategy("ddp", world, rank, "cpu", ep=world)
    ep.balance_over(ep_dims.dp_group)
    ep.shard_experts(ep_dims.ep_group)

    fsdp = copy.deepcopy(layer)
    dims = ParallelDims.for_strategy("fsdp", world, rank, "cpu")
    fsdp.balance_over(dims.dp_group)
    fully_shard(fsdp.experts, mesh=dims.shard_mesh, reshard_after_forward=True)
    fully_shard(fsdp, mesh=dims.shard_mesh, reshard_after_forward=True)
    e = layer.experts
    per_rank = math.ceil(e.w_gate.shape[0] / world)  # FSDP2 pads dim 0 to a multiple of the ranks
    REC.expert_unit_numel = world * per_rank * sum(w[0].numel() for w in (e.w_gate, e.w_up, e.w_down))
    del layer

    def make_run(moe, x, cot):
        def run():
            REC.phase = "forward"
            y = moe(x)
            REC.phase = "backward"
            y.backward(cot)
            moe.zero_grad(set_to_none=True)

        return run

    steps: dict[str, list] = {"ep": [], "fsdp": []}
    for i in range(args.warmup + args.steps):
        gen = torch.Generator().manual_seed(1000 * rank + i)
        x = torch.randn(args.batch, args.seq, d, generator=gen)
        cot = torch.randn(args.batch, args.seq, d, generator=gen)
        order = ("ep", "fsdp") if i % 2 == 0 else ("fsdp", "ep")
        for name in order:
            moe = ep if name == "ep" else fsdp
            result = _step(make_run(moe, x, cot), moe=moe)
            if i >= args.warmup:
                steps[name].append(result)
    return steps


def model_run(args, rank: int, world: int, model_cfg: dict, strategy: str) -> list[dict]:
    """The whole model, forward + backward (+ finish_gradients), under k3train's DDP with ep=2 or its FSDP."""
    from k3train.runtime.parallel_dims import ParallelDims
    from k3train.train.parallel import DDP, FSDP

    cpu = torch.device("cpu")
    ep = world if strategy == "ddp" else 1
    dims = ParallelDims.for_strategy(strategy, world, rank, "cpu", ep=ep)
    parallel = DDP(ep=ep) if strategy == "ddp" else FSDP(reshard_after_forward=True)
    model = parallel.shard(build_model(model_cfg).train(), cpu, dims)
    wrapped = parallel.wrap(model, cpu, dims)
    if strategy == "ddp":
        wrapped.register_comm_hook(dims.dp_group, counting_ddp_hook)
    REC.expert_unit_numel = None  # whole blocks are the units
    vocab = model_cfg["vocab_size"]

    def make_run(x: torch.Tensor, y: torch.Tensor):
        def run():
            REC.phase = "forward"
            _, loss = wrapped(x, targets=y)
            REC.phase = "backward"
            loss.backward()
            parallel.finish_gradients(model, dims)
            model.zero_grad(set_to_none=True)

        return run

    out = []
    for i in range(args.model_warmup + args.model_steps):
        gen = torch.Generator().manual_seed(5000 + 1000 * rank + i)
        x, y = (torch.randint(0, vocab, (args.batch, args.seq), generator=gen) for _ in range(2))
        result = _step(make_run(x, y))
        if i >= args.model_warmup:
            out.append(result)
    return out


def _rank_main(rank: int, world: int, args, model_cfg: dict, init_file: str, out_dir: str) -> None:
    import warnings

    # MoE.forward returns a view (out.view(B, T, d)) that nothing changes in place: FSDP2's warning does not apply
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    torch.set_num_threads(args.threads_per_rank)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(minutes=10)
    )
    try:
        install_counters()
        result: dict = {"layer": layer_runs(args, rank, world, model_cfg)}
        if args.model:
            for strategy in ("ddp", "fsdp"):
                result[f"model_{'ep' if strategy == 'ddp' else 'fsdp'}"] = model_run(
                    args, rank, world, model_cfg, strategy
                )
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


# ---- what the plan predicts ---------------------------------------------------------------------------------------


def overrides(args, strategy: str, ep: int) -> list[str]:
    return [
        f"model={MODEL}",
        f"model.vocab_size={VOCAB}",
        "precision=fp32",
        f"parallel={strategy}",
        f"parallel.ep={ep}",
        f"train.batch_size={args.batch}",
        f"train.seq_len={args.seq}",
    ]


def plan_predictions(args, with_seconds: bool) -> dict:
    """k3train.plan's collectives for the same run on 2x1x2 (DDP, ep 2) and 1x2x1 (FSDP): per step, and per MoE
    layer (the EP, routed-expert and Quantile Balancing figures / the MoE layers)."""
    from k3train.plan.__main__ import compose_config
    from k3train.plan.comm import plan_comm, seconds
    from k3train.plan.mesh import Mesh
    from k3train.plan.spec import build_spec

    hw = None
    if with_seconds:
        from k3train.plan.hardware import lookup

        hw = lookup("cpu")
    out = {}
    for name, strategy, mesh in (("ep", "ddp", Mesh(RANKS, 1, RANKS)), ("fsdp", "fsdp", Mesh(1, RANKS, 1))):
        spec = build_spec(compose_config(overrides(args, strategy, mesh.ep)), "cpu")
        moe_layers = sum(1 for i in range(spec.model.n_layers) if spec.model.is_moe_layer(i))
        out[name] = {
            "mesh": str(mesh),
            "moe_layers": moe_layers,
            "units": len(spec.units),
            "collectives": {
                c.kind: {
                    "payload": c.payload,
                    "wire": c.wire,
                    "calls": c.calls,
                    "seconds": None if hw is None else seconds(c, mesh, hw),
                }
                for c in plan_comm(spec, mesh)
            },
        }
    if hw is not None:
        out["hardware"] = {"name": hw.name, "link_one_way_bytes_per_s": hw.link_one_way}
    return out


# ---- summing up -------------------------------------------------------------------------------------------------


def by_kind(step: dict) -> dict:
    """One step's events summed by (kind, phase): seconds, payload, leaving, calls; the split check."""
    out: dict = {}
    for ev in step["events"]:
        key = f"{ev['kind']} | {ev['phase']}"
        entry = out.setdefault(key, {"s": 0.0, "payload": 0, "leaving": 0, "calls": 0, "split_mismatches": 0})
        entry["s"] += ev["s"]
        entry["payload"] += ev.get("payload", 0)
        entry["leaving"] += ev.get("leaving", 0)
        entry["calls"] += 1
        if "from_splits" in ev:
            bad = ev["payload"] != ev["from_splits"] or ev["received"] != ev["received_from_splits"]
            entry["split_mismatches"] += int(bad)
    return out


def summarise(rank_steps: list[list[dict]]) -> dict:
    """Per (kind, phase): per rank the median seconds and mean bytes over the timed steps; the rank mean."""
    per_rank = [[by_kind(s) for s in steps] for steps in rank_steps]
    keys = sorted({k for rank in per_rank for step in rank for k in step})
    out = {}
    for key in keys:
        rows = []
        for rank in per_rank:
            entries = [step.get(key, {"s": 0.0, "payload": 0, "leaving": 0, "calls": 0, "split_mismatches": 0})
                       for step in rank]  # fmt: skip
            rows.append(
                {
                    "ms": 1e3 * statistics.median(e["s"] for e in entries),
                    "payload": statistics.mean(e["payload"] for e in entries),
                    "leaving": statistics.mean(e["leaving"] for e in entries),
                    "calls": statistics.mean(e["calls"] for e in entries),
                    "split_mismatches": sum(e["split_mismatches"] for e in entries),
                }
            )
        out[key] = {
            "ms_per_rank": [round(r["ms"], 3) for r in rows],
            "ms_max": round(max(r["ms"] for r in rows), 3),
            "payload_per_rank": [r["payload"] for r in rows],
            "payload_mean": statistics.mean(r["payload"] for r in rows),
            "leaving_mean": statistics.mean(r["leaving"] for r in rows),
            "calls": rows[0]["calls"],
            "split_mismatches": sum(r["split_mismatches"] for r in rows),
        }
    out["step wall | total"] = {
        "ms_per_rank": [round(1e3 * statistics.median(s["wall_s"] for s in steps), 3) for steps in rank_steps]
    }
    return out


def total(summary: dict, prefix: str, phases=("forward", "backward")) -> dict:
    """Sum of the kinds starting with `prefix`: payload (rank mean), leaving, ms (per rank, then the largest)."""
    rows = [v for k, v in summary.items() if k.startswith(prefix) and k.split(" | ")[1] in phases]
    if not rows:
        return {"payload": 0, "leaving": 0, "ms": 0.0, "calls": 0, "ms_per_rank": []}
    ranks = len(rows[0]["ms_per_rank"])
    ms_per_rank = [sum(r["ms_per_rank"][i] for r in rows) for i in range(ranks)]
    return {
        "payload": sum(r["payload_mean"] for r in rows),
        "payload_per_rank": [sum(r["payload_per_rank"][i] for r in rows) for i in range(ranks)],
        "leaving": sum(r["leaving_mean"] for r in rows),
        "ms": max(ms_per_rank),
        "ms_per_rank": [round(m, 3) for m in ms_per_rank],
        "calls": sum(r["calls"] for r in rows),
    }


def imbalance(rank_steps_ep: list[list[dict]]) -> dict:
    """From EP's dispatch splits: slots each rank's experts received, over the mean, per step; the global loads."""
    ratios, leaving_share, expert_load = [], [], []
    for i in range(len(rank_steps_ep[0])):
        sends = [
            [ev["send_splits"] for ev in steps[i]["events"] if ev["kind"] == "EP all-to-all: dispatch"]
            for steps in rank_steps_ep
        ]
        if not sends[0]:
            continue
        received = [sum(s[0][r] for s in sends) for r in range(len(sends))]  # the first layer's dispatch
        mean = statistics.mean(received)
        ratios.append([round(v / mean, 4) for v in received])
        leaving_share.append([round(1 - s[0][r] / sum(s[0]), 4) for r, s in enumerate(sends)])
        load = rank_steps_ep[0][i].get("global_load")
        if load:
            expert_load.append(round(max(load) / statistics.mean(load), 3))
    return {
        "received_slots_over_mean_per_rank_by_step": ratios,
        "max_received_over_mean": max(max(r) for r in ratios) if ratios else None,
        "share_of_own_slots_leaving_by_step": leaving_share,
        "busiest_expert_load_over_mean_by_step": expert_load,
    }


def compare(counted: float, predicted: float | None) -> dict:
    if predicted is None:
        return {"counted": counted, "predicted": None, "equal": None}
    return {
        "counted": counted,
        "predicted": predicted,
        "equal": abs(counted - predicted) < 0.5,
        "predicted_over_counted": round(predicted / counted, 6) if counted else None,
    }


def layer_table(layer_ep: dict, layer_fsdp: dict, plan: dict) -> dict:
    """Per MoE layer per step: EP's all-to-alls against FSDP's expert all-gathers and reduce-scatter, each beside
    the plan's figure for one layer (its per-step total / the MoE layers; calls: FSDP's per unit)."""
    L = plan["ep"]["moe_layers"]

    def row(counted: dict, where: str, kind: str | tuple[str, ...], calls_per: int, wire: bool = False) -> dict:
        table = plan[where]["collectives"]
        kinds = (kind,) if isinstance(kind, str) else kind
        found = [table[k] for k in kinds if k in table]
        if not found:
            return {**counted, "plan": compare(counted["payload"], None)}
        out = {
            **counted,
            "plan": compare(counted["payload"], sum(c["payload"] for c in found) / L),
            "plan_calls": sum(c["calls"] for c in found) / calls_per,
            "plan_ms": None if found[0]["seconds"] is None else 1e3 * sum(c["seconds"] for c in found) / L,
        }
        if wire:  # the all-to-all's bytes leaving a rank are counted from its splits; FSDP's are a ring's share
            out["plan_wire"] = compare(counted["leaving"], sum(c["wire"] for c in found) / L)
        return out

    units = plan["fsdp"]["units"]
    ep = total(layer_ep, "EP all-to-all")
    ag = total(layer_fsdp, "FSDP all-gather: experts")
    rs = total(layer_fsdp, "FSDP reduce-scatter: experts")
    fsdp = {k: ag[k] + rs[k] for k in ("payload", "leaving", "calls")}
    fsdp["ms_per_rank"] = [round(a + b, 3) for a, b in zip(ag["ms_per_rank"], rs["ms_per_rank"], strict=True)]
    fsdp["ms"] = max(fsdp["ms_per_rank"], default=0.0)
    routed = ("FSDP all-gather (routed experts)", "FSDP reduce-scatter (routed experts)")
    rows = {
        "EP all-to-all (dispatch + gate weights + combine + counts, fwd + bwd)": row(
            ep, "ep", "EP all-to-all", L, wire=True
        ),
        "FSDP all-gather of the experts (fwd + bwd)": row(ag, "fsdp", routed[0], units),
        "FSDP reduce-scatter of the experts' gradients": row(rs, "fsdp", routed[1], units),
        "FSDP all-gather + reduce-scatter of the experts": row(fsdp, "fsdp", routed, units),
        "Quantile Balancing all-gathers + all-to-all (EP run)": row(total(layer_ep, "Quantile Balancing"), "ep", QB, L),
        "Quantile Balancing all-gathers + all-to-all (FSDP run)": row(
            total(layer_fsdp, "Quantile Balancing"), "fsdp", QB, L
        ),
    }
    kinds = sorted(k for k in layer_ep if k.startswith("EP all-to-all"))
    return {
        "rows": rows,
        "ep_by_collective": {k: layer_ep[k] for k in kinds},
        "expert_compute_ms": {
            "ep_per_rank": total(layer_ep, "expert compute")["ms_per_rank"],
            "fsdp_per_rank": total(layer_fsdp, "expert compute")["ms_per_rank"],
        },
        "step_wall_ms": {
            "ep_per_rank": layer_ep["step wall | total"]["ms_per_rank"],
            "fsdp_per_rank": layer_fsdp["step wall | total"]["ms_per_rank"],
        },
        "ratio_ep_over_fsdp": {
            "bytes": round(ep["payload"] / fsdp["payload"], 4) if fsdp["payload"] else None,
            "leaving_bytes": round(ep["leaving"] / fsdp["leaving"], 4) if fsdp["leaving"] else None,
            "ms": round(ep["ms"] / fsdp["ms"], 4) if fsdp["ms"] else None,
        },
        "split_mismatches": sum(v.get("split_mismatches", 0) for k, v in layer_ep.items() if k.startswith("EP")),
    }


def crossover_tokens(plan: dict, tokens: int, n_experts: int) -> float | None:
    """Tokens per rank at which the plan's EP bytes per layer (its slot counts, 8 bytes an expert, plus a part
    linear in the tokens) equal FSDP's (the experts' weights: fixed)."""
    pe, pf, L = plan["ep"]["collectives"], plan["fsdp"]["collectives"], plan["ep"]["moe_layers"]
    routed = ("FSDP all-gather (routed experts)", "FSDP reduce-scatter (routed experts)")
    if any(k not in pf for k in routed) or "EP all-to-all" not in pe:
        return None
    fsdp = sum(pf[k]["payload"] for k in routed) / L
    counts = 8 * n_experts
    per_token = (pe["EP all-to-all"]["payload"] / L - counts) / tokens
    return round((fsdp - counts) / per_token, 1)


def model_table(model_ep: dict, model_fsdp: dict, plan: dict) -> dict:
    """Whole model per step: what was counted against the plan's per-step totals, by kind."""
    pe, pf = plan["ep"]["collectives"], plan["fsdp"]["collectives"]

    def plan_sum(table, *kinds):
        vals = [table[k]["payload"] for k in kinds if k in table]
        return sum(vals) if vals else None

    qb = "Quantile Balancing all-gathers + all-to-all"
    ep = {
        "EP all-to-all": (total(model_ep, "EP all-to-all"), plan_sum(pe, "EP all-to-all")),
        "DDP all-reduce": (total(model_ep, "DDP all-reduce"), plan_sum(pe, "DDP all-reduce")),
        qb: (total(model_ep, "Quantile Balancing"), plan_sum(pe, *QB)),
    }
    fsdp = {
        "FSDP all-gather (all units)": (
            total(model_fsdp, "FSDP all-gather"),
            plan_sum(pf, "FSDP all-gather", "FSDP all-gather (routed experts)"),
        ),
        "FSDP reduce-scatter (all units)": (
            total(model_fsdp, "FSDP reduce-scatter"),
            plan_sum(pf, "FSDP reduce-scatter", "FSDP reduce-scatter (routed experts)"),
        ),
        qb: (total(model_fsdp, "Quantile Balancing"), plan_sum(pf, *QB)),
    }

    def rows(table):
        return {k: {**c, "plan": compare(c["payload"], p)} for k, (c, p) in table.items()}

    routed = plan_sum(pf, "FSDP all-gather (routed experts)")
    return {
        "ep": {
            "rows": rows(ep),
            "expert_compute_ms_per_rank": total(model_ep, "expert compute")["ms_per_rank"],
            "step_wall_ms_per_rank": model_ep["step wall | total"]["ms_per_rank"],
            "split_mismatches": sum(v.get("split_mismatches", 0) for k, v in model_ep.items() if k.startswith("EP")),
        },
        "fsdp": {
            "rows": rows(fsdp),
            "plan_all_gather_of_routed_experts": routed,
            "expert_compute_ms_per_rank": total(model_fsdp, "expert compute")["ms_per_rank"],
            "step_wall_ms_per_rank": model_fsdp["step wall | total"]["ms_per_rank"],
        },
    }


# ---- the table ----------------------------------------------------------------------------------------------------


def _mb(b: float | None) -> str:
    return "-" if b is None else f"{b / MiB:9.3f}"


def print_tables(result: dict) -> None:
    layer = result["layer"]
    print(
        f"\nper MoE layer per step, per rank ({MODEL}: {result['tokens_per_rank']} tokens a rank, top-"
        f"{result['shapes']['experts_per_token']} of {result['shapes']['n_routed_experts']} experts, latent width "
        f"{result['shapes']['routed_width']}, fp32; median of {result['steps']} steps; MiB = 2^20 bytes)"
    )
    print(
        f"{'':<66}{'counted MiB':>11}{'plan MiB':>10}  {'equal':<5}{'leaving MiB':>12}{'ms (slowest rank)':>18}"
        f"{'plan ms':>9}"
    )
    for name, row in layer["rows"].items():
        plan = row["plan"]
        equal = "-" if plan["equal"] is None else ("yes" if plan["equal"] else "NO")
        plan_ms = "-" if row.get("plan_ms") is None else f"{row['plan_ms']:.2f}"
        print(
            f"{name:<66}{_mb(row['payload']):>11}{_mb(plan['predicted']):>10}  {equal:<5}{_mb(row['leaving']):>12}"
            f"{row['ms']:>18.2f}{plan_ms:>9}"
        )
    ratio = layer["ratio_ep_over_fsdp"]
    print(
        f"EP / FSDP: bytes {ratio['bytes']}, bytes leaving a rank {ratio['leaving_bytes']}, time {ratio['ms']}; "
        f"the plan's crossover: EP moves fewer bytes below {result['crossover_tokens_per_rank']} tokens a rank"
    )
    print(
        f"expert compute (GroupedSwiGLU fwd + bwd) ms per rank: EP {layer['expert_compute_ms']['ep_per_rank']}, "
        f"FSDP {layer['expert_compute_ms']['fsdp_per_rank']}; whole layer step ms per rank: EP "
        f"{layer['step_wall_ms']['ep_per_rank']}, FSDP {layer['step_wall_ms']['fsdp_per_rank']}"
    )
    print("EP's collectives one by one (rank mean MiB, ms of the slowest rank, calls):")
    for kind, row in layer["ep_by_collective"].items():
        print(f"  {kind:<48}{_mb(row['payload_mean']):>11}{row['ms_max']:>10.2f}{row['calls']:>5.0f}")
    imb = result["routing"]
    print(
        "routing: slots each rank's experts received over the mean, by step "
        f"{imb['received_slots_over_mean_per_rank_by_step']}; busiest expert over the mean "
        f"{imb['busiest_expert_load_over_mean_by_step']}; all-to-alls whose bytes differ from their splits: "
        f"{layer['split_mismatches']}"
    )
    model = result.get("whole_model")
    if model:
        print(f"\nwhole {MODEL} forward + backward per step, per rank (median of {result['model_steps']} steps)")
        for name in ("ep", "fsdp"):
            part = model[name]
            print(f"  {name.upper()}: step ms per rank {part['step_wall_ms_per_rank']}, expert compute ms per rank "
                  f"{part['expert_compute_ms_per_rank']}")  # fmt: skip
            if part.get("plan_all_gather_of_routed_experts"):
                print(
                    f"    (the plan: {_mb(part['plan_all_gather_of_routed_experts']).strip()} MiB of the all-gather "
                    "is the routed experts)"
                )
            for kind, row in part["rows"].items():
                plan = row["plan"]
                equal = "-" if plan["equal"] is None else ("yes" if plan["equal"] else "NO")
                ms = "bytes only" if kind.startswith("DDP") else f"{row['ms']:.1f} ms"
                counted, predicted = _mb(row["payload"]), _mb(plan["predicted"])
                print(f"    {kind:<36}{counted:>11} MiB   plan {predicted} MiB  {equal:<4} {ms}")


# ---- main ---------------------------------------------------------------------------------------------------------


def measure(args) -> dict:
    from k3train.plan.__main__ import compose_config
    from k3train.runtime.cpu import cpu_description

    t_start = time.perf_counter()
    load_before = [round(x, 2) for x in os.getloadavg()]
    cfg = compose_config(overrides(args, "ddp", RANKS))
    from omegaconf import OmegaConf

    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    plan = plan_predictions(args, with_seconds=not args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(RANKS, args, model_cfg, str(Path(tmp) / "init"), tmp), nprocs=RANKS)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(RANKS)]
    layer_ep = summarise([r["layer"]["ep"] for r in ranks])
    layer_fsdp = summarise([r["layer"]["fsdp"] for r in ranks])
    m = cfg.model
    routed_width = m.expert_latent_dim or m.d_model
    result = {
        "what": "per MoE layer per step: EP=2's all-to-alls against FSDP's all-gathers and reduce-scatter of the "
        "same layer's routed experts, bytes handed to torch.distributed (counted) beside k3train.plan's, and "
        "seconds (each collective after an untimed barrier); 2 gloo ranks on this CPU",
        "command": "python benchmarks/bench_ep.py " + " ".join(sys.argv[1:]),
        "model": MODEL,
        "shapes": {
            "d_model": m.d_model,
            "n_routed_experts": m.n_routed_experts,
            "experts_per_token": m.experts_per_token,
            "expert_ffn_dim": m.expert_ffn_dim,
            "routed_width": routed_width,
            "expert_weights_bytes_per_layer": 3 * m.n_routed_experts * m.expert_ffn_dim * routed_width * 4,
        },
        "batch": args.batch,
        "seq_len": args.seq,
        "tokens_per_rank": args.batch * args.seq,
        "precision": "fp32",
        "ranks": RANKS,
        "threads_per_rank": args.threads_per_rank,
        "steps": args.steps,
        "warmup": args.warmup,
        "machine": cpu_description(),
        "torch": torch.__version__,
        "backend": "gloo",
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        "layer": layer_table(layer_ep, layer_fsdp, plan),
        "routing": imbalance([r["layer"]["ep"] for r in ranks]),
        "crossover_tokens_per_rank": crossover_tokens(plan, args.batch * args.seq, m.n_routed_experts),
        "plan": plan,
        "layer_detail": {"ep": layer_ep, "fsdp": layer_fsdp},
    }
    if args.model:
        model_ep = summarise([r["model_ep"] for r in ranks])
        model_fsdp = summarise([r["model_fsdp"] for r in ranks])
        result["model_steps"] = args.model_steps
        result["whole_model"] = model_table(model_ep, model_fsdp, plan)
        result["model_detail"] = {"ep": model_ep, "fsdp": model_fsdp}
    result["load_average_before"] = load_before
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    return result


def mismatches(result: dict) -> list[str]:
    """Every counted figure the plan predicts differently, and every all-to-all whose bytes differ from its splits."""
    out = []
    tables = [("layer", result["layer"]["rows"])]
    if result.get("whole_model"):
        tables += [(f"whole model {n}", result["whole_model"][n]["rows"]) for n in ("ep", "fsdp")]
    for where, rows in tables:
        for kind, row in rows.items():
            plan = row["plan"]
            if plan["equal"] is False:
                out.append(f"{where}: {kind}: counted {plan['counted']:.0f} B, plan {plan['predicted']:.0f} B")
            wire = row.get("plan_wire")
            if wire and wire["equal"] is False:
                out.append(f"{where}: {kind}: leaving {wire['counted']:.0f} B, plan's wire {wire['predicted']:.0f} B")
            if row.get("plan_calls") is not None and row["calls"] != row["plan_calls"]:
                out.append(f"{where}: {kind}: {row['calls']:.0f} calls, plan {row['plan_calls']:.0f}")
    if result["layer"]["split_mismatches"]:
        out.append(f"{result['layer']['split_mismatches']} all-to-alls handed bytes that differ from their splits")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank (the config's train.batch_size)")
    ap.add_argument("--seq", type=int, default=256, help="the config's train.seq_len")
    ap.add_argument("--steps", type=int, default=5, help="timed MoE-layer steps per configuration")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (Quantile Balancing sets its bias)")
    ap.add_argument("--model-steps", type=int, default=2, help="timed whole-model steps per configuration")
    ap.add_argument("--model-warmup", type=int, default=1)
    ap.add_argument("--no-model", dest="model", action="store_false", help="the MoE layer only")
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="shared out among the 2 ranks")
    ap.add_argument("--quick", action="store_true", help="smoke test: 32 tokens a rank, 1 step, no whole model")
    ap.add_argument("--out", type=Path, help=f"the JSON (default {RESULTS.relative_to(ROOT)}; --quick: none)")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.seq, args.steps, args.warmup, args.model = 1, 32, 1, 1, False
    args.threads_per_rank = max(1, args.cores // RANKS)
    result = measure(args)
    print_tables(result)
    found = mismatches(result)
    print("\ncounted against the plan: " + ("every figure equal" if not found else "MISMATCHES:"))
    for line in found:
        print("  " + line)
    result["mismatches"] = found
    print(
        f"load average before {result['load_average_before']}, after {result['load_average_after']}; "
        f"{result['machine']['cpu_model']}, {result['machine']['torch_cpu_capability']}; {result['seconds']} s"
    )
    sys.path.insert(0, str(HERE))
    from results_file import write_unless_quick

    write_unless_quick(args.out, args.quick, RESULTS, result)
    return result


if __name__ == "__main__":
    main()
