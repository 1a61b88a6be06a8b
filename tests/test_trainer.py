"""The update loop in-process: targets, accumulation, eval side effects, precision, skipping."""

import functools
import random

import numpy as np
import pytest
import torch

from k3train.checkpoint.checkpointer import load_checkpoint
from k3train.observe.metrics import read_metrics
from k3train.optim.schedule import LRSchedule
from k3train.train.callbacks import Callback, QKClip
from k3train.train.precision import Precision
from k3train.train.trainer import TrainingDiverged

from helpers.tiny_k3 import TINY
from helpers.trainer import WrapsSmoke, make_trainer, sgd, smoke


class Recorder(WrapsSmoke):
    """Records what the trainer feeds the model."""

    def __init__(self, vocab_size):
        super().__init__(vocab_size)
        self.seen = []

    def forward(self, x, targets=None):
        self.seen.append((x.clone(), targets.clone()))
        return self.inner(x, targets)


def test_targets_are_the_next_tokens_of_the_stream(tmp_path, builtin_data):
    model = Recorder(builtin_data.vocab_size)
    trainer = make_trainer(tmp_path, builtin_data, model, max_steps=2)
    trainer.train_step()
    trainer.train_step()
    (x1, y1), (x2, y2) = model.seen
    assert torch.equal(y1[:, :-1], x1[:, 1:]) and torch.equal(y2[:, :-1], x2[:, 1:])
    stream = torch.from_numpy(builtin_data.train.read(0, 2 * 2 * 16 + 1).astype(np.int64))
    assert torch.equal(torch.cat([x1.reshape(-1), x2.reshape(-1)]), stream[:-1])
    assert torch.equal(torch.cat([y1.reshape(-1), y2.reshape(-1)]), stream[1:])


def test_accumulation_of_k_micro_batches_equals_one_big_batch(tmp_path, builtin_data):
    """Stateless model, SGD: k micro-batches of B/k give the same update as one batch of B, to 1e-6."""
    big = smoke(builtin_data.vocab_size)
    small = smoke(builtin_data.vocab_size)
    before = {k: v.clone() for k, v in big.state_dict().items()}
    make_trainer(tmp_path / "a", builtin_data, big, batch_size=4).train_step()
    make_trainer(tmp_path / "b", builtin_data, small, batch_size=1, gradient_accumulation_steps=4).train_step()
    for name, value in big.state_dict().items():
        assert not torch.equal(value, before[name]), f"{name} did not change"
        torch.testing.assert_close(small.state_dict()[name], value, atol=1e-6, rtol=0)


def test_eval_mutates_nothing(tmp_path, builtin_data, capsys):
    model = smoke(builtin_data.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for g in opt.param_groups:
        g["initial_lr"] = g["lr"]
    trainer = make_trainer(tmp_path, builtin_data, model, optimizer=opt)
    trainer.train_step()
    trainer.val_loader.next_batch()  # a non-zero val cursor must survive too

    def snapshot():
        return (
            {k: v.clone() for k, v in model.state_dict().items()},
            {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()},
            trainer.train_loader.state_dict(),
            trainer.val_loader.state_dict(),
            model.training,
        )

    def draws():
        return random.random(), np.random.rand(), torch.rand(3)

    state = snapshot()
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    expected = draws()
    random.setstate(rng[0]), np.random.set_state(rng[1]), torch.set_rng_state(rng[2])
    result = trainer.run_eval()
    assert result["batches"] == 2 and np.isfinite(result["loss"])
    after = snapshot()
    for a, b in zip(state[0].values(), after[0].values()):
        assert torch.equal(a, b)
    for k in state[1]:
        for n in state[1][k]:
            assert torch.equal(state[1][k][n], after[1][k][n])
    assert state[2:] == after[2:]
    got = draws()
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    assert trainer.run_eval()["loss"] == result["loss"]  # the same fixed prefix every time
    # Its line says what it measured (k3train.evaluate reads the whole split by default: another number).
    tokens = result["val_tokens"]
    assert f"val loss {result['loss']:.4f} (the first 2 val batches, {tokens:,} tokens)" in capsys.readouterr().out


class LinearLM(WrapsSmoke):
    """Embedding -> Linear head, so fp16 autocast runs a matmul whose backward overflows at scale 65536."""

    def forward(self, x, targets=None):
        logits, loss = self.inner(x, targets)
        return logits, loss * 1e4  # grad wrt fp16 logits ~ 1e4 * 65536 / (B*T): far past fp16's 65504


def test_fp16_scaler_skips_an_overflowing_update_then_steps(tmp_path, builtin_data):
    model = LinearLM(builtin_data.vocab_size)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = make_trainer(
        tmp_path, builtin_data, model, optimizer=sgd(model, lr=1e-6), precision="fp16", max_consecutive_skips=40
    )
    assert trainer.scaler.is_enabled() and trainer.scaler.get_scale() == 65536.0
    results = [trainer.train_step() for _ in range(40)]
    skipped = [r["skipped"] for r in results]
    assert skipped[0], "a 1e4-scaled loss at scale 65536 must overflow fp16"
    assert not all(skipped), "the scaler must back off until an update goes through"
    first_ok = skipped.index(False)
    assert all(skipped[:first_ok])
    assert trainer.scaler.get_scale() < 65536.0
    assert trainer.state.skipped_updates == sum(skipped) and trainer.state.step == 40 - sum(skipped)
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


def test_precision_rejects_unknown_dtype_and_device():
    with pytest.raises(ValueError, match="precision.dtype"):
        Precision("fp8")
    with pytest.raises(ValueError, match="not supported"):
        Precision("fp32").check_device(torch.device("meta"))


class NaNLM(WrapsSmoke):
    def forward(self, x, targets=None):
        logits, loss = self.inner(x, targets)
        return logits, loss * float("nan")


def test_non_finite_updates_are_skipped_counted_and_stop_the_run(tmp_path, builtin_data):
    model = NaNLM(builtin_data.vocab_size)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = make_trainer(tmp_path, builtin_data, model, max_consecutive_skips=3, max_steps=10)
    with pytest.raises(TrainingDiverged, match="3 non-finite updates in a row"):
        trainer.fit()
    assert trainer.state.skipped_updates == 3 and trainer.state.step == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    events = [e["event"] for e in read_metrics(tmp_path / "metrics.jsonl")]
    assert events.count("skip") == 3


def test_end_of_data_stops_cleanly_at_an_update_boundary(tmp_path, builtin_data):
    model = smoke(builtin_data.vocab_size)
    cfg_tokens = builtin_data.train.num_tokens
    seq = 512
    trainer = make_trainer(
        tmp_path,
        builtin_data,
        model,
        optimizer=sgd(model, lr=1e-3),
        batch_size=64,
        seq_len=seq,
        max_steps=None,
        gradient_accumulation_steps=2,
    )
    expected = (cfg_tokens - 1) // (64 * seq) // 2
    assert trainer.total_steps == expected
    assert trainer.fit() == "end_of_data"
    assert trainer.state.step == expected
    assert trainer.train_loader.state_dict()["cursor"] == expected * 2 * 64 * seq
    events = read_metrics(tmp_path / "metrics.jsonl")
    assert [e["event"] for e in events][-3:] == ["eval", "checkpoint", "end"]
    assert events[-1]["reason"] == "end_of_data"


def test_a_max_steps_beyond_the_data_is_said_before_the_run_starts(tmp_path, builtin_data):
    """train.max_steps past the end of the train split: the plan says where the data ends the run, and why."""
    model = smoke(builtin_data.vocab_size)
    kwargs = dict(optimizer=sgd(model, lr=1e-3), batch_size=64, seq_len=512, gradient_accumulation_steps=2)
    held = (builtin_data.train.num_tokens - 1) // (64 * 512) // 2
    trainer = make_trainer(tmp_path / "far", builtin_data, model, max_steps=held + 30, **kwargs)
    assert trainer.total_steps == held
    assert trainer.plan.data_note() == (
        f"the train split holds {held:,} more updates of this batch (65,536 tokens each): the run ends at step "
        f"{held:,} (end of data), before train.max_steps={held + 30}; the stream never wraps"
    )
    assert make_trainer(tmp_path / "near", builtin_data, model, max_steps=held, **kwargs).plan.data_note() is None


def test_overfit_batch_repeats_the_first_batch_and_memorises_it(tmp_path, builtin_data):
    model = Recorder(builtin_data.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for g in opt.param_groups:
        g["initial_lr"] = g["lr"]
    trainer = make_trainer(tmp_path, builtin_data, model, optimizer=opt, overfit_batch=True, max_steps=60)
    trainer.train_loader.next_batch()  # wherever the cursor is, the fixed batch is the split's first
    results = [trainer.train_step() for _ in range(60)]
    first_x, first_y = model.seen[0]
    stream = torch.from_numpy(builtin_data.train.read(0, 2 * 16 + 1).astype(np.int64))
    assert torch.equal(first_x.reshape(-1), stream[:-1]) and torch.equal(first_y.reshape(-1), stream[1:])
    assert all(torch.equal(x, first_x) and torch.equal(y, first_y) for x, y in model.seen)
    assert trainer.train_loader.state_dict()["cursor"] == 2 * 16  # the stream itself did not move
    assert results[-1]["loss"] < 0.5 * results[0]["loss"]


@pytest.mark.parametrize("tau", [None, 1e-4])  # 1e-4: under any initial max logit, so heads clip
def test_qk_clip_tracking_follows_the_config(tmp_path, builtin_data, tau):
    from k3train.models.k3 import KimiK3

    torch.manual_seed(0)
    fields = {**TINY, "n_layers": 2, "kda_mla_ratio": "1:1", "dense_ffn_dim": 32}
    model = KimiK3.from_fields(**{**fields, "vocab_size": builtin_data.vocab_size})
    callbacks = {"qk_clip": QKClip(tau)} if tau is not None else None
    trainer = make_trainer(tmp_path, builtin_data, model, optimizer=sgd(model, lr=1e-2), callbacks=callbacks)
    trainer.train_step()
    mla = model.layers[1].mixer
    assert mla.track_max_logit is (tau is not None)
    if tau is None:
        assert "qk_clip" not in trainer._diagnostics()
    else:
        figures = trainer._diagnostics()["qk_clip"]
        assert figures["n_clipped"] > 0 and mla.max_logit is None  # measured, clipped, consumed
        assert "qk_clip" not in trainer._diagnostics()  # reported once: the next train event starts afresh


def test_grad_clip_scales_the_update_not_just_the_log(tmp_path, builtin_data):
    """SGD with lr 1: the update is minus the gradient the optimizer saw. With grad_clip=c its global norm is c
    (the logged grad_norm stays the unclipped norm); without clipping it equals the raw gradient's norm."""

    def update_norm(clip):
        model = smoke(builtin_data.vocab_size)
        before = [p.detach().clone() for p in model.parameters()]
        result = make_trainer(tmp_path / str(clip), builtin_data, model, grad_clip=clip).train_step()
        delta = torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters())])
        return delta.norm().item(), result["grad_norm"]

    raw_update, raw_norm = update_norm(None)
    assert raw_update == pytest.approx(raw_norm, rel=1e-5)
    clip = raw_norm / 4  # well under the gradient's norm, so clipping must act
    clipped_update, logged = update_norm(clip)
    assert logged == pytest.approx(raw_norm, rel=1e-6)
    assert clipped_update == pytest.approx(clip, rel=1e-4)


class BlowUpAtStep2(torch.optim.SGD):
    """Its second update multiplies every weight by 1e6: finite, so it is checkpointed, but nothing trains after."""

    def step(self, closure=None):
        super().step(closure)
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p.mul_(1e6)


class OverflowsWhenLarge(NaNLM):
    """Non-finite only once a weight is large."""

    def forward(self, x, targets=None):
        logits, loss = self.inner(x, targets)
        huge = max(p.abs().max() for p in self.parameters()) > 1e3
        return logits, loss * float("inf") if huge else loss


@pytest.mark.parametrize("grad_clip", [None, 1.0])
def test_divergence_right_after_a_checkpoint_puts_the_good_one_back(tmp_path, builtin_data, grad_clip):
    """Step 2 blows the weights up (finite) and is checkpointed; every step after overflows. last.pt must end as
    the step-1 checkpoint, which an update went on from, and the message must say so, advising grad_clip only when
    it is off."""
    model = OverflowsWhenLarge(builtin_data.vocab_size)
    opt = BlowUpAtStep2(model.parameters(), lr=1e-3)
    for g in opt.param_groups:
        g["initial_lr"], g["name"] = g["lr"], "all"
    trainer = make_trainer(
        tmp_path,
        builtin_data,
        model,
        optimizer=opt,
        checkpoint_interval=1,
        max_steps=10,
        max_consecutive_skips=3,
        grad_clip=grad_clip,
    )
    with pytest.raises(TrainingDiverged) as err:
        trainer.fit()
    message = str(err.value)
    assert "3 non-finite updates in a row at step 2" in message
    assert f"{tmp_path / 'last.pt'} is back to the checkpoint before it (step 1)" in message
    assert "kept as diverged_step_0000002.pt" in message
    assert ("enable train.grad_clip" in message) is (grad_clip is None)
    assert "lower optim.lr" in message
    good = load_checkpoint(tmp_path / "last.pt")
    assert good["trainer"]["step"] == 1
    assert max(v.abs().max() for v in good["model"].values()) < 1e3
    assert load_checkpoint(tmp_path / "diverged_step_0000002.pt")["trainer"]["step"] == 2
    assert not (tmp_path / "previous.pt").exists()


def test_a_checkpoint_is_kept_as_previous_only_until_an_update_goes_on_from_the_new_one(tmp_path, builtin_data):
    model = smoke(builtin_data.vocab_size)
    trainer = make_trainer(
        tmp_path, builtin_data, model, optimizer=sgd(model, lr=1e-3), checkpoint_interval=1, max_steps=3
    )
    seen = []
    real_train_step = trainer.train_step

    def train_step():
        seen.append((tmp_path / "previous.pt").exists())
        return real_train_step()

    trainer.train_step = train_step
    assert trainer.fit() == "max_steps"
    assert seen == [False, False, True]  # the step-1 checkpoint is kept from the second save to the next update
    assert not (tmp_path / "previous.pt").exists()  # the finished run keeps only last.pt


def test_a_restored_optimizer_holds_the_scheduled_lr_not_the_configured_peak(tmp_path, builtin_data):
    """A checkpoint written straight after a resume (a signal before the first update) must hold the lr the
    schedule gave the last update, as the checkpoint it came from did."""
    warmup = functools.partial(LRSchedule, decay="cosine", warmup_steps=4, min_lr_ratio=0.1)
    model = smoke(builtin_data.vocab_size)
    first = make_trainer(tmp_path, builtin_data, model, optimizer=sgd(model, lr=1e-3), schedule=warmup, max_steps=8)
    first.train_step()
    first.train_step()
    first.save()
    saved = load_checkpoint(first.checkpointer.path)
    assert saved["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-3 * 2 / 4)  # warmup, update 2 of 4
    model = smoke(builtin_data.vocab_size, seed=1)
    second = make_trainer(tmp_path, builtin_data, model, optimizer=sgd(model, lr=1e-3), schedule=warmup, max_steps=8)
    second.resume(first.checkpointer.path)
    assert second.optimizer.param_groups[0]["lr"] == saved["optimizer"]["param_groups"][0]["lr"]


def test_after_a_resume_from_an_earlier_checkpoint_the_later_last_pt_is_not_kept_as_previous(tmp_path, builtin_data):
    """previous.pt must be a checkpoint this line of training went on from, never the later last.pt of the line
    abandoned by resuming from an earlier step_*.pt."""
    model = smoke(builtin_data.vocab_size)
    first = make_trainer(
        tmp_path, builtin_data, model, optimizer=sgd(model, lr=1e-3), checkpoint_interval=2, keep_last_k=2, max_steps=4
    )
    first.fit()
    model = smoke(builtin_data.vocab_size)
    second = make_trainer(tmp_path, builtin_data, model, optimizer=sgd(model, lr=1e-3), max_steps=4)
    second.resume(tmp_path / "step_0000002.pt")
    second.train_step()
    second.save()
    assert not (tmp_path / "previous.pt").exists()
    assert load_checkpoint(tmp_path / "last.pt")["trainer"]["step"] == 3


class NaNOnSecondCall(WrapsSmoke):
    def __init__(self, vocab_size):
        super().__init__(vocab_size)
        self.calls = 0

    def forward(self, x, targets=None):
        self.calls += 1
        logits, loss = self.inner(x, targets)
        return logits, loss * float("nan") if self.calls == 2 else loss


class RecordingCallback(Callback):
    def __init__(self):
        self.heard = []

    def setup(self, model, optimizer, dims):
        self.heard.append("setup")

    def after_optimizer_step(self, step):
        self.heard.append(("update", step))

    def after_skipped_step(self, step):
        self.heard.append(("skip", step))

    def metrics(self):
        return {"heard": len(self.heard)}


def test_callbacks_hear_every_update_and_skip_and_their_figures_reach_the_train_events(tmp_path, builtin_data):
    model = NaNOnSecondCall(builtin_data.vocab_size)
    recorder = RecordingCallback()
    trainer = make_trainer(
        tmp_path, builtin_data, model, optimizer=sgd(model, lr=1e-3), max_steps=3, callbacks={"recorder": recorder}
    )
    assert trainer.fit() == "max_steps"
    assert recorder.heard == ["setup", ("update", 1), ("skip", 1), ("update", 2), ("update", 3)]
    train = [e for e in read_metrics(tmp_path / "metrics.jsonl") if e["event"] == "train"]
    assert [e["step"] for e in train] == [1, 2, 3]
    assert [e["recorder"]["heard"] for e in train] == [2, 4, 5]


class Counter:
    """A Stateful part a user might add (say, a data-mixing schedule's position)."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_a_checkpoint_holds_the_registered_parts_and_adding_one_is_one_line(tmp_path, builtin_data):
    model = smoke(builtin_data.vocab_size)
    first = make_trainer(tmp_path, builtin_data, model, optimizer=sgd(model, lr=1e-3))
    counter = Counter()
    first.checkpointer.add("counter", counter)
    first.train_step()
    counter.n = 7
    first.save()
    saved = load_checkpoint(tmp_path / "last.pt")
    assert set(saved) == {
        "meta",
        "model",
        "optimizer",
        "scaler",
        "train_loader",
        "val_loader",
        "rng",
        "trainer",
        "plan",
        "guard",
        "counter",
    }
    assert saved["meta"]["step"] == 1 and saved["counter"] == {"n": 7}

    model = smoke(builtin_data.vocab_size, seed=1)
    second = make_trainer(tmp_path, builtin_data, model, optimizer=sgd(model, lr=1e-3))
    restored = Counter()
    second.checkpointer.add("counter", restored)
    second.resume(tmp_path / "last.pt")
    assert restored.n == 7 and second.state.step == 1
    assert second.train_loader.state_dict() == first.train_loader.state_dict()
    for a, b in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)

    # the guard is an optional part: a checkpoint written before it existed resumes, its window starting empty
    del saved["guard"]
    torch.save(saved, tmp_path / "older.pt")
    model = smoke(builtin_data.vocab_size, seed=2)
    third = make_trainer(tmp_path, builtin_data, model, optimizer=sgd(model, lr=1e-3))
    third.checkpointer.add("counter", Counter())
    third.resume(tmp_path / "older.pt")
    assert third.state.step == 1
