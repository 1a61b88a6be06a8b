"""An in-process Trainer on a prepared dataset, and the smoke model wrapped as a test's own LanguageModel
(test_trainer.py, test_mfu.py)."""

import functools

import torch

from k3train.checkpoint.checkpointer import Checkpointer
from k3train.config import TrainConfig
from k3train.models.smoke import SmokeTestConfig, SmokeTestLM
from k3train.observe.metrics import MetricsLogger
from k3train.optim.schedule import LRSchedule
from k3train.train.precision import Precision
from k3train.train.step import DataParallelStep
from k3train.train.trainer import Loaders, Trainer


def sgd(model, lr=1.0):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for g in opt.param_groups:
        g["initial_lr"], g["name"] = g["lr"], "all"
    return opt


CONSTANT = functools.partial(LRSchedule, decay="constant", warmup_steps=0, min_lr_ratio=1.0)


def make_trainer(tmp_path, data, model, optimizer=None, precision="fp32", schedule=CONSTANT, callbacks=None, **train):
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = TrainConfig(
        **{
            "batch_size": 2,
            "seq_len": 16,
            "max_steps": 4,
            "eval_interval": 0,
            "eval_batches": 2,
            "checkpoint_interval": 0,
            "log_interval": 1,
            "progress": "lines",
            "grad_clip": None,
            **train,
        }
    )
    train_loader, val_loader = data.loaders(cfg.batch_size, cfg.seq_len)
    return Trainer(
        step=DataParallelStep(model, Precision(precision), torch.device("cpu")),
        optimizer=optimizer or sgd(model),
        schedule_factory=schedule,
        loaders=Loaders(train_loader, val_loader),
        config=cfg,
        metrics=MetricsLogger(tmp_path / "metrics.jsonl"),
        checkpointer=Checkpointer(tmp_path, meta={}, keep_last_k=cfg.keep_last_k),
        callbacks=callbacks,
    )


def smoke(vocab_size, seed=0):
    torch.manual_seed(seed)
    return SmokeTestLM(SmokeTestConfig(vocab_size=vocab_size, d_model=16))


class WrapsSmoke(torch.nn.Module):
    """A test model around SmokeTestLM that keeps its LanguageModel members (k3train/models/protocol.py)."""

    log_label = ""

    def __init__(self, vocab_size):
        super().__init__()
        self.inner = smoke(vocab_size)
        self.config = self.inner.config

    def forward(self, x, targets=None):
        return self.inner(x, targets)

    def check_data(self, vocab_size, seq_len):
        self.inner.check_data(vocab_size, seq_len)

    def diagnostics(self):
        return {}

    def param_counts(self):
        return self.inner.param_counts()
