"""metrics.jsonl: a torn last line is repaired on open and skipped by readers; superseded events can be dropped."""

import json

from k3train.observe.metrics import MetricsLogger, read_metrics


def test_a_torn_last_line_is_closed_before_the_next_event_and_counted_by_readers(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"event": "train", "step": 1}) + "\n" + '{"event": "train", "st')  # killed mid-write
    with MetricsLogger(path) as writer:
        writer.log("session", session=1, step=1)
        writer.log("train", step=2)
    events = read_metrics(path)
    assert [(e["event"], e["step"]) for e in events] == [("train", 1), ("session", 1), ("train", 2)]
    assert events.torn == 1
    assert path.read_text().endswith("\n")


def test_an_intact_file_reads_with_nothing_torn(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLogger(path) as writer:
        writer.log("train", step=1)
    with MetricsLogger(path) as writer:  # a second session appends; no blank line inserted
        writer.log("train", step=2)
    assert path.read_text().count("\n") == 2
    events = read_metrics(path)
    assert [e["step"] for e in events] == [1, 2] and events.torn == 0 and isinstance(events, list)


def test_final_only_drops_the_steps_a_resumed_session_redid(tmp_path):
    """Session 0 checkpointed at step 2, logged steps 3 and 4 and was killed; session 1 resumed from step 2."""
    path = tmp_path / "metrics.jsonl"
    with MetricsLogger(path) as writer:
        writer.log("session", session=0, step=0)
        for step in (1, 2, 3, 4):
            writer.log("train", step=step, loss=float(step))
            if step == 2:
                writer.log("checkpoint", step=2)
        writer.log("session", session=1, step=2)
        writer.log("resume", step=2)
        for step in (3, 4, 5):
            writer.log("train", step=step, loss=10.0 + step)
        writer.log("end", step=5, reason="max_steps")
    everything = read_metrics(path)
    assert [e["step"] for e in everything if e["event"] == "train"] == [1, 2, 3, 4, 3, 4, 5]
    final = read_metrics(path, final_only=True)
    train = [(e["step"], e["loss"]) for e in final if e["event"] == "train"]
    assert train == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    assert [e["event"] for e in final].count("session") == 2 and final.torn == 0


def test_final_only_with_a_resume_from_an_earlier_checkpoint_of_a_finished_session(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"event": "session", "step": 0},
        {"event": "train", "step": 1},
        {"event": "train", "step": 2},
        {"event": "end", "step": 2},
        {"event": "session", "step": 4},
        {"event": "train", "step": 5},
        {"event": "session", "step": 1},
        {"event": "train", "step": 2},
    ]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    final = read_metrics(path, final_only=True)
    # session 2 restarted from step 1: session 0's step 2 and end, and all of session 1, were redone or discarded
    assert [(e["event"], e["step"]) for e in final] == [("session", 0), ("train", 1), ("session", 1), ("train", 2)]


def test_final_only_counts_the_steps_after_a_guard_rewind_and_keeps_the_spike_and_the_rewind(tmp_path):
    events = [
        {"event": "session", "session": 0, "step": 0},
        *({"event": "train", "step": s, "loss": 5.0 - s} for s in (1, 2, 3, 4)),
        {"event": "spike", "step": 4, "loss": 9.0},
        {"event": "rewind", "step": 4, "to": 2},
        *({"event": "train", "step": s, "loss": 10.0 + s} for s in (3, 4, 5)),
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    final = read_metrics(path, final_only=True)
    assert [(e["step"], e["loss"]) for e in final if e["event"] == "train"] == [
        (1, 4.0),
        (2, 3.0),
        (3, 13.0),
        (4, 14.0),
        (5, 15.0),
    ]
    assert [e["event"] for e in final if e["event"] in ("spike", "rewind")] == ["spike", "rewind"]
