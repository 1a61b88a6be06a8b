"""What every command-line entry point does first, before anything imports torch.

    from k3train.runtime.bootstrap import bootstrap
    bootstrap()                      # then the CLI's own imports

OpenMP reads its wait policy once, when torch loads it, so `configure_openmp` (runtime/cpu.py) must come before
`import torch`: training's threads spin, the other commands' sleep. Before anything changes the environment, the
thread counts the user set in it (OMP_NUM_THREADS, MKL_NUM_THREADS) are recorded: train.cpu_threads=auto honours
those, and only those (runtime/cpu.py, `choose_threads`). Training also catches stop signals from the
first moment (runtime/signals.py), so a SIGTERM during start-up stops the run after its first update instead of
killing it without a checkpoint. The CLI modules are exempt from ruff's E402 (imports after code) for this reason
alone (pyproject.toml).
"""

from __future__ import annotations

from k3train.runtime.cpu import configure_openmp, record_thread_environment
from k3train.runtime.signals import catch_early


def bootstrap(training: bool = False) -> None:
    """training=True (`python -m k3train`): OpenMP threads that spin (the trainer adapts them to the CPUs' load) and
    stop signals caught from now on; the other CLIs get sleeping threads."""
    record_thread_environment()
    configure_openmp(spin=training)
    if training:
        catch_early()
