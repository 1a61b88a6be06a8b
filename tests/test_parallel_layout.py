"""One parallel layout for the run and the planner (k3train/runtime/parallel_layout.py): the same rules refuse the
same meshes, the same sizes come out, and the experts' shard dim and Muon's placement are each one decision."""

from __future__ import annotations

import pytest

from k3train.optim.muon_distributed import muon_placement
from k3train.plan.mesh import Mesh
from k3train.runtime.parallel_dims import ParallelDims
from k3train.runtime.parallel_layout import ParallelLayout, expert_shard_dim


@pytest.mark.parametrize(
    "degrees, message",
    [
        (dict(ep=0), "parallel.ep=0 must be a positive integer"),
        (dict(dp_shard=0), r"dp_shard \(the processes under parallel=fsdp; --mesh R x S x E\)=0 must be a positive"),
        (dict(dp_replicate=4, ep=3), "parallel.ep=3 must divide the 4 process"),
        (dict(dp_replicate=2, dp_shard=4, ep=8), "parallel.ep=8 must divide dp_shard=4"),
        (dict(dp_shard=4, cp=3), "parallel.cp=3 must divide the 4 process"),
    ],
)
def test_one_set_of_rules_refuses_for_the_run_and_the_planner(degrees: dict, message: str) -> None:
    for layout in (ParallelLayout, Mesh, ParallelDims):  # the run checks the layout before refusing HSDP
        with pytest.raises(ValueError, match=message):
            layout(**degrees)


def test_hsdp_is_a_layout_the_planner_plans_and_the_run_builds() -> None:
    hsdp = ParallelLayout(dp_replicate=2, dp_shard=4, ep=2)
    assert (hsdp.strategy, hsdp.world, hsdp.expert_dp, hsdp.expert_shard, hsdp.expert_replicas) == ("hsdp", 8, 4, 2, 2)
    assert Mesh.parse("2x4x2").strategy == "hsdp"
    dims = ParallelDims(dp_replicate=2, dp_shard=4, ep=2)
    assert dims.layout == hsdp and dims.expert_shard == hsdp.expert_shard


@pytest.mark.parametrize(
    "strategy, world, ep, cp, replicas",
    [("ddp", 8, 4, 1, 1), ("fsdp", 8, 2, 2, 1), ("fsdp", 4, 4, 1, 1), ("fsdp", 8, 1, 2, 2), ("fsdp", 8, 2, 1, 2)],
)
def test_the_run_holds_the_layout_the_planner_plans(strategy: str, world: int, ep: int, cp: int, replicas: int) -> None:
    dims = ParallelDims.for_strategy(strategy, world, 0, "cpu", ep=ep, cp=cp, dp_replicate=replicas)
    mesh = Mesh(world, 1, ep, cp) if strategy == "ddp" else Mesh(replicas, world // replicas, ep, cp)
    assert dims.layout == ParallelLayout(mesh.dp_replicate, mesh.dp_shard, mesh.ep, mesh.cp)
    assert (dims.world_size, dims.dp_size, dims.expert_dp) == (mesh.world, mesh.dp_size, mesh.expert_dp)
    assert mesh.expert_dp == mesh.expert_shard * mesh.expert_replicas
    assert dims.expert_shard == mesh.expert_shard  # FSDP2: all of expert_dp; HSDP: within a replica group
    if strategy == "fsdp" and replicas == 1:
        assert mesh.expert_shard == dims.expert_dp


def test_experts_are_sharded_whole_while_each_rank_gets_one() -> None:
    assert [expert_shard_dim(local, 4) for local in (8, 4, 3, 1)] == [0, 0, 1, 1]
    assert expert_shard_dim(1, 1) == 0


@pytest.mark.parametrize(
    "sharded, expert_parallel, whole_experts, data_parallel, where",
    [
        (False, False, False, False, "own"),  # one process
        (False, False, False, True, "replicated"),  # DDP
        (False, True, True, True, "own"),  # DDP's own experts, or FSDP2 leaving them whole (expert_dp 1)
        (True, False, False, True, "owners"),  # an FSDP2 shard
        (True, True, True, True, "own"),  # whole experts FSDP2 sharded on dim 0
        (True, True, False, True, "owners"),  # experts sliced on dim 1
    ],
)
def test_muon_places_each_parameter_one_way(
    sharded: bool, expert_parallel: bool, whole_experts: bool, data_parallel: bool, where: str
) -> None:
    facts = dict(sharded=sharded, expert_parallel=expert_parallel, whole_experts=whole_experts)
    assert muon_placement(**facts, data_parallel=data_parallel) == where
