"""data=mixture (k3train/data/mixture.py): rows drawn from several prepared datasets in proportion to their weights,
deterministic from the seed, the same on any number of data-parallel ranks, resumable bit for bit, and every bad
input refused in one line before anything is written."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

from k3train.data import EndOfData, HFTokenizer, MixtureData, TokenData, TokenDataLoader, prepare_dataset
from k3train.data.mixture import row_uniforms
from k3train.observe.metrics import read_metrics
from k3train.observe.sweep_table import read_job
from k3train.observe.sweep_table import sources as validated_sources

from helpers.config import composed
from helpers.data import DOCS, VAL_DOCS, byte_stream, train_tiny_bpe, write_jsonl
from helpers.distributed_runs import launch, steps

CODE_DOCS = [f"def f{i}(x):\n    return x * {i} + {i % 5}  # ✓\n" * (1 + i % 4) for i in range(60)]


def make_source(tmp_path, name, docs, own_val_first=False, **kwargs):
    """docs as train, VAL_DOCS and the first 10 of docs as val (those 10 first: `own_val_first`)."""
    train = write_jsonl(tmp_path / f"{name}-train.jsonl", docs)
    val_docs = docs[:10] + VAL_DOCS if own_val_first else VAL_DOCS + docs[:10]
    val = write_jsonl(tmp_path / f"{name}-val.jsonl", val_docs)
    prepare_dataset([train], tmp_path / name, val_inputs=[val], shard_tokens=251, workers=1, **kwargs)
    return tmp_path / name


@pytest.fixture
def two(tmp_path):
    """web: DOCS (3,963 byte tokens), code: CODE_DOCS (about 6,000), one byte tokenizer."""
    return {"web": make_source(tmp_path, "web", DOCS), "code": make_source(tmp_path, "code", CODE_DOCS)}


def mixture(paths, weights, **kwargs):
    sources = [{"name": name, "path": str(path)} for name, path in paths.items()]
    return MixtureData(sources, weights, **kwargs)


def expected_rows(streams, weights, seed, batch, n_rows, cursors, T):
    """The reference: a global batch's rows as the docs define them, row by row. Returns (rows [n, T+1], sources,
    cursors after)."""
    w = np.asarray(weights, dtype=np.float64)
    bounds = np.cumsum(w) / w.sum()
    bounds[np.flatnonzero(w > 0)[-1] :] = 1.0
    sources = np.searchsorted(bounds, row_uniforms(seed, batch * n_rows, n_rows), side="right")
    taken = [0] * len(streams)
    rows = []
    for s in sources:
        start = cursors[s] + taken[s] * T
        rows.append(streams[s][start : start + T + 1])
        taken[s] += 1
    return np.stack(rows), sources, [c + n * T for c, n in zip(cursors, taken)]


def take(loader, n):
    """n batches as one [n*B, T+1] array of rows (inputs and the last target) and their sources."""
    rows, sources = [], []
    for _ in range(n):
        x, y, _ = loader.next_batch()
        assert torch.equal(x[:, 1:], y[:, :-1])
        rows.append(torch.cat([x, y[:, -1:]], dim=1))
        sources.append(loader.last_sources)
    return torch.cat(rows), torch.cat(sources)


@pytest.mark.parametrize("seed", [0, 1, 1337])
def test_rows_come_from_the_sources_in_proportion_and_in_stream_order(two, seed):
    """400 rows at 0.25/0.75: the web share within 3 binomial standard deviations (sqrt(400 x 0.25 x 0.75) = 8.7
    rows) of 100, and every row exactly the next T+1 tokens of the source it says it came from."""
    data = mixture(two, [0.25, 0.75], seed=seed, document_masking=False)
    B, T, n = 8, 4, 50
    train, _ = data.loaders(B, T)
    rows, sources = take(train, n)
    assert rows.shape == (400, T + 1) and sources.shape == (400,) and sources.dtype == torch.int64
    web = int((sources == 0).sum())
    assert abs(web - 100) <= 3 * math.sqrt(400 * 0.25 * 0.75), web
    streams = [byte_stream(DOCS), byte_stream(CODE_DOCS)]
    cursors = [0, 0]
    for b in range(n):
        want, want_sources, cursors = expected_rows(streams, [0.25, 0.75], seed, b, B, cursors, T)
        assert np.array_equal(rows[b * B : (b + 1) * B].numpy(), want), b
        assert np.array_equal(sources[b * B : (b + 1) * B].numpy(), want_sources), b
    state = train.state_dict()
    assert state["cursors"] == {"web": cursors[0], "code": cursors[1]} and state["batches"] == n
    assert state["cursor"] == n * B * T == sum(cursors)


def test_one_source_at_weight_one_is_the_plain_loader_bit_for_bit(two):
    data = mixture({"web": two["web"]}, [1.0])
    plain = TokenData(two["web"])
    B, T = 3, 17
    for mixed, single in zip(data.loaders(B, T), plain.loaders(B, T)):
        assert mixed.batches_remaining() == single.batches_remaining() >= 1
        for _ in range(single.batches_remaining()):
            a, b = mixed.next_batch(), single.next_batch()
            assert all((u is None and v is None) or torch.equal(u, v) for u, v in zip(a, b, strict=True)), (
                "inputs, targets and document ids"
            )
        with pytest.raises(EndOfData):
            mixed.next_batch()


@pytest.mark.parametrize("on_exhausted", ["stop", "reweight"])
def test_a_resume_at_a_random_step_takes_bitwise_the_same_rows(two, tmp_path, on_exhausted):
    """Through torch.save / torch.load(weights_only=True), as a checkpoint holds it; under reweight the resume
    falls after the first source was dropped, so the dropped set travels too."""
    weights = [0.6, 0.4]
    B, T = 4, 8
    straight, _ = mixture(two, weights, on_exhausted=on_exhausted).loaders(B, T)
    total = straight.batches_remaining()
    all_rows, all_sources = take(straight, total)
    with pytest.raises(EndOfData):
        straight.next_batch()

    at = int(np.random.default_rng().integers(1, total))  # a random step, reported on failure
    first, _ = mixture(two, weights, on_exhausted=on_exhausted).loaders(B, T)
    take(first, at)
    torch.save(first.state_dict(), tmp_path / "state.pt")
    resumed, _ = mixture(two, weights, on_exhausted=on_exhausted).loaders(B, T)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert resumed.batches_remaining() == total - at, at
    rows, sources = take(resumed, total - at)
    assert torch.equal(rows, all_rows[at * B :]) and torch.equal(sources, all_sources[at * B :]), at
    if on_exhausted == "reweight":
        assert list(straight.state_dict()["dropped"]) == ["web"]  # web's 3,963 tokens run out first
    # any batch's sources again, before and after the resume (and the drop)
    for loader in (straight, resumed):
        assert torch.equal(torch.cat([loader.sources_of(b) for b in range(total)]), all_sources)
    with pytest.raises(ValueError, match=rf"batch {total} has not been taken"):
        resumed.sources_of(total)


@pytest.mark.parametrize("on_exhausted", ["stop", "reweight"])
def test_two_ranks_rows_together_are_one_ranks_global_batch(two, on_exhausted):
    data = mixture(two, [0.25, 0.75], on_exhausted=on_exhausted, seed=7)
    B, T = 3, 16
    one, _ = data.loaders(2 * B, T)
    ranks = [data.loaders(B, T, rank=r, world_size=2)[0] for r in (0, 1)]
    assert one.batches_remaining() == ranks[0].batches_remaining() == ranks[1].batches_remaining() > 10
    for _ in range(one.batches_remaining()):
        whole = one.next_batch()
        parts = [r.next_batch() for r in ranks]
        for i, name in enumerate(("inputs", "targets")):
            assert torch.equal(whole[i], torch.cat([p[i] for p in parts])), name
        assert torch.equal(one.last_sources, torch.cat([r.last_sources for r in ranks]))
        ids = [whole.document_ids, *(p.document_ids for p in parts)]
        if ids[0] is not None:  # a rank whose rows hold no boundary has none; its rows' ids are all 0
            full = [p if p is not None else torch.zeros(B, T, dtype=torch.int64) for p in ids[1:]]
            assert torch.equal(ids[0], torch.cat(full))
    same = ("cursors", "batches", "dropped", "cursor")
    states = [loader.state_dict() for loader in (one, *ranks)]
    assert all({k: s[k] for k in same} == {k: states[0][k] for k in same} for s in states)
    # a state written on 2 ranks restores on 1 with the same global batch
    restored, _ = data.loaders(2 * B, T)
    restored.load_state_dict(states[1])
    assert restored.state_dict() == states[0]


def test_stop_ends_at_the_first_source_used_up_and_names_it(two):
    B, T = 4, 16
    train, _ = mixture(two, [0.5, 0.5]).loaders(B, T)
    n = train.batches_remaining()
    take(train, n)
    state = train.state_dict()
    assert state["cursors"]["web"] + B * T >= 3963 - 1 >= state["cursors"]["web"]  # web ran short, not code
    assert train.batches_remaining() == 0
    with pytest.raises(EndOfData, match=r"source 'web' \(.*web\) of the train mixture is used up at batch") as e:
        train.next_batch()
    assert train.end_message() == str(e.value)  # known ahead, for a run's end to name the source


def test_reweight_drops_a_used_up_source_and_ends_when_all_are(two):
    B, T = 4, 16
    train, _ = mixture(two, [0.5, 0.5], on_exhausted="reweight").loaders(B, T)
    stop, _ = mixture(two, [0.5, 0.5]).loaders(B, T)
    n, n_stop = train.batches_remaining(), stop.batches_remaining()
    assert n > n_stop
    rows, sources = take(train, n)
    state = train.state_dict()
    assert state["dropped"]["web"] == n_stop  # dropped at the batch where stop ended
    assert not (sources[(n_stop + 1) * B :] == 0).any()  # nothing from web after it was dropped
    assert torch.equal(sources[: n_stop * B], take(mixture(two, [0.5, 0.5]).loaders(B, T)[0], n_stop)[1])
    # every token of code read once, in order: its rows are its stream cut every T tokens
    code = byte_stream(CODE_DOCS)
    code_rows = rows[sources == 1]
    assert np.array_equal(code_rows[:, :-1].flatten().numpy(), code[: len(code_rows) * T])
    assert len(code) - 1 - state["cursors"]["code"] < B * T  # code used up to within one batch
    with pytest.raises(EndOfData, match="every source of the train mixture is used up"):
        train.next_batch()
    assert train.end_message().startswith(f"every source of the train mixture is used up at batch {n}")


def test_a_state_of_another_mixture_is_refused_in_one_line(two, tmp_path):
    B, T = 2, 8
    train, _ = mixture(two, [0.25, 0.75]).loaders(B, T)
    train.next_batch()
    state = train.state_dict()
    for other, match in (
        (mixture(two, [0.5, 0.5]), r"weights: saved \[0.25, 0.75\], this run has \[0.5, 0.5\]"),
        (mixture(two, [0.25, 0.75], seed=1), r"seed: saved 0, this run has 1"),
        (mixture(two, [0.25, 0.75], on_exhausted="reweight"), r"on_exhausted: saved 'stop'"),
        (mixture({"code": two["code"], "web": two["web"]}, [0.25, 0.75]), r"sources: saved \[\{'name': 'web'"),
    ):
        loader, _ = other.loaders(B, T)
        with pytest.raises(ValueError, match=match) as e:
            loader.load_state_dict(state)
        assert "\n" not in str(e.value) and "resume with the data.sources, data.weights" in str(e.value)
    loader, _ = mixture(two, [0.25, 0.75]).loaders(1, T)
    with pytest.raises(ValueError, match=r"global batch .* = 2 rows, this loader has 1 x 1 = 1"):
        loader.load_state_dict(state)
    plain, _ = TokenData(two["web"]).loaders(B, T)
    with pytest.raises(ValueError, match="not written by MixtureLoader.state_dict"):
        loader.load_state_dict(plain.state_dict())


def test_bad_inputs_are_refused_in_one_line_before_anything_is_written(two, tmp_path):
    bpe = HFTokenizer(train_tiny_bpe(tmp_path / "tokenizer.json"), "<|endoftext|>")
    other = make_source(tmp_path, "bpe", DOCS, tokenizer=bpe)
    cache = tmp_path / "cache"
    cache.mkdir()
    web, code = ({"name": n, "path": str(two[n])} for n in ("web", "code"))
    builtin = {"name": "builtin", "path": None}
    cases = [
        ([web, code], [0.0, 0.0], r"data.weights=\[0.0, 0.0\] sum to 0; give at least one source a positive weight"),
        ([web, code], [0.5, -0.5], r"data.weights\[1\]=-0.5 \(code\) is negative"),
        ([web, code], [1.0], r"data.weights has 1 entries but data.sources has 2 \(web, code\); give one weight"),
        ([web, code], [1.0, float("nan")], r"data.weights\[1\]=nan \(code\) is not a finite number"),
        ([web, code], [1e308, 1e308], r"data.weights=\[1e\+308, 1e\+308\] sum to more than the largest float; "),
        (
            [builtin, {"name": "bpe", "path": str(other)}],
            [1, 1],
            r"data.sources\[1\] \(bpe: .*bpe\) was prepared with tokenizer .*data.sources\[0\] \(builtin: the built-in"
            r" corpus\) with .*prepare every source with the same --tokenizer",
        ),
        (
            [builtin, {"name": "gone", "path": str(tmp_path / "gone")}],
            [1, 1],
            r"data.sources\[1\] \(gone\): prepared dataset directory .*gone does not exist",
        ),
        ([web, {"name": "web", "path": str(two["code"])}], [1, 1], r"data.sources\[1\].name='web' repeats"),
        ([web, {"name": "code"}], [1, 1], r"data.sources\[1\]=\{'name': 'code'\} is not a \{name, path\} mapping"),
        ([], [], r"data.sources=\[\] is not a non-empty list"),
    ]
    for sources, weights, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            MixtureData(sources, weights, cache_dir=str(cache))
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"data.val_weights has 3 entries but data.sources has 2"):
        MixtureData([web, code], [1, 1], val_weights=[1, 1, 1])
    with pytest.raises(ValueError, match="data.on_exhausted='wrap': choose one of stop, reweight"):
        MixtureData([web], [1], on_exhausted="wrap")
    assert list(cache.iterdir()) == []  # the built-in source was never prepared


def test_data_mixture_composes_and_gives_per_source_val_loaders(two, k3_cache):
    sources = ",".join(f"{{name:{n},path:'{p}'}}" for n, p in two.items())
    cfg = composed("data=mixture", f"data.sources=[{sources}]", "data.weights=[1,3]", "data.seed=5")
    cfg.data.cache_dir = str(k3_cache)
    data = instantiate(cfg.data)
    assert isinstance(data, MixtureData) and data.weights == [1.0, 3.0] and data.seed == 5
    assert data.vocab_size == 257 and data.eod_id == 256 and data.tokenizer().identity() == bpe_free_identity()
    identity = data.identity()
    assert identity["mixture"]["weights"] == [1.0, 3.0] and identity["tokens"]["train"] == 3963 + len(
        byte_stream(CODE_DOCS)
    )
    assert [s["name"] for s in identity["mixture"]["sources"]] == ["web", "code"]
    vals = data.val_loaders(2, 8)
    assert sorted(vals) == ["code", "web"] and all(isinstance(v, TokenDataLoader) for v in vals.values())
    web_val = torch.from_numpy(byte_stream(VAL_DOCS + DOCS[:10])[:16])
    assert torch.equal(vals["web"].next_batch().inputs.flatten(), web_val)
    train, val = data.loaders(2, 8)
    assert val.split == "val" and val.weights == train.weights == [1.0, 3.0]
    # the shipped default (one built-in source) builds as it is
    default = composed("data=mixture")
    default.data.cache_dir = str(k3_cache)
    assert instantiate(default.data).loaders(2, 16)[0].next_batch().inputs.shape == (2, 16)


def bpe_free_identity():
    from k3train.data import ByteTokenizer

    return ByteTokenizer().identity()


@pytest.mark.slow
def test_python_m_k3train_trains_on_a_mixture_and_resumes_it_on_another_number_of_ranks(k3_cache, tmp_path):
    """4 steps in one process; the same run as 2 gloo ranks stopped after 2 steps, refused on other weights, then
    resumed in one process with the same global batch: the same losses (the sources' cursors are in the
    checkpoint)."""
    # each source's val split starts with its own documents, so the sources' val losses differ
    two = {"web": make_source(tmp_path, "web", DOCS, True), "code": make_source(tmp_path, "code", CODE_DOCS, True)}
    sources = ",".join(f"{{name:{n},path:'{p}'}}" for n, p in two.items())
    args = [
        "data=mixture",
        f"data.sources=[{sources}]",
        "model=smoke_test_lm",
        "optim.lr=0.05",  # enough to learn each source's bytes in 4 steps: their val losses differ
        "train.max_steps=4",
        "train.seq_len=32",
        "train.log_interval=1",
        "train.eval_interval=2",
        "train.eval_batches=1",
        "train.checkpoint_interval=2",
        "train.cpu_threads=1",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    weights = "data.weights=[0.25,0.75]"
    proc = launch(k3_cache, *args, weights, "train.batch_size=2", f"hydra.run.dir={straight}", ranks=None)
    assert proc.returncode == 0, proc.stderr
    proc = launch(k3_cache, *args, weights, "train.batch_size=1", "train.stop_after=2", f"hydra.run.dir={split}")
    assert proc.returncode == 0, proc.stderr
    again = [*args, "train.batch_size=2", f"hydra.run.dir={split}", "resume=auto"]
    proc = launch(k3_cache, *again, "data.weights=[0.5,0.5]", ranks=None)
    assert proc.returncode == 2
    assert "weights: saved [0.25, 0.75], this run has [0.5, 0.5]" in proc.stderr, proc.stderr
    proc = launch(k3_cache, *again, weights, ranks=None)
    assert proc.returncode == 0, proc.stderr
    a, b = steps(straight), steps(split)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    assert steps(straight, "eval") == pytest.approx(steps(split, "eval"), rel=1e-5)
    # the train loss per source: the 2 ranks' rows summed over both ranks give the one process's figures
    by_source = {
        run: {
            e["step"]: {k: v for k, v in e.items() if k.startswith("train/")}
            for e in read_metrics(run / "metrics.jsonl")
            if e["event"] == "train"
        }
        for run in (straight, split)
    }
    assert by_source[straight][1] and by_source[straight].keys() == by_source[split].keys()
    for step, figures in by_source[straight].items():
        assert by_source[split][step] == pytest.approx(figures, rel=1e-5), step
    # the run's data node rebuilt alone (no train.seed in reach): evaluate reads the val mixture
    proc = launch(k3_cache, str(straight), entry=("-m", "k3train.evaluate"), ranks=None)
    assert proc.returncode == 0 and "val: loss" in proc.stdout, proc.stderr

    # each source validated alone too: val/<source>/loss is that source's val split, as evaluate reads it (the
    # first batch of 2 rows, the final weights), and the sweep table has a column for it
    last = [e for e in read_metrics(straight / "metrics.jsonl") if e["event"] == "eval"][-1]
    for name, path in two.items():
        data = ["data=prepared", f"data.path={path}", "--batch-size", "2", "--max-batches", "1"]
        proc = launch(k3_cache, str(straight), *data, entry=("-m", "k3train.evaluate"), ranks=None)
        assert proc.returncode == 0, proc.stderr
        alone = float(re.search(r"val: loss ([0-9.]+)", proc.stdout).group(1))
        assert last[f"val/{name}/loss"] == pytest.approx(alone, abs=1e-4), name
    assert abs(last["val/web/loss"] - last["val/code/loss"]) > 1e-2  # so the check above tells them apart
    assert validated_sources([read_job(straight)]) == list(two)


@pytest.mark.parametrize("on_exhausted", ["stop", "reweight"])
@pytest.mark.parametrize("weights", [[0.25, 0.75], [0.9, 0.1], [0.0, 1.0]])
def test_batches_remaining_looked_ahead_in_small_chunks_is_what_next_batch_gives(
    two, monkeypatch, on_exhausted, weights
):
    """The look-ahead simulates many batches per chunk; with chunks of 1 or 2 batches it must still agree."""
    import k3train.data.mixture as mixture_mod

    monkeypatch.setattr(mixture_mod, "_SIMULATE_ROWS", 10)
    train, _ = mixture(two, weights, on_exhausted=on_exhausted).loaders(5, 8)
    n = train.batches_remaining()
    for i in range(n):
        assert train.batches_remaining() == n - i
        train.next_batch()
    with pytest.raises(EndOfData):
        train.next_batch()


def test_val_weights_give_jobs_of_other_weights_one_val_set(two):
    """A sweep of data.weights with data.val_weights set: every job validates on the same rows, those of the
    mixture at val_weights."""
    B, T = 2, 16
    a = mixture(two, [0.1, 0.9], val_weights=[0.5, 0.5]).loaders(B, T)
    b = mixture(two, [0.9, 0.1], val_weights=[0.5, 0.5]).loaders(B, T)
    even = mixture(two, [0.5, 0.5]).loaders(B, T)
    assert not torch.equal(take(a[0], 10)[0], take(b[0], 10)[0])  # the train rows differ
    n = even[1].batches_remaining()
    assert a[1].batches_remaining() == b[1].batches_remaining() == n > 0
    rows = take(even[1], n)[0]
    assert torch.equal(take(a[1], n)[0], rows) and torch.equal(take(b[1], n)[0], rows)


@pytest.mark.parametrize("accum", [1, 2])
def test_train_loss_per_source_is_its_rows_mean_loss_and_together_they_give_the_loss(two, tmp_path, accum):
    """train/<source>/loss in each train event: at step 1 the mean cross-entropy of that source's rows under the
    initial weights (computed here apart, with F.cross_entropy); at every step the sources' figures weighted by
    their token counts give back the update's loss; a source with no row in an update has no figure in its event."""
    import copy

    import torch.nn.functional as F

    from helpers.trainer import make_trainer, smoke

    data = mixture(two, [0.25, 0.75], seed=1)  # its first 8 rows: 2 of web, 6 of code
    model = smoke(data.vocab_size)
    initial = copy.deepcopy(model)
    trainer = make_trainer(tmp_path / "run", data, model, batch_size=8, max_steps=3, gradient_accumulation_steps=accum)
    trainer.fit()
    train = [e for e in read_metrics(tmp_path / "run" / "metrics.jsonl") if e["event"] == "train"]
    assert [e["step"] for e in train] == [1, 2, 3]

    reference, _ = data.loaders(8, 16)
    for event in train:
        batches = [reference.next_batch() for _ in range(accum)]
        sources = torch.cat([reference.sources_of(reference.batches - accum + i) for i in range(accum)])
        counts = torch.bincount(sources, minlength=2).double()
        assert [f"train/{name}/loss" in event for name in ("web", "code")] == (counts > 0).tolist()
        per_source = torch.tensor([event.get(f"train/{name}/loss", 0.0) for name in ("web", "code")]).double()
        assert (per_source * counts).sum().item() / counts.sum().item() == pytest.approx(event["loss"], rel=1e-6)
        if event["step"] == 1:
            x, y = torch.cat([b.inputs for b in batches]), torch.cat([b.targets for b in batches])
            with torch.no_grad():
                logits, _ = initial(x)
                rows = F.cross_entropy(logits.transpose(1, 2).float(), y, reduction="none").mean(1)
            assert (counts > 0).all()  # this seed's first update has both
            for i, name in enumerate(["web", "code"]):
                assert event[f"train/{name}/loss"] == pytest.approx(rows[sources == i].mean().item(), rel=1e-6), name
    # near ln(257) at init, yet more than 5x the tolerance above apart (10x at this seed): the check tells the
    # sources apart
    web, code = train[0]["train/web/loss"], train[0]["train/code/loss"]
    assert abs(web - code) > 5 * 1e-6 * max(web, code)
