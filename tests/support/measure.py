"""What every benchmark measures the same way: a process's CPU time and a percentile.

Benchmarks report CPU per operation beside latency (the machine is shared and noisy), so they
read user + system time of the processes they drive from /proc, and pick percentiles by the
nearest-rank rule on sorted samples."""

from __future__ import annotations

import contextlib
import os


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far, in seconds (from /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin_tree(cpus: set[int]) -> None:
    """Pin this process (every thread) to `cpus`; children started from now on inherit it."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


def own_cpu() -> float:
    """User + system CPU time of this process so far, in seconds."""
    t = os.times()
    return t.user + t.system


def pct(values: list[float], p: float) -> float:
    """The `p`-th percentile (0 to 100) of `values` by nearest rank; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]
