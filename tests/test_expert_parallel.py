"""Expert parallelism's token exchange (k3train/models/k3/moe/dispatch.py) on 2 gloo ranks against one process:
each rank holds half the routed experts and sends its token slots to them by all-to-all. The MoE output of each
rank's batch, the gradient of every weight it holds and the Quantile-Balancing bias (quantiles over both ranks'
tokens) equal the one-process MoE's on the same batches, for the plain and the latent (K3) MoE."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from k3train.models.k3.moe import MoE

from helpers.spawn import spawn_ranks

D, E, K = 32, 8, 2
CASES = {
    "swiglu": dict(),
    "k3_latent_situ": dict(latent_dim=16, activation="situ"),
}


def make_moe(case: str) -> MoE:
    torch.manual_seed(0)
    moe = MoE(D, E, K, expert_ffn_dim=32, n_shared_experts=1, **CASES[case]).double()
    with torch.no_grad():
        moe.expert_bias.copy_(0.1 * torch.randn(E, dtype=torch.float64))
    return moe


def batch(rank: int) -> torch.Tensor:
    return torch.randn(2, 24, D, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def cotangent(rank: int) -> torch.Tensor:
    return torch.randn(2, 24, D, generator=torch.Generator().manual_seed(200 + rank), dtype=torch.float64)


def run(moe: MoE, x: torch.Tensor, grad: torch.Tensor) -> dict:
    """One training-mode pass (the bias moves) and a backward of `grad`."""
    y = moe(x)
    y.backward(grad)
    return {
        "y": y.detach(),
        "grads": {n: p.grad.clone() for n, p in moe.named_parameters()},
        "bias": moe.expert_bias.clone(),
    }


def _rank_main(rank: int, world_size: int) -> dict:
    from k3train.models.k3.moe import shard_experts

    out = {}
    for case in CASES:
        moe = make_moe(case)
        moe.process_group = dist.group.WORLD  # Quantile Balancing over both ranks' tokens
        shard_experts(moe, dist.group.WORLD)
        out[case] = run(moe, batch(rank), cotangent(rank))
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp_path = tmp_path_factory.mktemp("ep-2-ranks")
    return spawn_ranks(_rank_main, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_with_half_the_experts_each_equal_one_process(two_ranks: list[dict], case: str) -> None:
    # one process on both batches at once: the same routing, the same quantiles over all tokens
    moe = make_moe(case)
    want = run(moe, torch.cat([batch(0), batch(1)]), torch.cat([cotangent(0), cotangent(1)]))
    half = E // 2
    for rank, got in enumerate(r[case] for r in two_ranks):
        torch.testing.assert_close(got["y"], want["y"][2 * rank : 2 * rank + 2], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got["bias"], want["bias"], rtol=1e-10, atol=1e-12)
        for name, g in got["grads"].items():
            if name.startswith("experts."):  # this rank's experts: every token that chose them, from both ranks
                torch.testing.assert_close(
                    g, want["grads"][name][rank * half : (rank + 1) * half], rtol=1e-10, atol=1e-12
                )
    for name, g in want["grads"].items():  # the rest: each rank's share, which DDP's all-reduce sums
        if not name.startswith("experts."):
            total = two_ranks[0][case]["grads"][name] + two_ranks[1][case]["grads"][name]
            torch.testing.assert_close(total, g, rtol=1e-10, atol=1e-12, msg=name)
    assert two_ranks[0][case]["grads"]["experts.w_gate"].shape[0] == half


def test_experts_that_do_not_split_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from k3train.models.k3.moe import shard_experts

    # a stand-in group of 3 ranks: the check comes before any communication
    monkeypatch.setattr(dist, "get_world_size", lambda group: 3)
    monkeypatch.setattr(dist, "get_rank", lambda group: 0)
    with pytest.raises(ValueError, match="8 routed experts do not split over parallel.ep=3"):
        shard_experts(make_moe("swiglu"), object())


# --- parallel.ep in a run (torchrun, 2 or 4 gloo ranks) --------------------------------------------------------------


def assert_trains_as_one_process(one, run, least_steps: int = 2) -> None:
    """`run` logged the train and eval losses of the one-process run `one` and its checkpoint (sharded, the experts
    whole when read) holds one's weights, both within FP64_BOUND (the runs are fp64: helpers/distributed_runs.py)."""
    from k3train.checkpoint.checkpointer import load_checkpoint

    from helpers.distributed_runs import FP64_BOUND, steps

    for event in ("train", "eval"):
        a, b = steps(one, event), steps(run, event)
        assert sorted(a) == sorted(b) and len(a) >= least_steps
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=FP64_BOUND), (event, step)
    assert not (run / "last.pt").exists()
    want, got = load_checkpoint(one / "last.pt")["model"], load_checkpoint(run / "last.dcp")["model"]
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=FP64_BOUND, msg=name)


@pytest.mark.slow
def test_a_run_with_ep_2_trains_as_one_process_and_resumes_on_another_ep_size(k3_cache, tmp_path) -> None:
    """k3_tiny shrunk (Muon + AdamW, Quantile Balancing, QK-Clip), 4 updates with 2 micro-batches each: 2 ranks with
    the routed experts split between them log the losses of one process with their global batch, and save each
    rank's own experts in a sharded checkpoint that reads whole; a 2-rank run with ep=2 stopped at step 2 resumes
    with ep=1 (plain DDP) to the same losses, and the other way round; the checkpoint loads for inference with every
    expert."""
    from helpers.distributed_runs import FP64_BOUND, K3, launch, steps

    args = [*K3, "train.max_steps=4", "train.gradient_accumulation_steps=2", "train.checkpoint_interval=2"]
    one, two = tmp_path / "one", tmp_path / "two"
    proc = launch(k3_cache, *args, "train.batch_size=4", f"hydra.run.dir={one}", ranks=None)
    assert proc.returncode == 0, proc.stderr
    proc = launch(k3_cache, *args, "train.batch_size=2", "parallel.ep=2", f"hydra.run.dir={two}")
    assert proc.returncode == 0, proc.stderr
    assert "routed experts split over 2 ranks" in proc.stdout
    assert_trains_as_one_process(one, two)

    switched = tmp_path / "switched"
    proc = launch(
        k3_cache, *args, "train.batch_size=2", "parallel.ep=2", "train.stop_after=2", f"hydra.run.dir={switched}"
    )
    assert proc.returncode == 0, proc.stderr
    proc = launch(k3_cache, *args, "train.batch_size=2", "parallel.ep=1", f"hydra.run.dir={switched}", "resume=auto")
    assert proc.returncode == 0, proc.stderr
    for step, loss in steps(two).items():
        assert steps(switched)[step] == pytest.approx(loss, rel=FP64_BOUND), step
    back = tmp_path / "back"  # and the other way: ep=1 to step 2, then ep=2
    for extra in (["parallel.ep=1", "train.stop_after=2"], ["parallel.ep=2", "resume=auto"]):
        proc = launch(k3_cache, *args, "train.batch_size=2", *extra, f"hydra.run.dir={back}")
        assert proc.returncode == 0, proc.stderr
    for step, loss in steps(two).items():
        assert steps(back)[step] == pytest.approx(loss, rel=FP64_BOUND), step
    from k3train.inference.loading import load

    assert load(two).model.layers[1].ffn.experts.w_gate.shape[0] == 8  # generate, evaluate, export: whole experts


@pytest.mark.slow
def test_fsdp_with_ep_2_trains_as_one_process_writes_each_ranks_experts_and_a_killed_rank_resumes_bitwise(
    k3_cache, tmp_path
) -> None:
    """parallel=fsdp parallel.ep=2 on 2 ranks (the dense parts sharded over both, the routed experts split between
    them), 8 updates of 2 micro-batches: the losses and weights of one process with the global batch. Its checkpoint
    holds each rank's own experts (two chunks in DCP's metadata, nothing gathered), reads whole for inference, and a
    run whose rank 1 is killed after step 5 resumes to the uninterrupted run's losses and weights, bit for bit."""
    from k3train.checkpoint.checkpointer import load_checkpoint
    from k3train.checkpoint.dcp import SafeFileSystemReader
    from k3train.consolidate import consolidate
    from k3train.inference.loading import load

    from helpers.distributed_runs import K3, kill_a_rank_then_resume, launch

    args = [*K3, "train.max_steps=8", "train.gradient_accumulation_steps=2", "train.checkpoint_interval=2"]
    ep = [*args, "train.batch_size=2", "parallel=fsdp", "parallel.ep=2"]
    one, straight, killed = tmp_path / "one", tmp_path / "straight", tmp_path / "killed"
    proc = launch(k3_cache, *args, "train.batch_size=4", f"hydra.run.dir={one}", ranks=None)
    assert proc.returncode == 0, proc.stderr
    proc = launch(k3_cache, *ep, f"hydra.run.dir={straight}")
    assert proc.returncode == 0, proc.stderr
    assert "FSDP2 over 2 process(es), routed experts split over 2 ranks" in proc.stdout
    assert_trains_as_one_process(one, straight, least_steps=4)
    chunks = SafeFileSystemReader(straight / "last.dcp").read_metadata().state_dict_metadata
    experts = chunks["model/layers.1.ffn.experts.w_gate"]
    assert experts.size[0] == 8 and sorted(c.offsets[0] for c in experts.chunks) == [0, 4]  # each rank its own 4
    assert load(straight).model.layers[1].ffn.experts.w_gate.shape[0] == 8  # generate, evaluate, export
    one_file = load_checkpoint(consolidate(straight / "last.dcp"))  # k3train.consolidate: whole experts, one file
    assert one_file["model"]["layers.1.ffn.experts.w_gate"].shape[0] == 8
    assert one_file["optimizer"]["state"].keys() == load_checkpoint(straight / "last.dcp")["optimizer"]["state"].keys()

    kill_a_rank_then_resume(k3_cache, ep, straight, killed, "last.dcp")
    resumed = load_checkpoint(killed / "last.dcp")
    for part in ("model", "optimizer"):
        flat_want, flat_got = _tensors(load_checkpoint(straight / "last.dcp")[part]), _tensors(resumed[part])
        assert flat_want.keys() == flat_got.keys()
        for key, value in flat_want.items():
            assert torch.equal(flat_got[key], value), (part, key)


@pytest.mark.slow
@pytest.mark.parametrize("experts", ["whole", "sliced"])
def test_four_ranks_ep_2_by_fsdp_2_train_as_one_process(k3_cache, tmp_path, experts: str) -> None:
    """ep 2 x dp_shard 2: each pair of ranks splits the routed experts, and FSDP2 shards each rank's experts again
    over the two ranks holding the same ones (its reduce-scatter divides by all 4): whole experts per rank (8
    experts, 4 an ep rank, dim 0), or with 2 experts (1 an ep rank) slices of it (dim 1), which Muon's owners
    orthogonalise a stack each. Losses and weights as one process with the global batch; the checkpoint holds four
    chunks of every expert weight. The sliced run, stopped at step 2, resumes on 2 ranks (ep 2, experts unsharded)
    to the same losses."""
    from k3train.checkpoint.dcp import SafeFileSystemReader

    from helpers.distributed_runs import K3, launch

    model = [] if experts == "whole" else ["model.n_routed_experts=2", "model.experts_per_token=1"]
    args = [*K3, *model, "train.max_steps=4", "train.gradient_accumulation_steps=2", "train.checkpoint_interval=2"]
    one, four = tmp_path / "one", tmp_path / "four"
    proc = launch(k3_cache, *args, "train.batch_size=4", f"hydra.run.dir={one}", ranks=None)
    assert proc.returncode == 0, proc.stderr
    fsdp_ep = ["parallel=fsdp", "parallel.ep=2"]
    stop = ["train.stop_after=2"] if experts == "sliced" else []
    proc = launch(k3_cache, *args, "train.batch_size=1", *fsdp_ep, *stop, f"hydra.run.dir={four}", ranks=4)
    assert proc.returncode == 0, proc.stderr
    chunks = SafeFileSystemReader(four / "last.dcp").read_metadata().state_dict_metadata
    w_gate = chunks["model/layers.1.ffn.experts.w_gate"]
    offsets = sorted(tuple(c.offsets[:2]) for c in w_gate.chunks)
    rows = w_gate.size[1]
    want_offsets = (
        [(0, 0), (2, 0), (4, 0), (6, 0)] if experts == "whole" else [(0, 0), (0, rows // 2), (1, 0), (1, rows // 2)]
    )
    assert offsets == want_offsets
    if stop:
        proc = launch(k3_cache, *args, "train.batch_size=2", *fsdp_ep, f"hydra.run.dir={four}", "resume=auto")
        assert proc.returncode == 0, proc.stderr
    assert_trains_as_one_process(one, four)


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint part, by its path."""
    if torch.is_tensor(tree):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    return {k: v for key, sub in items for k, v in _tensors(sub, f"{prefix}/{key}").items()}
