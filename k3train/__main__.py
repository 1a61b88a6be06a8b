"""`python -m k3train [overrides]`: compose the config with Hydra and hand it to the runner. Nothing else."""

from k3train.runtime.bootstrap import bootstrap

bootstrap(training=True)  # before torch loads (runtime/bootstrap.py)

import contextlib
import logging
import os
import signal
import sys

import hydra
from omegaconf import DictConfig

from k3train.config import register_configs, register_plugins
from k3train.run.override_keys import unknown_key_error
from k3train.run.remembered import remember_run_overrides
from k3train.runtime import distributed, signals
from k3train.runtime.console import notice

register_configs()
register_plugins()
_composed = False  # Hydra composed a config and called the task: a SystemExit(1) before that is a config error


@hydra.main(version_base="1.3", config_path="pkg://k3train.conf", config_name="config")
def compose_and_run(cfg: DictConfig) -> None:
    global _composed
    _composed = True
    from k3train.run.runner import run

    try:
        run(cfg)
    except Exception as exc:  # Hydra prints it; first say which rank this is (every rank's stderr is the job's)
        line = distributed.failure_line(exc, distributed.current_world())
        if line:
            print(line, file=sys.stderr, flush=True)
        if line and distributed.lost_peer(exc) and os.environ.get("HYDRA_FULL_ERROR") != "1":
            sys.exit(1)  # the rank that ended first says what went wrong; this one's traceback is gloo's internals
        raise


def main() -> None:
    signals.imports_done()  # a Ctrl-C from here on is this function's to report
    # Before Hydra: every rank must resolve the same run directory (rank 0's start time, see distributed.py).
    try:
        world = distributed.init_from_env()
    except distributed.LaunchError as exc:  # before Hydra: nothing is written yet
        print(f"k3train: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    # a resume composes its run's own overrides first, so the keys given now are checked against its config groups
    sys.argv, remembered = remember_run_overrides(sys.argv, world.size)
    problem = unknown_key_error(sys.argv)  # one line, before Hydra's advice to append a misspelt key with +
    if problem:
        notice(f"error: {problem}")  # every rank refuses the same key: said once where they share stderr
        sys.exit(2)
    if remembered is not None and world.is_main:
        print(remembered.describe(), flush=True)
    if not world.is_main:
        sys.argv.append("hydra.output_subdir=null")  # rank 0 alone writes .hydra/ (and everything else)
        sys.stdout = open(os.devnull, "w")  # one summary and progress display per run; errors still reach stderr
    try:
        compose_and_run()
    except BaseException as exc:
        distributed.close(wait_for_others=False)  # another rank may be inside a collective this one never joins
        if isinstance(exc, BrokenPipeError) and not _composed:  # `--help | head`: the reader took what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the flush at exit raises again
            sys.exit(0)
        if isinstance(exc, SystemExit):
            # 2: Hydra reported a config it could not compose (unknown key, wrong type): bad input
            status = 2 if exc.code == 1 and not _composed else exc.code
            if world.distributed and (status is None or isinstance(status, int)):
                _end_rank(status or 0)
            if status != exc.code:
                sys.exit(status)
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C outside the training loop (which stops at an update)
            print("k3train: interrupted by Ctrl-C; checkpoints already written are kept", file=sys.stderr, flush=True)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)  # end by the signal, as a shell expects of Ctrl-C
        raise
    distributed.close(wait_for_others=True)


def _end_rank(status: int) -> None:
    """End a rank that stops early (its one line said why) without Python's finalization: a gloo thread still
    releasing a collective's tensors meets it and aborts the process with "terminate called without an active
    exception" (pytorch/pytorch#190489), a second line and a core's status instead of this one."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can be said on it
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
