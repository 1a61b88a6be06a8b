"""This process's resident memory as the memory benchmarks read it (bench_plan.py, bench_cp.py): now, its peak, and
the peak reset to now, so that each phase of a step can have its own."""

from __future__ import annotations

import os
import resource

MiB = 2**20


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def reset_peak() -> bool:
    """Reset the kernel's high-water mark of this process's resident memory (ru_maxrss follows) to what is resident
    now (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
