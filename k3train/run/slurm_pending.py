"""hydra/launcher=slurm: say why a job of the sweep does not start, instead of waiting on it without a word.

submitit's SlurmLauncher submits the sweep as a job array, then waits on the results, forever if the request can
never be met (cpus_per_task above what a node has: squeue says PENDING, Reason=PartitionConfig). The slurm preset
adds PendingWatch as a Hydra callback (hydra.callbacks.slurm_pending). Before anything is submitted it refuses, in
one line with exit status 2, a request no node of the partition could ever run (refuse_what_cannot_start: the same
limits as below). Then, for each submission of the sweep, it starts a daemon thread that polls `squeue -h -j <ids>`
every `poll_s` seconds. Once a job has been pending over `warning_s` seconds, it prints once per job and reason (an
array's pending tasks share a line), to stderr, the job id, SLURM's reason and what it means; for a reason that
never clears by itself, the hydra.launcher field to change, the one over the partition's limit (`scontrol show
partition`, `sinfo -N`) where that tells, else the candidates. The thread ends once no job is pending or the sweep
ends.

In: the callback's warning_s and poll_s, and the request in hydra.launcher. Out: lines on stderr; the sweep itself
runs as before. A callback and not a subclass of the launcher, since Hydra instantiates launchers only from the
hydra_plugins package. submitit is imported only when a SLURM sweep starts, so k3train runs without the slurm extra.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

# SLURM's pending reasons (squeue(1), JOB REASON CODES): what they mean, and the hydra.launcher fields that can cause
# the ones that never clear by themselves.
TRANSIENT = {
    "Priority": "jobs of higher priority are ahead of it",
    "Resources": "it waits for resources to free up",
    "BeginTime": "its start time has not come yet",
    "Dependency": "it waits for a job it depends on",
    "JobArrayTaskLimit": "the array's other tasks use up array_parallelism",
    "None": "the scheduler has not looked at it yet",
}
BLOCKING = {
    "PartitionConfig": ("the request exceeds a limit of the partition", None),
    "ReqNodeNotAvail": ("no node that could run it is available", None),
    "Resources": ("it asks for more than any node of the partition has", None),
    "PartitionTimeLimit": ("timeout_min exceeds the partition's MaxTime", ("timeout_min",)),
    "PartitionNodeLimit": ("nodes is outside the partition's node limits", ("nodes",)),
    "PartitionDown": ("the partition is down", ("partition",)),
    "PartitionInactive": ("the partition is inactive", ("partition",)),
    "BadConstraints": ("no node has the requested features", ("constraint",)),
    "InvalidAccount": ("the account is not valid", ("account",)),
    "InvalidQOS": ("the QOS is not valid", ("qos",)),
}
CANDIDATES = ("cpus_per_task", "mem_gb", "gpus_per_node", "nodes", "timeout_min", "partition")


def over_limit(request: Mapping, limits: Mapping) -> list[tuple[str, str]]:
    """The request's fields over the partition's limits, as (field, why). A limit missing or None is unknown."""
    part = limits.get("partition") or "the default partition"
    if limits.get("exists") is False:
        return [("partition", f"there is no partition {part}")]
    found = []
    if limits.get("state") not in (None, "UP"):
        found.append(("partition", f"partition {part} is {limits['state']}"))
    tasks = request.get("tasks_per_node") or 1
    cpus = (request.get("cpus_per_task") or 1) * tasks
    if limits.get("cpus") is not None and cpus > limits["cpus"]:
        asked = f"cpus_per_task {request.get('cpus_per_task')}" + (f" x tasks_per_node {tasks}" if tasks > 1 else "")
        found.append(("cpus_per_task", f"{asked} > the {limits['cpus']} CPUs of the largest node of {part}"))
    mem_gb, mem_mb = request.get("mem_gb"), limits.get("mem_mb")
    if mem_gb and mem_mb is not None and mem_gb * 1024 > mem_mb:
        found.append(("mem_gb", f"mem_gb {mem_gb} > the {mem_mb / 1024:.1f} GB of the largest node of {part}"))
    gpus = request.get("gpus_per_node")
    if gpus and limits.get("gpus") is not None and gpus > limits["gpus"]:
        most = limits["gpus"]
        found.append(("gpus_per_node", f"gpus_per_node {gpus} > the {most} GPUs of the largest node of {part}"))
    nodes = request.get("nodes") or 1
    if limits.get("nodes") is not None and nodes > limits["nodes"]:
        found.append(("nodes", f"nodes {nodes} > the {limits['nodes']} nodes {part} allows"))
    timeout = request.get("timeout_min")
    if timeout and limits.get("max_time_min") is not None and timeout > limits["max_time_min"]:
        found.append(("timeout_min", f"timeout_min {timeout} > the MaxTime of {part}, {limits['max_time_min']} min"))
    return found


def pending_message(job: str, reason: str, request: Mapping, limits: Mapping) -> str:
    """One line for job `job` pending for `reason` (squeue's %i and %r): a note for a transient reason, else what
    blocks it and the hydra.launcher field to change: those over the limit where `limits` (node_limits) tells,
    else the candidates. request: hydra.launcher's cpus_per_task, tasks_per_node, mem_gb, gpus_per_node, nodes,
    timeout_min and partition."""
    code = re.split(r"[,:( ]", reason, maxsplit=1)[0]
    found = over_limit(request, limits)
    if code in TRANSIENT and not (code == "Resources" and found):
        return f"k3train: SLURM job {job} waiting: {reason} ({TRANSIENT[code]})"
    if code not in BLOCKING and not found:
        return f"k3train: SLURM job {job} waiting: {reason} (`man squeue`, JOB REASON CODES, says what it means)"
    meaning, fields = BLOCKING.get(code, ("it may never start", None))
    if found:
        detail = "; ".join(why for _, why in found)
        fields = tuple(dict.fromkeys(field for field, _ in found))
        advice = "Change " + " and ".join(f"hydra.launcher.{f}" for f in fields)
    else:
        detail = "which limit, the partition's settings do not tell"
        advice = "Check " + " / ".join(f"hydra.launcher.{f}" for f in fields or CANDIDATES)
        advice += " against `scontrol show partition` and `sinfo -N -o '%N %c %m %G'`"
    return (
        f"k3train: SLURM job {job} pending: {reason} ({meaning}; it will not start as it is): {detail}. "
        f"{advice}, then `scancel {job.split('_')[0]}` and launch the sweep again"
    )


def _minutes(text: str) -> int | None:
    """SLURM's [days-]hours:minutes:seconds (or minutes) -> minutes; UNLIMITED -> None."""
    if not re.fullmatch(r"(\d+-)?[\d:]+", text):
        return None
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    hours, minutes = (parts + [0, 0])[:2] if len(parts) == 3 else (0, parts[0])
    return int(days or 0) * 1440 + hours * 60 + minutes


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


def node_limits(partition: str | None) -> dict:
    """What over_limit compares with: the partition's limits (scontrol) and its largest node (sinfo)."""
    if not partition:
        names = _run("sinfo", "-h", "-o", "%P").stdout.split()
        partition = next((p[:-1] for p in names if p.endswith("*")), None)
    limits: dict = {"partition": partition}
    if not partition:
        return limits
    shown = _run("scontrol", "show", "partition", partition, "-o")
    if shown.returncode != 0:
        return {**limits, "exists": False} if "not found" in shown.stderr + shown.stdout else limits
    fields = dict(item.split("=", 1) for item in shown.stdout.split() if "=" in item)
    limits["state"] = fields.get("State")
    limits["max_time_min"] = _minutes(fields.get("MaxTime", ""))
    rows = [r.split("|") for r in _run("sinfo", "-h", "-N", "-p", partition, "-o", "%c|%m|%G").stdout.splitlines()]
    rows = [r for r in rows if len(r) == 3 and r[0].isdigit()]
    if rows:
        limits["cpus"] = max(int(r[0]) for r in rows)
        limits["mem_mb"] = max((int(r[1]) for r in rows if r[1].isdigit()), default=None)
        gpus = [sum(int(n) for n in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", r[2])) for r in rows]
        limits["gpus"] = max(gpus)
        limits["nodes"] = len(rows)
    for key, name in (("cpus", "MaxCPUsPerNode"), ("mem_mb", "MaxMemPerNode"), ("nodes", "MaxNodes")):
        if fields.get(name, "").isdigit() and limits.get(key) is not None:
            limits[key] = min(limits[key], int(fields[name]))
    return limits


def _watch(job_ids: list[str], request: dict, warn_after_s: float, poll_s: float, done: threading.Event) -> None:
    """The thread: poll squeue until no job of job_ids is pending or `done` is set; print each new (job, reason)."""
    start, reported, limits = time.monotonic(), set(), None
    arrays = sorted({j.split("_")[0] for j in job_ids})
    while not done.wait(poll_s):
        try:
            out = _run("squeue", "-h", "-j", ",".join(arrays), "-o", "%i|%T|%r")
        except FileNotFoundError:
            return  # no squeue here: the jobs are not SLURM's (a local launcher)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode != 0:
            if "Invalid job id" in out.stderr:
                return  # gone from the queue
            continue
        pending = [line.split("|", 2) for line in out.stdout.splitlines() if line.count("|") >= 2]
        pending = [(job, reason) for job, state, reason in pending if state == "PENDING"]
        if not pending:
            return
        if time.monotonic() - start < warn_after_s:
            continue
        for job, reason in pending:
            key = (job.split("_")[0], reason)
            if key not in reported:
                reported.add(key)
                if limits is None:
                    try:
                        limits = node_limits(request.get("partition"))
                    except (OSError, subprocess.SubprocessError):
                        limits = {}
                print(pending_message(job, reason, request, limits), file=sys.stderr, flush=True)


def refuse_what_cannot_start(request: Mapping) -> None:
    """Before anything is submitted: a request over the partition's limits (its largest node, its MaxTime, a
    partition that does not exist) would pend forever, so the sweep ends here in one line, exit status 2, naming
    the hydra.launcher fields to change. Nothing is checked where sinfo and scontrol do not answer."""
    try:
        limits = node_limits(request.get("partition"))
    except (OSError, subprocess.SubprocessError):
        return
    found = over_limit(request, limits)
    if found:
        why = "; ".join(reason for _, reason in found)
        fields = ", ".join(f"hydra.launcher.{name}" for name in dict(found))
        print(
            f"k3train: error: this SLURM sweep could never start: {why}. Change {fields}; nothing was submitted",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(2)


class PendingWatch(Callback):
    """The Hydra callback that conf/hydra/launcher/slurm.yaml adds as hydra.callbacks.slurm_pending (module
    docstring). warning_s: null turns it off."""

    def __init__(self, warning_s: float | None = 60, poll_s: float = 5) -> None:
        self.warning_s = None if warning_s is None else float(warning_s)
        self.poll_s = float(poll_s)
        self._undo = None

    def __getstate__(self) -> dict:  # pickled into every job with the launcher's HydraContext: no thread state
        return {**self.__dict__, "_undo": None}

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        keys = ("cpus_per_task", "tasks_per_node", "mem_gb", "gpus_per_node", "nodes", "timeout_min", "partition")
        request = {key: config.hydra.launcher.get(key) for key in keys}
        refuse_what_cannot_start(request)
        if self.warning_s is None:
            return
        import submitit  # the launcher imports it too, a moment later: only a SLURM sweep gets here

        # submitit's launcher submits through AutoExecutor.map_array and then blocks on the results, with no hook in
        # between (and Hydra instantiates launchers from hydra_plugins only, so no subclass of it can be named in
        # the preset): wrap map_array for the sweep to start a watch on the jobs each call returns.
        executor, done = submitit.AutoExecutor, threading.Event()
        own, original = "map_array" in vars(executor), executor.map_array

        def map_array(this, fn, *iterable):
            jobs = original(this, fn, *iterable)
            args = ([j.job_id for j in jobs], request, self.warning_s, self.poll_s, done)
            threading.Thread(target=_watch, args=args, name="k3train-slurm-pending", daemon=True).start()
            return jobs

        def undo() -> None:
            done.set()
            if own:
                executor.map_array = original
            else:
                del executor.map_array

        executor.map_array = map_array
        self._undo = undo

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None
