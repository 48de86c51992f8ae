"""Machine metrics for heartbeats: CPU, memory, disk and load (from /proc, no dependencies)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class Sample:
    cpu_percent: float
    memory_used_bytes: int
    memory_total_bytes: int
    disk_used_bytes: int
    disk_total_bytes: int
    load1: float
    load5: float
    load15: float


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies since boot."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()[1:]
    except OSError:
        return 0, 0
    values = [int(p) for p in parts]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return idle, sum(values[:8])


def _memory() -> tuple[int, int]:
    total = available = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                elif line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                if total and available:
                    break
    except OSError:
        pass
    return total - available, total


class SysInfo:
    def __init__(self, disk_path: str = "/") -> None:
        self._disk_path = disk_path
        self._prev = _cpu_times()

    def sample(self) -> Sample:
        idle, total = _cpu_times()
        d_idle, d_total = idle - self._prev[0], total - self._prev[1]
        self._prev = (idle, total)
        cpu = 100.0 * (1 - d_idle / d_total) if d_total > 0 else 0.0
        used, mem_total = _memory()
        try:
            st = os.statvfs(self._disk_path)
            disk_total = st.f_blocks * st.f_frsize
            disk_used = (st.f_blocks - st.f_bfree) * st.f_frsize
        except OSError:
            disk_total = disk_used = 0
        try:
            load1, load5, load15 = os.getloadavg()
        except OSError:
            load1 = load5 = load15 = 0.0
        return Sample(
            cpu_percent=max(0.0, min(100.0, cpu)),
            memory_used_bytes=max(0, used),
            memory_total_bytes=mem_total,
            disk_used_bytes=disk_used,
            disk_total_bytes=disk_total,
            load1=load1,
            load5=load5,
            load15=load15,
        )
