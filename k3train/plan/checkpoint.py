"""A plan's checkpoint: how large it is, how long train.checkpoint_async keeps the loop waiting, and how long the
write behind it takes.

Saved are the fp32 weights, Muon's momentum and AdamW's two moments (gradients are not; the loaders, RNG and
counters are bytes). Each rank copies its own shards of them to pinned host memory while the loop waits: the
largest rank's share over the host link one way (hardware.py: PCIe Gen5 x16, 64 GB/s) is the blocked time, a
floor (a real copy also pays for pinning and many small tensors; measured copies are the benchmark's). DCP's
writer processes then write each tensor once (replicas' copies are deduplicated), spread over the nodes: the
write time needs the storage's write bandwidth per node, which no datasheet gives, so the user states it
(--storage-gbps); without it the plan gives the bytes each node writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3train.plan.activations import F32
from k3train.plan.estimate import Estimate
from k3train.plan.hardware import Hardware
from k3train.plan.spec import RunSpec


@dataclass(frozen=True)
class CheckpointPlan:
    total_bytes: float  # every tensor once
    rank_bytes: float  # the largest rank's shards: what it stages
    node_bytes: float  # what each node writes, the writes spread evenly
    blocked_s: float | None  # rank_bytes over the host link one way; None where the device has no figure
    write_s: float | None  # node_bytes over the stated storage bandwidth per node; None where none was stated


def state_bytes(spec: RunSpec) -> float:
    """The model's weights and optimizer state, once each: fp32 weights, one Muon momentum, two AdamW moments."""
    per_element = {"muon": 2, "adamw": 3, "frozen": 1}
    return sum(p.numel * F32 * per_element[p.kind] for p in spec.params)


def plan_checkpoint(spec: RunSpec, e: Estimate, hw: Hardware, storage_bytes_per_s: float | None) -> CheckpointPlan:
    m = e.memory
    rank = m.params + sum(m.optimizer.values())
    total = state_bytes(spec)
    nodes = max(1, e.mesh.world // hw.node_size(e.mesh.world))
    node = total / nodes
    host = hw.host_one_way
    return CheckpointPlan(
        total_bytes=total,
        rank_bytes=rank,
        node_bytes=node,
        blocked_s=rank / host if host else None,
        write_s=node / storage_bytes_per_s if storage_bytes_per_s else None,
    )


def checkpoint_lines(c: CheckpointPlan, storage_bytes_per_s: float | None) -> list[str]:
    gb = 1e9
    lines = [
        "checkpoint (fp32 weights, Muon momentum, AdamW moments)",
        f"  size {c.total_bytes / gb:,.1f} GB in all; {c.rank_bytes / gb:,.2f} GB staged by the largest rank, "
        f"{c.node_bytes / gb:,.1f} GB written by each node",
    ]
    if c.blocked_s is not None:
        lines.append(
            f"  blocked {c.blocked_s:.2f} s a save with train.checkpoint_async: the copy to pinned host memory over "
            "the host link,\n    one way (a floor); a synchronous save blocks for the whole write"
        )
    if c.write_s is not None:
        lines.append(
            f"  written in {c.write_s:,.1f} s behind training at {storage_bytes_per_s / gb:g} GB/s a node "
            "(--storage-gbps)"
        )
    else:
        lines.append("  write time: state the storage's write bandwidth per node with --storage-gbps")
    return lines
