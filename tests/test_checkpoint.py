import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from k3train.checkpoint.checkpointer import (
    FORMAT_VERSION,
    Checkpointer,
    CheckpointError,
    check_compatible,
    keep_last,
    load_checkpoint,
    save_checkpoint,
)


def payload(value: float) -> dict:
    return {"meta": {"format_version": FORMAT_VERSION}, "model": {"w": torch.full((4,), value)}}


def test_round_trip_and_no_temp_files_left(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(path, payload(1.0))
    save_checkpoint(path, payload(2.0))
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.full((4,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_truncated_checkpoint_gives_clear_error(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(path, payload(1.0))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated, corrupt"):
        load_checkpoint(path)


def test_missing_and_foreign_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")
    torch.save({"weights": torch.zeros(1)}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a k3train checkpoint"):
        load_checkpoint(tmp_path / "foreign.pt")
    torch.save({"meta": {"format_version": 999}}, tmp_path / "future.pt")
    with pytest.raises(CheckpointError, match="format version 999"):
        load_checkpoint(tmp_path / "future.pt")


def test_loading_never_runs_code_from_the_file(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    path = tmp_path / "evil.pt"
    torch.save({"meta": {"format_version": FORMAT_VERSION}, "x": Evil()}, path)
    with pytest.raises(CheckpointError):
        load_checkpoint(path)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow
def test_kill_between_write_and_rename_leaves_previous_checkpoint(tmp_path):
    """A process killed after writing the temp file but before the rename: last.pt is still the old one."""
    path = tmp_path / "last.pt"
    save_checkpoint(path, payload(1.0))
    script = textwrap.dedent(f"""
        import os, signal, torch
        from k3train.checkpoint import checkpointer as checkpoint
        def die(src, dst):
            os.kill(os.getpid(), signal.SIGKILL)
        checkpoint.os.replace = die
        checkpoint.save_checkpoint({str(path)!r}, {{"meta": {{"format_version": {FORMAT_VERSION}}},
                                                    "model": {{"w": torch.full((4,), 2.0)}}}})
    """)
    proc = subprocess.run([sys.executable, "-c", script])
    assert proc.returncode == -9
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.full((4,), 1.0))


def test_compatibility_names_each_mismatch(tmp_path):
    saved = {
        "model_config": {"d_model": 64, "n_layers": 2},
        "recipe": {"batch_size": 8},
        "optimizer_layout": {"adamw": "3 tensors"},
        "data": {"fingerprint": "abc"},
    }
    check_compatible(saved, saved, tmp_path / "x.pt")
    current = {**saved, "model_config": {"d_model": 128, "n_layers": 2}, "data": {"fingerprint": "def"}}
    with pytest.raises(CheckpointError) as err:
        check_compatible(saved, current, tmp_path / "x.pt")
    assert "d_model was 64, now 128" in str(err.value) and "fingerprint was 'abc', now 'def'" in str(err.value)
    assert "n_layers" not in str(err.value)


def test_keep_last_k(tmp_path):
    ckpt = tmp_path / "last.pt"
    for step in (10, 20, 30):
        save_checkpoint(ckpt, payload(float(step)))
        keep_last(tmp_path, ckpt, step, k=2)
    assert sorted(p.name for p in tmp_path.glob("step_*.pt")) == ["step_0000020.pt", "step_0000030.pt"]
    assert torch.equal(load_checkpoint(tmp_path / "step_0000020.pt")["model"]["w"], torch.full((4,), 20.0))


class Box:
    def __init__(self, value=0.0):
        self.value = value

    def state_dict(self):
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state):
        self.value = state["value"].item()


def test_checkpointer_saves_and_restores_its_named_parts(tmp_path):
    writer = Checkpointer(tmp_path, meta={"data": {"fingerprint": "abc"}})
    writer.add("a", Box(1.0))
    writer.add("b", Box(2.0))
    assert writer.save(step=5) > 0 and writer.saved_step == 5
    reader = Checkpointer(tmp_path, meta={"data": {"fingerprint": "abc"}})
    a, b = Box(), Box()
    reader.add("a", a)
    reader.add("b", b)
    assert reader.load(tmp_path / "last.pt") == 5
    assert (a.value, b.value) == (1.0, 2.0) and reader.saved_step == 5


def test_checkpointer_refuses_a_part_it_cannot_save_and_a_checkpoint_lacking_one(tmp_path):
    ckpt = Checkpointer(tmp_path, meta={})
    with pytest.raises(TypeError, match="state_dict"):
        ckpt.add("x", object())
    ckpt.add("a", Box(1.0))
    with pytest.raises(ValueError, match="already added"):
        ckpt.add("a", Box())
    ckpt.save(step=1)
    later = Checkpointer(tmp_path, meta={})
    later.add("a", Box())
    later.add("sampler", Box())
    with pytest.raises(CheckpointError, match="lacks sampler"):
        later.load(tmp_path / "last.pt")


def test_checkpointer_refuses_a_mismatched_run_before_touching_any_part(tmp_path):
    ckpt = Checkpointer(tmp_path, meta={"data": {"fingerprint": "abc"}})
    ckpt.add("a", Box(1.0))
    ckpt.save(step=1)
    other = Checkpointer(tmp_path, meta={"data": {"fingerprint": "xyz"}})
    box = Box(3.0)
    other.add("a", box)
    with pytest.raises(CheckpointError, match="fingerprint was 'abc', now 'xyz'"):
        other.load(tmp_path / "last.pt")
    assert box.value == 3.0


def test_a_version_1_checkpoint_is_refused_as_older(tmp_path):
    torch.save({"meta": {"format_version": 1}, "model": {}}, tmp_path / "old.pt")
    with pytest.raises(CheckpointError, match="written by an older k3train"):
        load_checkpoint(tmp_path / "old.pt")


# A checkpoint holding code: unpickling it would run a shell command that creates a file. os.system pickles as
# posix.system (nt.system on Windows): the global each refusal must name.
SYSTEM = f"{os.system.__module__}.system"
REPO = Path(__file__).resolve().parents[1]


class RunsCommand:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.marker}",))


def plant_code(tmp_path: Path, where: str) -> tuple[Path, Path]:
    """(the checkpoint to open, the file in it that holds the code)."""
    evil = RunsCommand(tmp_path / "pwned")
    meta = {"format_version": FORMAT_VERSION, "step": 1}
    if where == "torch.save file":  # a zip whose data.pkl names the global with GLOBAL (protocol 2)
        torch.save({"meta": meta, "model": {"w": evil}}, tmp_path / "evil.pt")
        return tmp_path / "evil.pt", tmp_path / "evil.pt"
    if where == "plain pickle file":  # protocol 4+: STACK_GLOBAL, which torch's unpickler does not even parse
        (tmp_path / "evil.pt").write_bytes(pickle.dumps({"meta": evil}))
        return tmp_path / "evil.pt", tmp_path / "evil.pt"
    directory = tmp_path / "evil.dcp"
    directory.mkdir()
    if where == "sharded extra.pt":
        torch.save({"meta": meta, "trainer": evil}, directory / "extra.pt")
        return directory, directory / "extra.pt"
    assert where == "sharded .metadata"  # read by dcp.py's own unpickler, not torch.load
    torch.save({"meta": meta}, directory / "extra.pt")
    (directory / ".metadata").write_bytes(pickle.dumps(evil))
    return directory, directory / ".metadata"


def assert_refused_naming_the_code(message: str, file: Path) -> None:
    assert "holds code" in message and SYSTEM in message and str(file) in message, message
    assert "weights_only=False" not in message and "weights_only" not in message, message
    assert "Traceback" not in message and len(message.strip().splitlines()) == 1, message


WHERE = ["torch.save file", "plain pickle file", "sharded extra.pt", "sharded .metadata"]


@pytest.mark.parametrize("where", WHERE)
def test_a_checkpoint_holding_code_is_refused_in_one_line_naming_the_global(tmp_path, where):
    source, file = plant_code(tmp_path, where)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(source)
    assert_refused_naming_the_code(str(err.value), file)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("where", ["torch.save file", "sharded .metadata"])
def test_export_and_evaluate_refuse_a_checkpoint_holding_code(tmp_path, capsys, where):
    from k3train import evaluate, export

    source, file = plant_code(tmp_path, where)
    assert export.main([str(source), str(tmp_path / "export")]) == 2
    assert evaluate.main([str(source), "--device", "cpu"]) == 2
    for line in capsys.readouterr().err.splitlines():
        assert line.startswith(("k3train.export: error: ", "k3train.evaluate: error: ")), line
        assert_refused_naming_the_code(line, file)
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "export").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, where",
    [
        ("k3train.generate", "torch.save file"),
        ("k3train.generate", "plain pickle file"),
        ("k3train.consolidate", "sharded extra.pt"),
        ("k3train.consolidate", "sharded .metadata"),
    ],
)
def test_clis_refuse_a_checkpoint_holding_code(tmp_path, module, where):
    source, file = plant_code(tmp_path, where)
    extra = ["--prompt", "hi", "--device", "cpu"] if module == "k3train.generate" else []
    proc = subprocess.run(
        [sys.executable, "-m", module, str(source), *extra], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"{module}: error: checkpoint "), proc.stderr
    assert_refused_naming_the_code(proc.stderr, file)
    assert not (tmp_path / "pwned").exists()


def test_a_corrupt_checkpoint_is_not_answered_with_advice_to_load_it_unsafely(tmp_path):
    path = tmp_path / "last.pt"
    path.write_bytes(bytes(range(256)) * 64)  # not a zip: torch's weights-only unpickler reads it, and fails
    with pytest.raises(CheckpointError, match="cannot be read") as err:
        load_checkpoint(path)
    assert "weights_only" not in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)


def test_a_checkpoint_older_than_a_model_field_resumes_with_its_default_and_refuses_another_value() -> None:
    """A checkpoint written before Kimi K3's fields existed holds none of them: it resumes into the config whose
    fields are at their defaults (kimi_linear_tiny with model.kda_output_gate_bias=null, the behaviour it was trained
    with: its low-rank gate had a bias), and kimi_linear_tiny as it is now (no bias, as transformers' kimi_linear)
    or a K3-shaped config is refused, naming each field that differs."""
    import dataclasses

    from omegaconf import OmegaConf

    from k3train.checkpoint.checkpointer import check_compatible
    from k3train.models.k3.config import KimiK3Config

    from helpers.config import model_config

    def meta(name: str, **overrides) -> dict:
        fields = {k: v for k, v in OmegaConf.to_container(model_config(name)).items() if k != "_target_"}
        config = KimiK3Config(**{**fields, "vocab_size": 257, **overrides})
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        return {"model_config": dataclasses.asdict(config), "model_config_defaults": defaults}

    k3_fields = {"attn_res_block_size", "ffn_activation", "expert_latent_dim", "mla_output_gate", "kda_output_gate"}
    older = meta("kimi_linear_tiny")
    later = ("situ_beta", "situ_linear_beta", "mla_latent_norm_eps", "kda_gate_lower_bound", "kda_output_gate_bias")
    for name in (*k3_fields, *later):
        older["model_config"].pop(name)
    older.pop("model_config_defaults")
    check_compatible(older, meta("kimi_linear_tiny", kda_output_gate_bias=None), Path("old.pt"))
    with pytest.raises(CheckpointError, match="model config: kda_output_gate_bias was None, now False"):
        check_compatible(older, meta("kimi_linear_tiny"), Path("old.pt"))
    with pytest.raises(CheckpointError) as refused:
        check_compatible(older, meta("k3_tiny"), Path("old.pt"))
    message = str(refused.value)
    assert "\n" not in message and message.count("model config: ") == 1  # one line, the model one item of it
    shown, named = message.split("model config: ")[1].split("; and ")
    assert all(name in shown or name in named.split(" (")[0].split(", ") for name in k3_fields)
    assert shown.count(" was ") == 4  # the first fields with their values, the rest by name
