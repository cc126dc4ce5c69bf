"""CPU time from /proc, for benchmarks that report what their processes (and everyone else) used.

Linux only; ticks are os.sysconf("SC_CLK_TCK") per second.
"""

from __future__ import annotations

import os
from pathlib import Path


def ticks_per_second() -> int:
    return os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot, all CPUs (raises OSError without /proc)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    # user nice system idle iowait irq softirq steal (guest time is already inside user): idle and iowait
    # are the idle ones.
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def process_ticks(pid: int) -> int:
    """utime + stime of a process, all its threads; 0 once it has exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    # Fields after the command name (which may hold spaces) start at field 3; utime and stime are 14 and 15.
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])
