"""The update loop, and the extension API a user's code builds on:

- Callback: hooks after each update (k3train/train/callbacks.py); conf/callbacks/ lists them by `_target_`.
- MetricsSink: a destination for every metrics event besides metrics.jsonl (k3train/observe/metrics.py).
- Stateful: a part the checkpoint saves and a resume restores (k3train/checkpoint/checkpointer.py).
- ParallelDims: how the run's ranks divide the work, handed to Callback.setup (k3train/runtime/parallel_dims.py).

Everything else in this package is the loop's own: Trainer, evaluation, precision, the DDP/FSDP wrappers, RNG,
counters and the plan of a run.
"""

from k3train.checkpoint.checkpointer import Stateful
from k3train.observe.metrics import MetricsSink
from k3train.runtime.parallel_dims import ParallelDims
from k3train.train.callbacks import Callback

__all__ = ["Callback", "MetricsSink", "ParallelDims", "Stateful"]
