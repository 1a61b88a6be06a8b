"""Adding a model, an optimizer and a logger is one Python file plus one YAML file each, as docs/extending.md says.

The files live outside the repository here (PYTHONPATH and hydra.searchpath point at them) so the test cannot
lean on anything but the documented seams: the LanguageModel protocol, the `factory(model)` optimizer target and
the metrics sink protocol.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from k3train.models.protocol import missing_members
from k3train.observe.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FILES = {
    "bigram.py": """
        from dataclasses import dataclass
        from typing import Optional

        import torch
        import torch.nn.functional as F


        @dataclass
        class BigramConfig:
            vocab_size: Optional[int] = None
            max_seq_len: int = 1024


        class BigramLM(torch.nn.Module):
            log_label = ""

            def __init__(self, config):
                super().__init__()
                self.config = config
                self.table = torch.nn.Embedding(config.vocab_size, config.vocab_size)

            @classmethod
            def from_fields(cls, **fields):
                return cls(BigramConfig(**fields))

            def forward(self, x, targets=None):
                logits = self.table(x)
                loss = None if targets is None else F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
                return logits, loss

            def check_data(self, vocab_size, seq_len):
                if vocab_size != self.config.vocab_size or seq_len > self.config.max_seq_len:
                    raise ValueError("set model.vocab_size=null and train.seq_len <= model.max_seq_len")

            def diagnostics(self):
                return {}

            def param_counts(self):
                n = self.table.weight.numel()
                return {"total": n, "active": n, "embedding": n}
        """,
    "conf/model/bigram.yaml": """
        _target_: bigram.BigramLM.from_fields
        vocab_size: null
        max_seq_len: 1024
        """,
    "plain_sgd.py": """
        import torch


        def sgd(model, *, lr, momentum):
            return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        """,
    "conf/optim/sgd.yaml": """
        _target_: plain_sgd.sgd
        _partial_: true
        lr: 0.5
        momentum: 0.9
        """,
    "events_file.py": '''
        import json
        from pathlib import Path


        class EventsFile:
            """Writes each event's name and step to <run_dir>/events.txt."""

            def __init__(self, run_dir):
                self.path = Path(run_dir) / "events.txt"
                self.file = None

            def write(self, record):
                if self.file is None:
                    self.file = open(self.path, "a")
                self.file.write(json.dumps([record["event"], record.get("step")]) + "\\n")

            def close(self):
                if self.file is not None:
                    self.file.close()
        ''',
    "conf/logger/events.yaml": """
        events:
          _target_: events_file.EventsFile
        """,
}


@pytest.mark.slow
def test_a_model_an_optimizer_and_a_logger_each_plug_in_with_one_python_and_one_yaml_file(tmp_path, k3_cache):
    ext = tmp_path / "ext"
    for name, text in FILES.items():
        (ext / name).parent.mkdir(parents=True, exist_ok=True)
        (ext / name).write_text(textwrap.dedent(text).lstrip())
    run_dir = tmp_path / "run"
    env = {**os.environ, "K3TRAIN_CACHE": str(k3_cache), "PYTHONPATH": str(ext)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "k3train",
            "model=bigram",
            "optim=sgd",
            "logger=events",
            f"hydra.searchpath=[file://{ext / 'conf'}]",
            "train.max_steps=4",
            "train.batch_size=2",
            "train.seq_len=32",
            "train.log_interval=2",
            "train.eval_interval=0",
            "train.progress=lines",
            "schedule=warmup_constant",
            "schedule.warmup_steps=0",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "QK-Clip: off" in proc.stdout  # the default callback finds no attention module and says so

    events = read_metrics(run_dir / "metrics.jsonl")
    sink = [json.loads(line) for line in (run_dir / "events.txt").read_text().splitlines()]
    assert sink == [[e["event"], e.get("step")] for e in events]  # the sink saw every event metrics.jsonl got
    train = [e for e in events if e["event"] == "train"]
    assert [e["step"] for e in train] == [2, 4]
    assert train[0]["lr"] == {"0": 0.5}  # a plain torch optimizer's group, named and scheduled by the Trainer
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["model"]["class"] == "BigramLM"
    assert manifest["optimizer"][0]["initial_lr"] == 0.5 and manifest["optimizer"][0]["momentum"] == 0.9
    assert torch.load(run_dir / "last.pt", weights_only=True)["trainer"]["step"] == 4


def test_a_model_without_the_protocol_is_named_with_what_it_lacks():
    assert missing_members(torch.nn.Linear(2, 2)) == [
        "config",
        "log_label",
        "check_data",
        "diagnostics",
        "param_counts",
    ]


class WithoutDegrees:
    """A parallel strategy from before ep, cp, HSDP and pipelines: everything but those."""

    name = "ddp"

    def shard(self, model, device, dims):
        return model

    def wrap(self, model, device, dims):
        return model

    def no_sync(self, module):
        raise AssertionError("never reached")

    def finish_gradients(self, model, dims):
        pass

    def shard_layouts(self, dims):
        return {}


def test_a_parallel_strategy_without_the_protocol_is_refused_by_what_it_lacks(monkeypatch, tmp_path, tiny_data_dir):
    from helpers.config import built_run

    lacks = "ep, cp, dp_replicate, pipeline"
    with pytest.raises(TypeError, match=rf"built a WithoutDegrees, which lacks {lacks}: a strategy implements"):
        built_run(
            monkeypatch,
            tmp_path / "run",
            tiny_data_dir,
            "parallel._target_=test_extensions.WithoutDegrees",
            *("~parallel.bucket_cap_mb", "~parallel.ep", "~parallel.cp"),  # its constructor takes none of them
            *("~parallel.pp", "~parallel.pp_schedule", "~parallel.pp_virtual_stages"),
            *("parallel.pp_microbatches=1", "~parallel.pp_microbatches"),  # Hydra deletes no null value
        )
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
