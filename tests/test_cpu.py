"""CPU runtime choices (k3train/runtime/cpu.py): usable CPUs, each local job's share, train.cpu_threads, OpenMP's
wait policy, and the first update's feedback; through the CLI, what run.json records."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from k3train.config import TrainConfig
from k3train.observe.progress import Progress, format_duration
from k3train.runtime import cpu
from k3train.runtime.bootstrap import bootstrap

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # the intra-op counts torch reads from the environment


@pytest.fixture
def clean_env(no_thread_environment: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch = no_thread_environment
    for name in ("LOCAL_WORLD_SIZE", "PYTEST_XDIST_WORKER_COUNT", "SLURM_CPUS_PER_TASK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr(cpu, "cgroup_cpu_limit", lambda: None)
    return monkeypatch


def test_cgroup_quota_v2_and_v1(tmp_path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu.cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu.cgroup_cpu_limit(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu.cgroup_cpu_limit(v1) == 2.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu.cgroup_cpu_limit(v1) is None
    assert cpu.cgroup_cpu_limit(tmp_path / "absent") is None


def test_usable_cpus_follow_affinity_quota_and_slurm(clean_env) -> None:
    assert cpu.usable_cpus()[0] == 8  # the affinity mask, not os.cpu_count()
    clean_env.setattr(cpu, "cgroup_cpu_limit", lambda: 2.5)
    count, why = cpu.usable_cpus()
    assert count == 3 and "cgroup quota 2.5" in why
    clean_env.setenv("SLURM_CPUS_PER_TASK", "2")
    assert cpu.usable_cpus()[0] == 2


def test_auto_threads_share_the_cpus_among_local_jobs(clean_env) -> None:
    assert cpu.choose_threads("auto").threads == 8
    clean_env.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun --nproc_per_node=4
    choice = cpu.choose_threads("auto")
    assert choice.threads == 2 and "LOCAL_WORLD_SIZE=4" in choice.reason
    clean_env.delenv("LOCAL_WORLD_SIZE")
    # A test runner's workers are not the product's business: the caller states train.cpu_threads.
    clean_env.setenv("PYTEST_XDIST_WORKER_COUNT", "16")
    assert cpu.choose_threads("auto").threads == 8
    # The launcher's config says how many jobs run at once (n_jobs) or what each asked for (cpus_per_task),
    # whatever the launcher's class is called.
    joblib = {"_target_": "some.parallel.Launcher", "n_jobs": 2}
    assert cpu.choose_threads("auto", joblib).threads == 4
    submitit = {"_target_": "another.Launcher", "cpus_per_task": 3}
    assert cpu.choose_threads("auto", submitit).threads == 3
    assert cpu.choose_threads("auto", {"_target_": "hydra...joblib...", "cpus_per_task": None}).threads == 8
    # an explicit count wins over everything
    assert cpu.choose_threads("5", joblib) == cpu.ThreadChoice(5, "train.cpu_threads", cpu.openmp_setting())


def test_auto_threads_follow_a_count_the_user_set_in_the_environment_as_torch_reads_it(clean_env) -> None:
    clean_env.setenv("OMP_NUM_THREADS", "1")
    assert cpu.choose_threads("auto") == cpu.ThreadChoice(
        1, "OMP_NUM_THREADS=1 in the environment", cpu.openmp_setting()
    )
    clean_env.setenv("LOCAL_WORLD_SIZE", "4")  # the user's count is per process already: not divided again
    assert cpu.choose_threads("auto").threads == 1
    clean_env.setenv("OMP_NUM_THREADS", "4,2")  # OpenMP's list, one count per nesting level: torch takes the first
    assert cpu.choose_threads("auto").threads == 4
    clean_env.setenv("MKL_NUM_THREADS", "3")  # torch's order: MKL_NUM_THREADS before OMP_NUM_THREADS
    assert cpu.choose_threads("auto").reason == "MKL_NUM_THREADS=3 in the environment"
    clean_env.setenv("MKL_NUM_THREADS", "0")  # not a positive count: torch ignores it, and so does auto
    assert cpu.choose_threads("auto").reason == "OMP_NUM_THREADS=4,2 in the environment"
    clean_env.delenv("LOCAL_WORLD_SIZE")
    clean_env.setenv("OMP_NUM_THREADS", "many")
    assert cpu.choose_threads("auto") == cpu.ThreadChoice(
        8,
        "auto: 8 CPUs in this process's affinity; MKL_NUM_THREADS=0 not used: not a positive count; "
        "OMP_NUM_THREADS=many not used: not a positive count",
        cpu.openmp_setting(),
    )


def test_an_explicit_cpu_threads_and_adaptive_win_over_the_environment_and_say_so(clean_env) -> None:
    clean_env.setenv("OMP_NUM_THREADS", "1")
    choice = cpu.choose_threads("5")
    assert (choice.threads, choice.reason) == (5, "train.cpu_threads, over OMP_NUM_THREADS=1 in the environment")
    adaptive = cpu.choose_threads("adaptive")
    assert adaptive.threads == 8 and adaptive.reason == (
        "adaptive: 8 CPUs in this process's affinity; "
        "OMP_NUM_THREADS=1 in the environment not used: train.cpu_threads=adaptive"
    )


def test_only_the_thread_counts_the_process_started_with_are_the_users(clean_env) -> None:
    clean_env.setenv("OMP_NUM_THREADS", "2")
    bootstrap()  # what every CLI does first; then start-up may set the variables for OpenMP or for children
    clean_env.setenv("OMP_NUM_THREADS", "1")
    clean_env.setenv("MKL_NUM_THREADS", "1")
    assert cpu.choose_threads("auto").reason == "OMP_NUM_THREADS=2 in the environment"
    clean_env.setattr(cpu, "_thread_environment_at_start", None)
    clean_env.delenv("OMP_NUM_THREADS")
    clean_env.delenv("MKL_NUM_THREADS")
    bootstrap()
    clean_env.setenv("OMP_NUM_THREADS", "1")
    assert cpu.choose_threads("auto").threads == 8


TORCHRUNS_DEFAULT = "OMP_NUM_THREADS=1 not used: torchrun's default for several processes per node"
RANKS_SHARE = f"auto: 8 CPUs in this process's affinity; shared by torchrun LOCAL_WORLD_SIZE=4; {TORCHRUNS_DEFAULT}"


@pytest.mark.parametrize(
    ("torchrun_started_with", "threads", "reason"),
    [
        ({"PATH": "/bin"}, 2, RANKS_SHARE),
        (None, 2, RANKS_SHARE),
        ({"OMP_NUM_THREADS": "1"}, 1, "OMP_NUM_THREADS=1 in the environment"),
    ],
    ids=["torchrun_set_it", "torchrun_unreadable", "the_user_set_it"],
)
def test_torchruns_default_one_thread_leaves_each_rank_its_share_but_the_users_one_wins(
    clean_env, torchrun_started_with: dict | None, threads: int, reason: str
) -> None:
    """torchrun --nproc-per-node=4 sets OMP_NUM_THREADS=1 for its ranks where its own environment has none."""
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")
    clean_env.setenv("LOCAL_WORLD_SIZE", "4")
    clean_env.setenv("OMP_NUM_THREADS", "1")
    clean_env.setattr(cpu, "torchrun_start_environment", lambda: torchrun_started_with)
    choice = cpu.choose_threads("auto")
    assert (choice.threads, choice.reason) == (threads, reason)
    clean_env.setenv("OMP_NUM_THREADS", "3")  # torchrun only ever sets 1
    assert cpu.choose_threads("auto").threads == 3
    clean_env.setenv("OMP_NUM_THREADS", "1")
    clean_env.setenv("LOCAL_WORLD_SIZE", "1")  # one process per node: torchrun leaves OMP_NUM_THREADS alone
    assert cpu.choose_threads("auto").threads == 1


def test_torchruns_environment_is_the_nearest_ancestors_without_torchelastic_run_id(tmp_path, monkeypatch) -> None:
    def process(pid: int, parent: int, **environment: str) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "status").write_text(f"Name:\tpython\nPPid:\t{parent}\n")
        (tmp_path / str(pid) / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in environment.items()))

    process(30, 1, PATH="/bin")  # torchrun, as it was started (its own later OMP_NUM_THREADS=1 is not in it)
    process(40, 30, TORCHELASTIC_RUN_ID="none", OMP_NUM_THREADS="1")  # a shell script torchrun started
    process(50, 40, TORCHELASTIC_RUN_ID="none", OMP_NUM_THREADS="1")  # this rank
    monkeypatch.setattr(os, "getpid", lambda: 50)
    assert cpu.torchrun_start_environment(tmp_path) == {"PATH": "/bin"}
    (tmp_path / "30" / "environ").unlink()  # another user's process, say
    assert cpu.torchrun_start_environment(tmp_path) is None


def _rank_threads(env: dict[str, str], tmp_path) -> list[dict]:
    """torchrun --nproc-per-node=2 of a script printing each rank's choose_threads("auto")."""
    script = tmp_path / "threads.py"
    script.write_text(  # one write(2) of under PIPE_BUF bytes a rank: the two ranks' lines cannot interleave
        "import json, os\nfrom k3train.runtime.cpu import choose_threads\n"
        "os.write(1, (json.dumps(choose_threads('auto').as_dict()) + '\\n').encode())\n"
    )
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    base = {k: v for k, v in os.environ.items() if k not in (*THREAD_VARIABLES, "LOCAL_WORLD_SIZE")}
    checkout = str(Path(__file__).resolve().parents[1])  # the k3train under test, not whichever is installed
    env = {**base, "PYTHONPATH": os.pathsep.join(filter(None, [checkout, base.get("PYTHONPATH")])), **env}
    proc = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/environ"), reason="torchrun's environment: Linux's /proc")
def test_under_torchrun_only_an_omp_num_threads_the_user_set_counts(tmp_path) -> None:
    ranks = _rank_threads({}, tmp_path)
    assert len(ranks) == 2 and all(TORCHRUNS_DEFAULT in rank["reason"] for rank in ranks), ranks
    assert all("shared by torchrun LOCAL_WORLD_SIZE=2" in rank["reason"] for rank in ranks), ranks
    ranks = _rank_threads({"OMP_NUM_THREADS": "1"}, tmp_path)
    assert [(r["threads"], r["reason"]) for r in ranks] == [(1, "OMP_NUM_THREADS=1 in the environment")] * 2


@pytest.mark.parametrize("bad", ["0", "-2", "many", "1.5"])
def test_bad_cpu_threads_are_refused_naming_the_key(bad: str) -> None:
    with pytest.raises(ValueError, match=rf"^train.cpu_threads={bad} must be auto or a positive number"):
        TrainConfig(cpu_threads=bad)


def _python(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in cpu.OPENMP_VARIABLES}
    return subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()


@pytest.mark.slow
def test_openmp_threads_spin_for_training_sleep_otherwise_unless_chosen_and_only_before_torch() -> None:
    setup = "from k3train.runtime.cpu import configure_openmp; print(configure_openmp({}))"
    assert _python(setup.format("")) == "OMP_WAIT_POLICY=PASSIVE"
    # training: spinning threads on free CPUs, sleeping ones on busy CPUs (the load is measured, so either may come)
    assert _python(setup.format("spin=True")) in ("GOMP_SPINCOUNT=3000000", "OMP_WAIT_POLICY=PASSIVE")
    if cpu.cpu_busy_seconds([0]) is not None:
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.3)
            assert _python(setup.format("spin=True")) == "OMP_WAIT_POLICY=PASSIVE"  # another process holds a CPU
        finally:
            busy.kill()
            busy.wait()
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "10"}):  # the user's choice stands
        name, value = next(iter(chosen.items()))
        assert _python(setup.format("spin=True"), **chosen) == f"{name}={value}"
        assert _python(setup.format(""), **chosen) == f"{name}={value}"
    # after torch (and OpenMP) loaded, setting it would change nothing but the record: it is left alone
    assert _python("import torch; " + setup.format("spin=True")) == "default"


def test_first_update_feedback(capsys: pytest.CaptureFixture) -> None:
    progress = Progress(TrainConfig(progress="lines"), start=10, total=210, label="")
    progress.update(11, loss=3.0, tokens_per_s=100.0)
    progress.update(12, loss=3.0, tokens_per_s=100.0)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("first update took") and out[0].endswith("; 199 more to go")
    assert out[1].startswith("after the warm-up") and "198 more at that pace: ETA" in out[1]  # figures: test_progress
    assert format_duration(90_061) == "25:01:01"


@pytest.mark.slow
def test_cli_records_threads_and_dtype_and_reports_the_first_update(run_cli, tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        "model=k3_tiny",
        "model.d_model=32",
        "model.n_layers=2",
        "model.expert_ffn_dim=16",
        "model.dense_ffn_dim=32",
        "model.kda_chunk_size=16",
        "train.batch_size=2",
        "train.seq_len=32",
        "train.max_steps=2",
        "train.eval_batches=1",
        "train.progress=lines",
        "train.cpu_threads=1",
        "optim.ns_dtype=fp32",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((run_dir / "run.json").read_text())
    env = manifest["environment"]
    assert env["cpu_threads"] == 1 and env["cpu"]["threads"] == 1 and env["cpu"]["reason"] == "train.cpu_threads"
    assert env["cpu"]["omp_wait_policy"] == "OMP_WAIT_POLICY=PASSIVE"  # the suite's (conftest.py), left as set
    assert env["cpu"]["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["cpu"]["denormals"] == "flushed to zero" and "denormals: flushed to zero" in proc.stdout
    muon = [g for g in manifest["optimizer"] if g["kind"] == "muon"]
    assert muon and all(g["ns_dtype"] == "fp32" for g in muon)
    assert "cpu: 1 threads (train.cpu_threads)" in proc.stdout and "ns_dtype=fp32" in proc.stdout
    first = [line for line in proc.stdout.splitlines() if "first update took" in line]
    assert len(first) == 1 and first[0].endswith("; 1 more to go")


@pytest.mark.slow
def test_cli_takes_omp_num_threads_at_auto_and_records_why(run_cli, tmp_path, monkeypatch) -> None:
    """`OMP_NUM_THREADS=1 python -m k3train`: one thread, as a torch user expects; train.cpu_threads=N still wins."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # run_cli's processes get this process's environment
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    tiny = [
        "model=smoke_test_lm",
        "train.batch_size=2",
        "train.seq_len=32",
        "train.max_steps=1",
        "train.eval_batches=1",
    ]
    for setting, threads, reason in (
        ("auto", 1, "OMP_NUM_THREADS=1 in the environment"),
        ("2", 2, "train.cpu_threads, over OMP_NUM_THREADS=1 in the environment"),
    ):
        run_dir = tmp_path / setting
        proc = run_cli(*tiny, f"train.cpu_threads={setting}", f"hydra.run.dir={run_dir}")
        assert proc.returncode == 0, proc.stderr
        env = json.loads((run_dir / "run.json").read_text())["environment"]
        assert (env["cpu"]["threads"], env["cpu"]["reason"], env["cpu_threads"]) == (threads, reason, threads)
        assert f"cpu: {threads} threads ({reason})" in proc.stdout


@pytest.mark.slow
def test_cli_refuses_bad_cpu_threads(run_cli, tmp_path) -> None:
    proc = run_cli("model=smoke_test_lm", "train.cpu_threads=0", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "k3train: error: train.cpu_threads=0 must be auto or a positive number of threads"
    ]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="keep_freed_memory tunes glibc's malloc only")
def test_keep_freed_memory_stops_the_page_faults_of_repeated_steps():
    """Forward + backward of one k3_small-sized MoE layer, again and again: with glibc's defaults every step
    faulted in ~30k fresh pages (its activations and 24 MiB expert gradients); with the setting they are reused."""
    code = textwrap.dedent("""
        import json, resource, torch
        from k3train.models.k3.moe import MoE
        from k3train.runtime.cpu import keep_freed_memory, malloc_setting
        torch.set_num_threads(1)
        torch.manual_seed(0)
        moe, x = MoE(512, 64, 4, 192), torch.randn(2, 1024, 512, requires_grad=True)
        def page_faults_of_one_step():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            moe(x).sum().backward()
            moe.zero_grad(set_to_none=True)
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        default = [page_faults_of_one_step() for _ in range(4)]
        assert malloc_setting() == "not configured"
        setting = keep_freed_memory()
        kept = [page_faults_of_one_step() for _ in range(5)]
        print(json.dumps({"setting": setting, "default": default, "kept": kept}))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    result = json.loads(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    )
    assert result["setting"].startswith("glibc, keeps freed memory"), result
    default, kept = (sum(counts[1:]) / len(counts[1:]) for counts in (result["default"], result["kept"]))
    if default < 5000:
        pytest.skip(f"glibc's defaults already reuse this machine's memory ({default:.0f} page faults per step)")
    # The first step with the setting still grows the heap; an occasional later one faults a few thousand pages.
    assert kept < 0.25 * default, f"page faults per step: {result}"


def test_keep_freed_memory_leaves_a_users_malloc_tuning_alone(monkeypatch):
    monkeypatch.setattr(cpu, "_malloc_setting", cpu.malloc_setting())  # restored afterwards
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # any MALLOC_* variable: the user tunes malloc themselves
    assert cpu.keep_freed_memory() == "as the environment sets it (MALLOC_ARENA_MAX)"
    assert cpu.malloc_setting() == cpu.keep_freed_memory()


@pytest.mark.parametrize("pool_started", [False, True], ids=["before_the_thread_pool", "after_it"])
def test_flush_denormals_reaches_every_thread_only_before_torchs_thread_pool_starts(pool_started):
    """Called before torch's first parallel op (as build_parts is), each of 2 threads' share of an elementwise op
    flushes denormal inputs and results; called after, only the main thread's does, and the setting says so.
    Inputs are made and results counted by their bits: a Python float converts to 0, and a float compare reads a
    denormal as 0, on a flushing thread."""
    code = f"""if True:
        import torch
        torch.set_num_threads(2)
        if {pool_started}:
            torch.full((1 << 22,), 1.0).mul(2)  # a parallel op: torch's OpenMP threads start
        from k3train.runtime.cpu import flush_denormals
        print(flush_denormals())
        denormal = torch.full((1 << 22,), 1 << 20, dtype=torch.int32).view(torch.float32)  # 2^-129, from its bits
        for y in (denormal * 1.0, torch.full((1 << 22,), 1e-30) * 1e-10):  # a denormal input; a denormal result
            print(int((y.view(torch.int32) != 0).sum()))
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    setting, *kept = proc.stdout.splitlines()
    if setting.startswith("kept"):
        pytest.skip(f"this CPU cannot flush denormals: {setting}")
    if not pool_started:
        assert setting == "flushed to zero" and kept == ["0", "0"]
    else:
        assert setting.startswith("flushed on the main thread only (50% of the probe kept them)"), setting
        assert kept == [str(1 << 21)] * 2  # the second thread's half
