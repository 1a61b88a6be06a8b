"""CPU runtime choices, made once at start-up: OpenMP's wait policy, the thread count, which dtype is fast, denormal
flushing and malloc's handling of freed memory.

`configure_openmp()` must run before `import torch` (OpenMP reads its wait policy when it loads; every CLI calls it
through k3train/runtime/bootstrap.py, which first keeps the thread variables as the user set them:
`record_thread_environment()`). `choose_threads()` takes train.cpu_threads=N, else (auto) the count the user set in
OMP_NUM_THREADS or MKL_NUM_THREADS, else divides the CPUs this process may use (affinity, cgroup quota,
SLURM_CPUS_PER_TASK) among the local jobs its launcher says run at once; during training
k3train/train/cpu_threads.py gives threads up while other processes use those CPUs (`cpu_busy_seconds`,
`own_cpu_seconds`). `prepare_cpu_training()` flushes denormals and keeps freed memory before the first step.
`cpu_runtime()` is run.json's record of all of it. Why each choice is made, with the measurements behind it:
docs/decisions/cpu-runtime.md.
"""

from __future__ import annotations

import math
import os
import platform
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

OMP_WAIT_POLICY = "PASSIVE"
# Training: OpenMP's threads spin this many rounds (~30 ms) for the next parallel region before they sleep
# (libgomp's GOMP_SPINCOUNT; its own default is 300,000, OMP_WAIT_POLICY=ACTIVE 30 billion).
GOMP_SPINCOUNT = "3000000"
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
PROC = Path("/proc")
# Set in each job of a local sweep (conf/hydra/launcher/local.yaml): how many of its jobs run at once.
LOCAL_JOBS_VARIABLE = "K3TRAIN_LOCAL_JOBS"
PROC_STAT = PROC / "stat"


def configure_openmp(spin: bool = False) -> str:
    """Choose how OpenMP's idle threads wait, unless the user chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT set); returns
    the setting in effect (openmp_setting()).

    spin=True (training): threads spin ~30 ms before they sleep when the CPUs are free now (other processes used
    under a quarter of one over 0.2 s of /proc/stat), else OMP_WAIT_POLICY=PASSIVE (threads sleep at once), as
    everywhere else and where the load cannot be seen. Only how threads wait changes, never how many there are, so
    the numbers a run computes do not depend on the choice (a resumed run stays bitwise the uninterrupted one).
    Call before `import torch`: once OpenMP is loaded the variables are never read again, so a later change would
    only make the environment lie about what runs (then they are left alone and reported as they are).
    """
    if "torch" not in sys.modules and not any(name in os.environ for name in OPENMP_VARIABLES):
        if spin and (others := others_busy(0.2)) is not None and others < 0.25:
            os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT
        else:
            os.environ["OMP_WAIT_POLICY"] = OMP_WAIT_POLICY
    return openmp_setting()


def others_busy(seconds: float) -> float | None:
    """CPUs of this process's affinity that other processes kept busy over `seconds` (this one is idle meanwhile);
    None where /proc/stat cannot be read."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    start, own = cpu_busy_seconds(cpus), own_cpu_seconds()
    if start is None:
        return None
    time.sleep(seconds)
    end = cpu_busy_seconds(cpus)
    return None if end is None else max(0.0, (end - start - (own_cpu_seconds() - own)) / seconds)


def openmp_setting() -> str:
    """The OpenMP wait variables this process runs with, as `NAME=value` ("default" when none is set)."""
    return ", ".join(f"{name}={os.environ[name]}" for name in OPENMP_VARIABLES if name in os.environ) or "default"


def cpu_busy_seconds(cpus: Iterable[int], stat: Path = PROC_STAT) -> float | None:
    """Seconds the given CPUs have spent running anything (any process, the kernel, or, in a VM, another guest:
    steal) since boot, from /proc/stat; None where it cannot be read (not Linux, a CPU it does not list)."""
    try:
        lines = {line.split(maxsplit=1)[0]: line.split()[1:] for line in stat.read_text().splitlines()}
        ticks = 0
        for cpu in cpus:
            # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user and nice]
            fields = [int(x) for x in lines[f"cpu{cpu}"][:8]]
            ticks += sum(fields) - fields[3] - fields[4]
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, KeyError, ValueError, IndexError):
        return None


def own_cpu_seconds() -> float:
    """CPU seconds this process (all its threads) has used, user and system."""
    times = os.times()
    return times.user + times.system


# ---- memory ---------------------------------------------------------------------------------------------------
# mallopt options (glibc's malloc.h) and the values keep_freed_memory() sets: blocks up to 32 MiB (the largest
# threshold glibc accepts) come from the heap instead of their own mapping, and freed memory stays in the process
# (trimmed only past 2 GiB free at the heap's top; the heap grows 256 MiB at a time).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MALLOC_OPTIONS = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 2**31 - 1, M_TOP_PAD: 256 << 20}
_malloc_setting = "not configured"


# What return_freed_memory() sets instead, for a process whose resident peak is the measurement (a dry run): a
# fixed mmap threshold of 64 KiB (glibc otherwise raises it to the largest block freed, after which such blocks come
# from the heap and stay resident when freed) and trimming past 128 KiB, so resident memory follows what is held.
RETURN_OPTIONS = {M_MMAP_THRESHOLD: 64 << 10, M_TRIM_THRESHOLD: 128 << 10, M_TOP_PAD: 0}


def keep_freed_memory() -> str:
    """Have glibc's malloc keep freed memory for reuse (see the module docstring); returns what was done.

    Left alone where the user tuned malloc already (MALLOC_* variables or GLIBC_TUNABLES) or where the C library
    is not glibc. Takes effect for later allocations: callable any time.
    """
    return _set_malloc(MALLOC_OPTIONS, "keeps freed memory for reuse (mmap threshold 32 MiB, no trimming below 2 GiB)")


def return_freed_memory() -> str:
    """Have glibc's malloc return freed blocks of 64 KiB or more to the system at once (RETURN_OPTIONS), so that the
    process's resident memory is what it holds; returns what was done (as keep_freed_memory)."""
    return _set_malloc(RETURN_OPTIONS, "returns freed memory (mmap threshold fixed at 64 KiB, trimming past 128 KiB)")


def _set_malloc(options: dict[int, int], says: str) -> str:
    global _malloc_setting
    tuned = sorted(k for k in os.environ if k.startswith("MALLOC_"))
    if tuned or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        _malloc_setting = "as the environment sets it (" + ", ".join(tuned or ["GLIBC_TUNABLES"]) + ")"
    elif platform.libc_ver()[0] != "glibc":
        _malloc_setting = "the C library's default (not glibc)"
    else:
        import ctypes

        libc = ctypes.CDLL(None)
        if all(libc.mallopt(option, value) == 1 for option, value in options.items()):
            _malloc_setting = f"glibc, {says}"
        else:
            _malloc_setting = "glibc's default (mallopt refused the settings)"
    return _malloc_setting


def malloc_setting() -> str:
    """What keep_freed_memory() did in this process ("not configured" before it ran)."""
    return _malloc_setting


# ---- denormals ------------------------------------------------------------------------------------------------
_denormals = "not configured"


def flush_denormals() -> str:
    """Flush denormal floats to zero in this process's CPU arithmetic (torch.set_flush_denormal: x86's FTZ/DAZ,
    Arm's FZ; see the module docstring); returns what was done, as measured.

    The setting is per thread, and torch's OpenMP threads copy it from the main thread when they start: called
    after torch's first parallel op, only the main thread's share of the work flushes. A probe (4 MiB of products
    of normal numbers whose results are denormal, every thread taking a share) tells which happened."""
    global _denormals
    import torch

    if not torch.set_flush_denormal(True):
        _denormals = "kept (this CPU cannot flush them)"
        return _denormals
    # A denormal product of normal numbers: 0 on a flushing thread. Counted by its bits: a float compare would read
    # a denormal as 0 under DAZ.
    probe = torch.full((1 << 20,), 1e-30) * 1e-10
    kept = int(torch.count_nonzero(probe.view(torch.int32)))
    _denormals = (
        "flushed to zero"
        if kept == 0
        else (
            f"flushed on the main thread only ({kept / probe.numel():.0%} of the probe kept them): torch's threads "
            "started before flush_denormals() ran"
        )
    )
    return _denormals


def denormal_setting() -> str:
    """What flush_denormals() did in this process ("not configured" before it ran)."""
    return _denormals


def prepare_cpu_training(keep_freed: bool = True) -> dict[str, str]:
    """What a CPU training run sets up before its first torch op that runs in parallel: malloc keeps freed memory
    (unless not `keep_freed`: then it returns it, for a process whose resident peak is the measurement), denormals
    flush (on every thread only if no parallel op ran yet). Returns {"malloc", "denormals"}: what was done.
    build_parts calls it; so do the benchmarks, to time what training runs."""
    malloc = keep_freed_memory() if keep_freed else return_freed_memory()
    return {"malloc": malloc, "denormals": flush_denormals()}


# ---- threads --------------------------------------------------------------------------------------------------
# torch's intra-op thread count when nothing sets it: MKL_NUM_THREADS if it holds a positive count, else
# OMP_NUM_THREADS (aten/src/ATen/ParallelCommon.cpp, intraop_default_num_threads); first here wins.
THREAD_VARIABLES = ("MKL_NUM_THREADS", "OMP_NUM_THREADS")
_thread_environment_at_start: dict[str, str] | None = None


def record_thread_environment() -> None:
    """Keep THREAD_VARIABLES as this process started with them (bootstrap calls it first, before k3train's start-up
    changes the environment), so that a value k3train sets for OpenMP or for its children is never mistaken for the
    user's. Only the first call records."""
    global _thread_environment_at_start
    if _thread_environment_at_start is None:
        _thread_environment_at_start = {name: os.environ[name] for name in THREAD_VARIABLES if name in os.environ}


def thread_environment() -> dict[str, str]:
    """THREAD_VARIABLES as the user set them: bootstrap's record, or the environment now where no CLI recorded it
    (k3train used as a library, a launcher's worker process)."""
    if _thread_environment_at_start is not None:
        return dict(_thread_environment_at_start)
    return {name: os.environ[name] for name in THREAD_VARIABLES if name in os.environ}


def environment_threads() -> tuple[int | None, str]:
    """The intra-op thread count the user set in the environment, read as torch reads it -> (count, "NAME=value"), or
    (None, why any value set is not used: not a positive count, or torchrun's default; "" where none is set)."""
    ignored = []
    for name, value in thread_environment().items():
        count = re.match(r"\s*\+?(\d+)", value)  # as std::stoi reads it: "4,2" (a nested-levels list) is 4
        if count is None or int(count[1]) < 1:
            ignored.append(f"{name}={value} not used: not a positive count")
        elif name == "OMP_NUM_THREADS" and set_by_torchrun(value):
            ignored.append(f"OMP_NUM_THREADS={value} not used: torchrun's default for several processes per node")
        else:
            return int(count[1]), f"{name}={value}"
    return None, "; ".join(ignored)


def set_by_torchrun(omp_num_threads: str) -> bool:
    """Whether OMP_NUM_THREADS here is torchrun's default rather than the user's.

    torchrun sets OMP_NUM_THREADS=1 for its workers when it starts more than one process per node and its own
    environment has none (torch/distributed/run.py), and says so only in a warning. The environment torchrun itself
    started with tells which: /proc/<pid>/environ is a process's environment as it was exec'd, without what it set
    itself later. torchrun is the nearest ancestor whose environment lacks TORCHELASTIC_RUN_ID (it gives that to its
    workers, and to anything they start, such as a shell script between it and Python). Where that cannot be read
    (not Linux, another user's process), a 1 under torchrun is taken for its default: train.cpu_threads=1 or
    MKL_NUM_THREADS=1 asks for one thread there without doubt."""
    local_world = os.environ.get("LOCAL_WORLD_SIZE", "")
    several_per_node = local_world.isdigit() and int(local_world) > 1
    if omp_num_threads != "1" or "TORCHELASTIC_RUN_ID" not in os.environ or not several_per_node:
        return False
    launcher_environment = torchrun_start_environment()
    return launcher_environment is None or "OMP_NUM_THREADS" not in launcher_environment


def torchrun_start_environment(proc: Path = PROC, max_depth: int = 8) -> dict[str, str] | None:
    """The environment of the torchrun that started this process, as torchrun was started (set_by_torchrun); None
    where it cannot be read."""
    pid = os.getpid()
    for _ in range(max_depth):
        pid = _parent_pid(pid, proc)
        environment = _start_environment(pid, proc) if pid else None
        if environment is None:
            return None
        if "TORCHELASTIC_RUN_ID" not in environment:
            return environment
    return None


def _parent_pid(pid: int, proc: Path) -> int | None:
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _start_environment(pid: int, proc: Path) -> dict[str, str] | None:
    try:
        entries = (proc / str(pid) / "environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this container's cgroup in CPUs (v2 cpu.max or v1 cfs quota/period); None: no quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "150000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())  # v1: -1 means no quota
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus() -> tuple[int, str]:
    """CPUs this process may run on: its affinity mask, capped by a cgroup quota and SLURM_CPUS_PER_TASK."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    why = [f"{count} CPUs in this process's affinity"]
    quota = cgroup_cpu_limit()
    if quota is not None and math.ceil(quota) < count:
        count = max(1, math.ceil(quota))
        why.append(f"cgroup quota {quota:g} CPUs")
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and 0 < int(slurm) < count:
        count = int(slurm)
        why.append(f"SLURM_CPUS_PER_TASK={slurm}")
    return count, ", ".join(why)


def local_jobs(launcher: dict | None = None) -> tuple[int, str]:
    """How many processes share this machine's CPUs by design, as the launcher states it: torchrun's
    LOCAL_WORLD_SIZE, the local sweep preset's K3TRAIN_LOCAL_JOBS (conf/hydra/launcher/local.yaml sets it in each
    job, conf/config.yaml makes it the sweeper's batch: the jobs submitit starts at once), or in a multirun the
    launcher config's `n_jobs` (jobs run at once, joblib's convention: -1 = one per CPU). launcher: the Hydra
    launcher's config in a multirun, None otherwise. Any other sharing (a test runner's workers, say) is the
    caller's to state with train.cpu_threads."""
    local_world = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local_world.isdigit() and int(local_world) > 1:
        return int(local_world), f"torchrun LOCAL_WORLD_SIZE={local_world}"
    sweep_jobs = os.environ.get(LOCAL_JOBS_VARIABLE, "")
    if sweep_jobs.isdigit() and int(sweep_jobs) > 1:
        return int(sweep_jobs), f"{LOCAL_JOBS_VARIABLE}={sweep_jobs} (local sweep jobs at once)"
    n_jobs = (launcher or {}).get("n_jobs")
    if n_jobs is not None:
        n_jobs = int(n_jobs)
        n = n_jobs if n_jobs > 0 else max(1, (os.cpu_count() or 1) + 1 + n_jobs)
        return n, f"launcher n_jobs={n_jobs}"
    return 1, ""


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str
    omp_wait_policy: str

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return f"{self.threads} threads ({self.reason}), OpenMP: {self.omp_wait_policy}"


def choose_threads(setting: str | int, launcher: dict | None = None) -> ThreadChoice:
    """train.cpu_threads -> the intra-op thread count and why. First that applies:

    N         N threads, whatever the environment says (the reason names the variable it overrides);
    adaptive  the usable CPUs divided among the local jobs, where the load-following count starts (the environment's
              count is not used: adaptive threads are themselves the choice);
    auto      the count the user set in MKL_NUM_THREADS or OMP_NUM_THREADS (environment_threads: as torch reads
              them; torchrun's own default is not the user's), else the usable CPUs divided among the local jobs.
    """
    policy = openmp_setting()
    from_environment, environment_why = environment_threads()
    if str(setting) not in ("auto", "adaptive"):
        over = f", over {environment_why} in the environment" if from_environment is not None else ""
        return ThreadChoice(parse_threads(setting), "train.cpu_threads" + over, policy)
    if str(setting) == "auto" and from_environment is not None:
        return ThreadChoice(from_environment, f"{environment_why} in the environment", policy)
    if from_environment is not None:
        environment_why = f"{environment_why} in the environment not used: train.cpu_threads=adaptive"
    cpus, why = usable_cpus()
    why = f"{setting}: {why}"
    per_task = (launcher or {}).get("cpus_per_task")  # submitit's launchers: the CPUs each job asked for
    if per_task:
        threads, why = max(1, min(cpus, int(per_task))), f"{why}; launcher cpus_per_task={per_task}"
    else:
        jobs, jobs_why = local_jobs(launcher)
        threads, why = max(1, cpus // jobs), why + (f"; shared by {jobs_why}" if jobs > 1 else "")
    return ThreadChoice(threads, why + (f"; {environment_why}" if environment_why else ""), policy)


def parse_threads(setting: str | int) -> int:
    text = str(setting)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"train.cpu_threads={setting} must be auto or a positive number of threads")
    return int(text)


def apply_threads(choice: ThreadChoice) -> None:
    import torch

    torch.set_num_threads(choice.threads)  # intra-op; takes effect at the next parallel region


# ---- dtypes ---------------------------------------------------------------------------------------------------
def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.split(":")[0].strip() in ("flags", "Features"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bf16 in hardware: AVX512-BF16 or AMX (x86), the BF16 extension (Arm)."""
    import torch

    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(torch.cpu, probe, None)
        if fn is not None and fn():
            return True
    flags = _cpu_flags()
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def native_bf16(device) -> bool:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_native_bf16()


def matmul_slowdown(dtype, n: int = 256, rounds: int = 10, budget_s: float = 0.5) -> float:
    """Time of an [n, n] @ [n, n] CPU matmul in `dtype` over its time in fp32: the best of up to `rounds` each,
    interleaved so that load from other processes hits both alike, within about `budget_s` (one bf16 call takes
    ~0.1 s on a CPU without native bf16, so it gets fewer rounds there; the ratio is large enough not to need them)."""
    import torch

    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    inputs = {torch.float32: a, dtype: a.to(dtype)}
    best = {d: math.inf for d in inputs}
    start = time.perf_counter()
    for i in range(rounds + 1):  # round 0 warms up kernels and caches
        for d, x in inputs.items():
            t0 = time.perf_counter()
            x @ x
            if i:
                best[d] = min(best[d], time.perf_counter() - t0)
        if i and time.perf_counter() - start > budget_s:
            break
    return best[dtype] / best[torch.float32]


def cpu_description() -> dict:
    """What a reader needs beside CPU timings: the CPU model, torch's SIMD level, native bf16, load average."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": model,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": cpu_has_native_bf16(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def cpu_runtime(choice: ThreadChoice) -> dict:
    """run.json's record of the CPU choices: threads and why, the wait policy, malloc, denormals, the CPU they were
    made for."""
    return {**choice.as_dict(), "malloc": malloc_setting(), "denormals": denormal_setting(), **cpu_description()}
