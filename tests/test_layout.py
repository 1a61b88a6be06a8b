"""The house rules: the paths group and where the environment and the command line win, experiments chosen
without `+`, and ParallelDims as the one description of how ranks divide the work."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from k3train.config import register_configs
from k3train.runtime.parallel_dims import ParallelDims
from k3train.train.parallel import DDP

from helpers.config import composed
from helpers.tiny_k3 import tiny_model


def _run_dirs(monkeypatch, env: dict, *overrides: str) -> tuple[str, str]:
    for name in ("K3TRAIN_OUTPUTS", "K3TRAIN_CACHE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    register_configs()
    with initialize_config_module(config_module="k3train.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    return OmegaConf.select(cfg, "hydra.sweep.dir"), cfg.paths.cache


def test_output_and_cache_roots_come_from_paths_with_the_environment_over_the_file(monkeypatch) -> None:
    sweep, cache = _run_dirs(monkeypatch, {})
    assert sweep.startswith("outputs/sweeps/") and cache == "~/.cache/k3train"
    sweep, cache = _run_dirs(monkeypatch, {"K3TRAIN_OUTPUTS": "/env/out", "K3TRAIN_CACHE": "/env/cache"})
    assert sweep.startswith("/env/out/sweeps/") and cache == "/env/cache"
    # the command line wins over both
    sweep, cache = _run_dirs(monkeypatch, {"K3TRAIN_OUTPUTS": "/env/out"}, "paths.outputs=/cli/out", "paths.cache=/c")
    assert sweep.startswith("/cli/out/sweeps/") and cache == "/c"


def test_an_experiment_is_chosen_without_a_plus_and_the_command_line_still_wins() -> None:
    default = OmegaConf.to_container(composed(), resolve=False)
    quickstart = OmegaConf.to_container(composed("experiment=quickstart"), resolve=False)
    assert quickstart == default  # quickstart spells the default run out
    small = composed("experiment=k3_small_gpu", "train.max_steps=7")
    assert small.model.d_model == composed("model=k3_small").model.d_model  # the experiment's override /model
    assert small.train.max_steps == 7
    with pytest.raises(Exception, match="(?i)could not (find|load)|not found"):
        composed("experiment=no_such_recipe")


def test_parallel_dims_say_how_the_ranks_divide_the_work() -> None:
    one = ParallelDims()
    assert (one.world_size, one.several_ranks, one.dp_group, one.describe()) == (1, False, None, "one process")
    ddp = ParallelDims.for_strategy("ddp", world_size=4, rank=3, device_type="cpu")
    assert (ddp.dp_replicate, ddp.dp_shard, ddp.dp_size, ddp.dp_rank) == (4, 1, 4, 3)
    assert ddp.describe() == "DDP over 4 process(es)"
    fsdp = ParallelDims.for_strategy("fsdp", world_size=2, rank=0, device_type="cpu")
    assert (fsdp.dp_replicate, fsdp.dp_shard) == (1, 2) and fsdp.describe() == "FSDP2 over 2 process(es)"
    with pytest.raises(ValueError, match="no dp_shard dimension"):
        ddp.shard_mesh  # noqa: B018 - a DDP run has nothing to shard over
    hsdp = ParallelDims.for_strategy("fsdp", world_size=4, rank=3, device_type="cpu", dp_replicate=2)
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.dp_size, hsdp.dp_rank) == (2, 2, 4, 3)
    assert hsdp.describe() == "HSDP: 2 replica groups, each FSDP2 over 2 process(es)"
    for pp, dp_replicate in ((2, 1), (1, 2)):  # one process a stage or a replica group: the fix, not FSDP2's failure
        with pytest.raises(ValueError, match=r"= 1 process: nothing to shard over; use parallel=ddp for this layout, "
                           r"or run on 4 processes or more"):  # fmt: skip
            ParallelDims.for_strategy("fsdp", world_size=2, rank=0, device_type="cpu", pp=pp, dp_replicate=dp_replicate)
    with pytest.raises(ValueError, match="rank 4 outside a world of 4"):
        ParallelDims(dp_replicate=4, rank=4)
    with pytest.raises(ValueError, match="unknown parallel strategy 'tp'"):
        ParallelDims.for_strategy("tp", world_size=2, rank=0, device_type="cpu")
    ep = ParallelDims.for_strategy("ddp", world_size=4, rank=1, device_type="cpu", ep=2)
    assert ep.describe() == "DDP over 4 process(es), routed experts split over 2 ranks (expert parallel)"
    assert ParallelDims(dp_replicate=2, ep=2).ep == 2 and ParallelDims().ep_group is None
    with pytest.raises(ValueError, match="parallel.ep=3 must divide the 4 process"):
        ParallelDims(dp_replicate=4, ep=3)
    both = ParallelDims.for_strategy("fsdp", world_size=4, rank=0, device_type="cpu", ep=2)
    assert both.expert_dp == 2 and both.describe() == (
        "FSDP2 over 4 process(es), routed experts split over 2 ranks (expert parallel)"
    )
    with pytest.raises(ValueError, match="no expert mesh"):
        ParallelDims(dp_shard=2).expert_mesh  # noqa: B018
    assert not dist.is_initialized()  # none of this asked torch.distributed anything


def test_the_parallelize_function_hands_every_moe_the_run_group_and_none_in_one_process() -> None:
    model = tiny_model()
    moes = [m for m in model.modules() if hasattr(m, "process_group")]
    assert moes  # k3_tiny-shaped: MoE layers that balance over a group
    for module in moes:
        module.process_group = "stale"
    assert DDP().shard(model, torch.device("cpu"), ParallelDims()) is model
    assert all(m.process_group is None for m in moes)


def test_models_and_optim_never_ask_torch_distributed_who_they_are() -> None:
    """The groups come from ParallelDims: a module-level query (is the world up, who is rank 0, the default group)
    in models/ or optim/ would bypass it the day expert or context parallelism splits the world other ways."""
    import re
    from pathlib import Path

    import k3train

    root = Path(k3train.__file__).parent
    query = re.compile(r"is_initialized\(|group\.WORLD|get_rank\(\)|get_world_size\(\)|current_world|several_ranks")
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for package in ("models", "optim")
        for path in sorted((root / package).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if query.search(line) and not line.lstrip().startswith("#")
    ]
    assert not found, "\n".join(found)


def test_every_package_ships_in_a_wheel() -> None:
    """pyproject.toml lists the packages a wheel holds; one left out imports from a checkout (an editable install)
    and is missing from a real install."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {".".join(init.parent.relative_to(root).parts) for init in (root / "k3train").rglob("__init__.py")}
    assert packages - listed == set(), f"add these to [tool.setuptools] packages in pyproject.toml: {packages - listed}"
