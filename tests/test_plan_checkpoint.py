"""The planner's checkpoint (k3train/plan/checkpoint.py): the size it plans is the bytes a real checkpoint of the
same model holds in its weights and optimizer state, the blocked time is the largest rank's shards over the host
link, and the write time follows the storage bandwidth stated."""

import pytest
import torch

from k3train.plan.__main__ import main
from k3train.plan.checkpoint import plan_checkpoint, state_bytes
from k3train.plan.estimate import estimate
from k3train.plan.hardware import GPUS
from k3train.plan.mesh import Mesh
from k3train.plan.spec import build_spec

from helpers.config import K3_SHRUNK, composed, fit_k3


def _tensor_bytes(tree) -> int:
    if torch.is_tensor(tree):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def test_the_planned_size_is_what_a_checkpoint_holds(monkeypatch, tmp_path, tiny_data_dir):
    trainer = fit_k3(monkeypatch, tmp_path, tiny_data_dir, "train.max_steps=1")
    parameters = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    weights_and_state = parameters + _tensor_bytes(trainer.optimizer.state_dict()["state"])
    buffers = sum(b.numel() * b.element_size() for b in trainer.model.buffers())  # small: the MoE bias, RoPE tables
    step_counters = 8 * len(trainer.optimizer.state_dict()["state"])  # AdamW's step, a float64 scalar at most
    cfg = composed("model=k3_tiny", *K3_SHRUNK, f"model.vocab_size={trainer.model.config.vocab_size}")
    planned = state_bytes(build_spec(cfg, "cpu"))
    assert weights_and_state - step_counters <= planned <= weights_and_state
    assert buffers < 0.05 * planned  # what the plan leaves out


def test_blocked_time_is_the_largest_ranks_shards_over_the_host_link():
    spec = build_spec(composed("model=k3_small", "train.batch_size=1", "model.vocab_size=32768"), "cuda")
    hw = GPUS["h200"]
    e = estimate(spec, Mesh(1, 16, 1), hw)
    plan = plan_checkpoint(spec, e, hw, storage_bytes_per_s=2e9)
    rank = e.memory.params + sum(e.memory.optimizer.values())
    assert plan.rank_bytes == rank and plan.blocked_s == pytest.approx(rank / 64e9)
    assert plan.total_bytes <= 16 * rank <= 1.05 * plan.total_bytes  # every rank a shard: padding apart
    assert plan.node_bytes == pytest.approx(plan.total_bytes / 2)  # 16 H200s: 2 nodes of 8
    assert plan.write_s == pytest.approx(plan.node_bytes / 2e9)


def test_the_plan_prints_the_checkpoint_and_refuses_a_bandwidth_of_zero(capsys):
    args = ["model=k3_small", "model.vocab_size=32768", "train.batch_size=1", "--gpus", "8"]
    assert main([*args, "--storage-gbps", "4"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint (fp32 weights, Muon momentum, AdamW moments)" in out and "at 4 GB/s a node" in out
    assert main([*args, "--storage-gbps", "0"]) == 2
    assert "--storage-gbps must be > 0" in capsys.readouterr().err
