"""Running as a SLURM job: which job this is, where its run lives, and how a job stopped by a signal gets requeued.

A job's run directory is named after the job (`runs/slurm-<job id>` or `runs/slurm-<array job>_<task>`), so a
requeued job, which keeps its id, finds its run again; SLURM counts the restarts (SLURM_RESTART_COUNT), and a
restarted job resumes from that directory's last.pt without being told (a first start never resumes: a directory
that already holds a run is refused, as everywhere).

After a signal has stopped the run at an update boundary with a checkpoint, the job must be requeued:
- under submitit (the hydra-submitit-launcher presets), its own handler of the preemption signal (SIGUSR2, or
  SUBMITIT_PREEMPT_SIGNAL) re-pickles the job, requeues it and exits; SIGTERM (`scontrol requeue`, `scancel`,
  preemption) is only logged by submitit, so the job must not then return a result: submitit would report a
  half-done run as a success. It exits without one, and SLURM decides (requeued: it runs again; cancelled: the
  launcher reports it unfinished);
- under plain sbatch, the job requeues itself with `scontrol requeue`, as Lightning's SLURM connector does
  (
  https://github.com/Lightning-AI/pytorch-lightning/blob/bdb96c433d679068a3dbb0757b186f833cb12c94/src/lightning/pytorch/trainer/connectors/signal_connector.py
  ), when
  the job allows it (`--requeue`) and the signal was the time-limit warning (SIGUSR1, SIGUSR2), the time limit
  itself (SIGTERM once the job's run time reaches its limit). Any other SIGTERM is `scancel`, which must stay
  cancelled, `scontrol requeue`, which requeues by itself, or a preemption, which SLURM requeues or cancels as the
  cluster is set up to.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from k3train.runtime.console import notice
from k3train.runtime.distributed import current_world, run_start
from k3train.runtime.signals import StopSignals


@dataclass(frozen=True)
class SlurmJob:
    job_id: str  # SLURM_JOB_ID: every task of an array has its own
    array_job_id: str | None
    array_task_id: str | None
    restart_count: int  # how often SLURM requeued this job
    node_list: str
    submitit: bool  # started by submitit (which handles the preemption signal itself)

    @property
    def name(self) -> str:
        """The id squeue shows and scontrol takes: `1234`, or `1230_4` for task 4 of array job 1230."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    def describe(self) -> dict:
        return asdict(self)


def current_job(env: Mapping[str, str] = os.environ) -> SlurmJob | None:
    """The SLURM job this process runs in, or None outside SLURM."""
    if not env.get("SLURM_JOB_ID"):
        return None
    return SlurmJob(
        job_id=env["SLURM_JOB_ID"],
        array_job_id=env.get("SLURM_ARRAY_JOB_ID"),
        array_task_id=env.get("SLURM_ARRAY_TASK_ID"),
        restart_count=int(env.get("SLURM_RESTART_COUNT") or 0),
        node_list=env.get("SLURM_JOB_NODELIST", ""),
        submitit="SUBMITIT_FOLDER" in env,
    )


def run_name(fmt: str) -> str:
    """The `${run_name:FORMAT}` resolver (hydra.run.dir): `slurm-<job>` in a SLURM job, so a requeued job finds
    its run again; elsewhere the run's start time (rank 0's), strftime-formatted."""
    job = current_job()
    return f"slurm-{job.name}" if job else run_start(fmt)


def resume_setting(resume: str | None) -> str | None:
    """resume as configured, but `auto` for a requeued SLURM job that was not told otherwise."""
    job = current_job()
    return "auto" if resume is None and job is not None and job.restart_count > 0 else resume


# ---- after a signal stopped the run with a checkpoint --------------------------------------------------------------
def submitit_preempt_signal() -> signal.Signals:
    return signal.Signals["SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")]


def end_after_signal(stop: StopSignals) -> None:
    """After a signal stopped the run with a checkpoint: requeue the job (or hand over to who requeues it), then end
    the process the way its launcher expects. Returns only where a launcher expects a normal return (never)."""
    job = current_job()
    if job is None or stop.received == signal.SIGINT:  # Ctrl-C (srun forwards it) is a person's stop: no requeue
        stop.redeliver()  # the default handler ends the process, as the sender expects
        return
    if job.submitit:
        preempt = submitit_preempt_signal()
        if preempt in stop.received_all:
            stop.redeliver(preempt)  # submitit: checkpoint() re-pickles the job, rank 0 requeues it and exits
        # submitit only logs SIGTERM, and other ranks return from its handler: a result now would be "success"
        notice(f"job {job.name} stopped by {stop.received.name}: ending without a result; SLURM requeues or ends it")
        sys.exit(-1)
    if current_world().is_main:
        notice(requeue(job, stop.received))
    stop.redeliver()


def ignore_late_warnings() -> None:
    """In a SLURM job whose run has ended: a time-limit warning (SIGUSR1, SIGUSR2) arriving while the process winds
    down changes nothing, and its default action would turn a finished job into a FAILED one."""
    if current_job() is not None:
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)


def requeue(job: SlurmJob, received: signal.Signals) -> str:
    """Requeue a plain sbatch job stopped by its time-limit warning or its time limit; what happened, in words."""
    info = _job_info(job)
    if info is None:
        return f"job {job.name}: cannot read it with scontrol, not requeued; resubmit it to continue"
    if info.get("Requeue") != "1":
        return f"job {job.name} does not allow requeue (sbatch --requeue): not requeued; resubmit it to continue"
    # A SIGTERM is the time limit only once the job has run that long (JobState says COMPLETING for scancel and the
    # time limit alike); otherwise it is scancel, which must stay cancelled, or scontrol requeue, which needs nothing.
    if received == signal.SIGTERM and not _past_time_limit(info):
        return (
            f"job {job.name} got SIGTERM before its time limit (scancel, scontrol requeue, preemption): not "
            "requeued by k3train"
        )
    result = subprocess.run(["scontrol", "requeue", job.name], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        return f"`scontrol requeue {job.name}` failed: {result.stderr.strip()}; resubmit the job to continue"
    return f"requeued job {job.name}: it resumes from its checkpoint when it runs again"


def _job_info(job: SlurmJob) -> dict[str, str] | None:
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "--oneliner", job.job_id],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _past_time_limit(info: dict[str, str]) -> bool:
    limit, run_time = _seconds(info.get("TimeLimit", "")), _seconds(info.get("RunTime", ""))
    return limit is not None and run_time is not None and run_time >= limit


def _seconds(duration: str) -> int | None:
    """SLURM's [days-]hours:minutes:seconds (or minutes:seconds); None for UNLIMITED and the like."""
    days, _, clock = duration.rpartition("-")
    parts = clock.split(":")
    if not all(p.isdigit() for p in parts) or not 2 <= len(parts) <= 3 or (days and not days.isdigit()):
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return seconds + int(days or 0) * 86400


# ---- the job's output in the run directory ------------------------------------------------------------------------
LOG_NAME = "slurm.log"


class _Tee:
    """A text stream that writes to the stream it replaces and to the run's log file."""

    def __init__(self, stream, log) -> None:
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        self._log.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._log.flush()
        self._stream.flush()

    def __getattr__(self, name: str):  # isatty, fileno, encoding...: the real stream's
        return getattr(self._stream, name)


@contextlib.contextmanager
def job_log(run_dir: Path | None):
    """While entered, a copy of this process's stdout and stderr goes to <run_dir>/slurm.log (appended, one header
    per session), beside SLURM's or submitit's own log file, which lives elsewhere. None: no copy."""
    if run_dir is None:
        yield
        return
    job = current_job()
    with open(Path(run_dir) / LOG_NAME, "a", encoding="utf-8", buffering=1) as log:
        log.write(
            f"==== {time.strftime('%Y-%m-%dT%H:%M:%S%z')} job {job.name if job else '-'} restart "
            f"{job.restart_count if job else '-'} on {socket.gethostname()} (pid {os.getpid()}) ====\n"
        )
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = out, err
