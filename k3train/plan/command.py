"""What to run: the `python -m k3train` command (torchrun or srun across nodes) that trains the plan shown, and a
warning when the plan's rows are a quickstart's, far shorter than the model is built for.

The command spells out every setting the plan depends on (precision, activation checkpointing, micro-batch,
accumulation, the parallel strategy, ep, cp, HSDP's replicas, pp), not only what differs from the config's
defaults, so that it trains what was planned whatever the defaults become; the user's own overrides stay, in place.
Launch forms are docs/distributed.md's: one process as it is, one node with torchrun --standalone, several nodes
with torchrun's c10d rendezvous (the same command on every node) or srun (one task a GPU).
"""

from __future__ import annotations

import math
import shlex

from k3train.plan.hardware import Hardware
from k3train.plan.mesh import Mesh
from k3train.plan.spec import RunSpec

# A row shorter than this (or than max_seq_len / 8 for a model built for shorter rows) is a quickstart recipe, not
# how the model is pre-trained: Kimi K2 pre-trained at 4,096 of its 131,072 positions (arXiv 2507.20534, section
# 2.5); activations, FLOPs per token and what fits all change with the row's length.
REALISTIC_SEQ_LEN = 4096


def short_rows(spec: RunSpec) -> str | None:
    """One line when train.seq_len is far below the model's max_seq_len (the threshold above), else None."""
    max_len = spec.model.max_seq_len
    floor = min(REALISTIC_SEQ_LEN, max_len // 8)
    if spec.seq_len >= floor:
        return None
    return (
        f"train.seq_len {spec.seq_len:,} is a quickstart row for a model of max_seq_len {max_len:,} (under "
        f"{floor:,}): plan a realistic length with train.seq_len={min(REALISTIC_SEQ_LEN, max_len)}"
    )


def run_overrides(spec: RunSpec, mesh: Mesh, given: list[str]) -> list[str]:
    """The overrides that train `spec` on `mesh`: the given ones (a key set here takes this value in place), then
    the rest of the plan's settings. A change of strategy drops the given parallel.* keys it does not set (DDP's
    bucket_cap_mb is not FSDP's), re-setting the pipeline's from the spec."""
    wanted = {
        "precision": spec.precision,
        "train.activation_checkpointing": spec.checkpointing,
        "train.batch_size": str(spec.batch_size),
        "train.gradient_accumulation_steps": str(spec.accumulation),
    }
    strategy = spec.strategy if mesh.world == 1 else mesh.strategy
    if mesh.world > 1:  # ep and cp always: a config or experiment may set them where no override shows it
        wanted["parallel"] = strategy
        if strategy == "hsdp" or (strategy == "fsdp" and spec.dp_replicate != 1):
            wanted["parallel.dp_replicate"] = str(mesh.dp_replicate)
        wanted["parallel.ep"] = str(mesh.ep)
        wanted["parallel.cp"] = str(mesh.cp)
    if mesh.pp > 1:
        wanted["parallel.pp"] = str(mesh.pp)
        wanted["parallel.pp_schedule"] = spec.pp_schedule
        if spec.pp_virtual_stages > 1:
            wanted["parallel.pp_virtual_stages"] = str(spec.pp_virtual_stages)
        if spec.pp_microbatches is not None:
            wanted["parallel.pp_microbatches"] = str(spec.pp_microbatches)
    if strategy in ("fsdp", "hsdp") and not spec.reshard_after_forward:
        wanted["parallel.reshard_after_forward"] = "false"
    switched = mesh.world > 1 and {"hsdp": "fsdp"}.get(strategy, strategy) != spec.strategy
    out = []
    for override in given:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in wanted:
            out.append(f"{key}={wanted.pop(key)}")
        elif not (switched and key.startswith("parallel.")):
            out.append(override)
    return out + [f"{k}={v}" for k, v in wanted.items()]


def launch(devices: int, hw: Hardware, overrides: list[str]) -> list[str]:
    """The commands that start `python -m k3train overrides` on `devices` processes: one, or torchrun on one node, or
    across nodes torchrun (on every node) and srun. Nodes hold hw.devices_per_node, or the largest count that
    divides the devices evenly."""
    args = " ".join(shlex.quote(o) for o in overrides)
    if devices == 1:
        return [f"python -m k3train {args}"]
    per_node = hw.devices_per_node or devices  # a CPU: every process on this machine
    if devices <= per_node:
        return [f"torchrun --standalone --nproc_per_node={devices} -m k3train {args}"]
    per_node = math.gcd(devices, per_node)
    nodes = devices // per_node
    return [
        f"torchrun --nnodes={nodes} --nproc_per_node={per_node} --rdzv_backend=c10d "
        f"--rdzv_endpoint=$MASTER_ADDR:29500 -m k3train {args}",
        f"srun --nodes={nodes} --ntasks-per-node={per_node} --gpus-per-node={per_node} --kill-on-bad-exit=1 "
        f"python -m k3train {args}",
    ]
