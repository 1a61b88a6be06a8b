"""The guard (k3train/train/guard.py) in one process: the detector's statistics, the refusals, a held-back update
that leaves the run as if its batch had never been served, and a rewind that equals a run resumed from the same
checkpoint with the same data passed over. Spikes are caused (guard.inject_at: random-token batches), not mocked."""

import math

import pytest
import torch

from k3train.observe.metrics import read_metrics
from k3train.train.guard import Guard, SpikeDetector
from k3train.train.trainer import TrainingDiverged

from helpers.config import built_run, fit_k3

GUARDED = ("train.max_steps=40", "guard.warmup=8", "guard.window=16")
SPIKE = 30  # the step whose update gets random tokens: the loss has fallen from 5.5 to about 2 by then


def _fit(monkeypatch, run_dir, data, *overrides, resume=None):
    return fit_k3(monkeypatch, run_dir, data, *GUARDED, *overrides, resume=resume)


def _events(run_dir, name):
    return [e for e in read_metrics(run_dir / "metrics.jsonl") if e["event"] == name]


def _assert_same_state(a, b):
    """The model (its buffers, the MoE bias, included) and the optimizer state, bit for bit."""
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for name, value in sa.items():
        assert torch.equal(value, sb[name]), name
    oa, ob = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert oa.keys() == ob.keys()
    for i, state in oa.items():
        for key, value in state.items():
            assert torch.equal(value, ob[i][key]) if torch.is_tensor(value) else value == ob[i][key], (i, key)
    assert a.state.step == b.state.step


# ---- the detector -------------------------------------------------------------------------------------------------
def test_the_detector_judges_by_median_and_mad_after_its_warmup():
    detector = SpikeDetector(window=8, warmup=4, thresholds={"loss": 6.0})
    for value in (2.0, 2.1, 1.9):
        detector.add({"loss": value})
    assert detector.judge(3, {"loss": 100.0}) is None  # 3 figures: still warming up
    detector.add({"loss": 2.05})
    # median 2.025; deviations 0.125, 0.025, 0.025, 0.075: MAD 0.05
    scale = 1.4826 * 0.05
    assert detector.judge(4, {"loss": 2.025 + 5.9 * scale}) is None
    spike = detector.judge(4, {"loss": 2.025 + 6.1 * scale})
    assert spike is not None and math.isclose(spike.tripped["loss"]["sigmas"], 6.1, rel_tol=1e-9)
    assert math.isclose(spike.tripped["loss"]["median"], 2.025) and spike.step == 4
    assert detector.judge(4, {"loss": -50.0}) is None  # only upward deviations


def test_one_outlier_in_the_window_moves_neither_median_nor_scale():
    detector = SpikeDetector(window=16, warmup=4, thresholds={"loss": 6.0})
    for value in (2.0, 2.1, 1.9, 2.0, 2.1, 1.9, 2.0, 2.1, 1.9, 500.0):
        detector.add({"loss": value})
    spike = detector.judge(10, {"loss": 3.0})
    assert spike is not None and spike.tripped["loss"]["median"] == 2.0


def test_a_window_of_equal_values_uses_a_thousandth_of_the_median_as_its_scale():
    detector = SpikeDetector(window=8, warmup=2, thresholds={"grad_norm": 6.0})
    for _ in range(4):
        detector.add({"grad_norm": 1.0})
    assert detector.judge(4, {"grad_norm": 1.005}) is None
    assert detector.judge(4, {"grad_norm": 1.007}) is not None


def test_the_window_survives_a_checkpoint():
    a = Guard(mode="skip", window=4, warmup=2)
    for value in (1.0, 2.0, 3.0, 4.0, 5.0):
        a.applied(value, value, None)
    b = Guard(mode="skip", window=4, warmup=2)
    b.load_state_dict(a.state_dict())
    assert list(b.detector.figures["loss"]) == [2.0, 3.0, 4.0, 5.0]
    assert b.judge(5, 20.0, 1.0) is not None and a.judge(5, 20.0, 1.0) is not None
    assert b.judge(5, 5.0, 1.0) is None


@pytest.mark.parametrize(
    "settings, says",
    [
        ({"window": 10, "warmup": 20}, "guard.window=10 is shorter than guard.warmup=20"),
        ({"loss_threshold": 0.0}, "guard.loss_threshold=0.0 must be > 0"),
        ({"grad_norm_threshold": -1.0}, "guard.grad_norm_threshold=-1.0 must be > 0"),
        ({"mode": "rollback"}, "guard.mode='rollback' is not one of off, warn, skip, rewind"),
        ({"inject_at": [-1]}, "guard.inject_at=[-1]: steps are >= 0"),
    ],
)
def test_bad_settings_are_refused_naming_them(settings, says):
    with pytest.raises(ValueError, match=r"^" + says.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        Guard(**settings)


def test_rewind_without_checkpoints_is_refused_before_anything_is_built(monkeypatch, tmp_path, tiny_data_dir):
    with pytest.raises(ValueError, match="guard=rewind returns to a checkpoint and train.checkpoint_interval=0"):
        built_run(monkeypatch, tmp_path, tiny_data_dir, "guard=rewind", "train.checkpoint_interval=0")


# ---- skip -----------------------------------------------------------------------------------------------------------
def test_a_skipped_spike_equals_a_run_whose_loader_never_served_its_batch(monkeypatch, tmp_path, tiny_data_dir):
    """guard=skip with a random-token batch at step 30 against guard.drop_at=[30] (that batch drawn and dropped,
    never trained on): model, MoE bias, Muon and AdamW state bit for bit. Without putting back the bias and RNG the
    update's forward moved, they differ (checked when this test was written)."""
    skipped = _fit(monkeypatch, tmp_path / "skip", tiny_data_dir, "guard=skip", f"guard.inject_at=[{SPIKE}]")
    dropped = _fit(monkeypatch, tmp_path / "drop", tiny_data_dir, "guard=skip", f"guard.drop_at=[{SPIKE}]")
    spikes, skips = _events(tmp_path / "skip", "spike"), _events(tmp_path / "skip", "skip")
    assert [(e["step"], e["action"]) for e in spikes] == [(SPIKE, "skipped")]
    assert [(e["step"], e["reason"]) for e in skips] == [(SPIKE, "spike")]
    assert spikes[0]["tripped"]["grad_norm"]["threshold"] == 6.0
    assert not _events(tmp_path / "drop", "spike")
    _assert_same_state(skipped, dropped)


def test_warn_applies_the_spike_and_says_so(monkeypatch, tmp_path, tiny_data_dir):
    warned = _fit(monkeypatch, tmp_path, tiny_data_dir, "guard=warn", f"guard.inject_at=[{SPIKE}]")
    assert [(e["step"], e["action"]) for e in _events(tmp_path, "spike")] == [(SPIKE, "applied")]
    assert not _events(tmp_path, "skip") and warned.state.step == 40


# ---- rewind ---------------------------------------------------------------------------------------------------------
REWIND = ["guard=rewind", "train.checkpoint_interval=5", "guard.good_after=3", "train.keep_last_k=10"]


def test_a_rewind_equals_a_run_resumed_from_that_checkpoint_with_that_data_passed_over(
    monkeypatch, tmp_path, tiny_data_dir
):
    """The spike's update is attempted at step 30, just after the step-30 checkpoint (not yet good: no update went
    on from it), so the rewind returns to step 25's. The data of the updates attempted at 25..30 (6 of them) and
    rewind_margin=2 more are passed over. A run resumed from step_0000025.pt with those 8 updates' batches dropped
    ends bit for bit where the rewound run does."""
    run = tmp_path / "rewound"
    rewound = _fit(monkeypatch, run, tiny_data_dir, *REWIND, "guard.rewind_margin=2", f"guard.inject_at=[{SPIKE}]")
    [rewind] = _events(run, "rewind")
    assert (rewind["step"], rewind["to"], rewind["rewinds"], rewind["margin_updates"]) == (SPIKE, 25, 1, 2)
    assert [e["action"] for e in _events(run, "spike")] == ["rewind"]
    assert (run / "last_good.pt").exists()
    drops = ",".join([str(25)] * 8)
    resumed = _fit(
        monkeypatch,
        tmp_path / "resumed",
        tiny_data_dir,
        *REWIND,
        f"guard.drop_at=[{drops}]",
        resume=run / "step_0000025.pt",
    )
    assert not _events(tmp_path / "resumed", "spike")
    _assert_same_state(rewound, resumed)


def test_spikes_past_max_rewinds_stop_the_run(monkeypatch, tmp_path, tiny_data_dir):
    with pytest.raises(TrainingDiverged, match="after the 1 rewind\\(s\\) guard.max_rewinds allows"):
        _fit(monkeypatch, tmp_path, tiny_data_dir, *REWIND, "guard.max_rewinds=1", "guard.inject_at=[30,33]")
    assert [e["to"] for e in _events(tmp_path, "rewind")] == [25]
    assert _events(tmp_path, "end")[-1]["reason"] == "rewinds_exhausted"


def test_a_spike_before_any_good_checkpoint_is_skipped(monkeypatch, tmp_path, tiny_data_dir):
    trainer = _fit(
        monkeypatch,
        tmp_path,
        tiny_data_dir,
        "guard=rewind",
        "train.checkpoint_interval=100",
        f"guard.inject_at=[{SPIKE}]",
    )
    assert not _events(tmp_path, "rewind") and [e["step"] for e in _events(tmp_path, "skip")] == [SPIKE]
    assert trainer.state.step == 40
