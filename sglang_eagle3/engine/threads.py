"""Threads that fit the cores other processes leave free.

A decode step opens a few hundred parallel regions (every linear, attention and norm kernel), and each ends in a
barrier that waits for all of its threads. When another process holds a core, the OS deschedules one of our threads
for a time slice at a time and every region that straddles it waits: with as many threads as cores, a step beside one
busy process took several times longer than the same step on one thread (measurements in docs/MEASUREMENTS.md).

`ThreadGovernor.update()` runs at step boundaries. Every `interval_s` it reads how much CPU time the other processes
took on the cores this process may run on (/proc/stat minus /proc/self/stat) and sets torch's intra-op threads to the
cores they leave free, between 1 and the count it started with. A change needs two readings in a row that agree, so a
short burst does not flip it. Where /proc cannot be read (not Linux) the governor does nothing.
EAGLE3_ADAPT_THREADS=0 turns it off (the thread count then stays what torch or --threads set).
"""
from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import torch

INTERVAL_S = 0.5          # seconds between readings of /proc
SPARE = 0.4               # cores the others may use before we give one up (noise, kernel threads, a short task)


@dataclass(frozen=True)
class CpuTimes:
    busy_s: float         # non-idle time of the cores we may run on, all processes (steal included)
    self_s: float         # this process's user + system time, all of its threads
    wall_s: float


def read_cpu_times(cpus: Optional[set] = None) -> Optional[CpuTimes]:
    """This instant's CPU-time counters, or None where /proc cannot be read."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            lines = [ln.split() for ln in f if ln.startswith("cpu") and ln[3].isdigit()]
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    busy = 0
    for cols in lines:
        if cpus is None or int(cols[0][3:]) in cpus:
            user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in cols[1:9])
            busy += user + nice + system + irq + softirq + steal
    self_ticks = int(fields[11]) + int(fields[12])          # utime, stime (fields 14 and 15 of proc(5))
    return CpuTimes(busy / tick, self_ticks / tick, time.monotonic())


def allowed_cpus() -> set:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def threads_for(other_cores: float, cores: int, most: int) -> int:
    """Threads to run beside others that use `other_cores` of our `cores`: one fewer per (part of a) core they take
    beyond SPARE, at least 1, at most `most`."""
    taken = max(0, math.ceil(other_cores - SPARE))
    return max(1, min(most, cores - taken))


class ThreadGovernor:
    def __init__(self, most: Optional[int] = None, interval_s: float = INTERVAL_S,
                 reader: Optional[Callable[[], Optional[CpuTimes]]] = None,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        cpus = allowed_cpus()
        self.cores = len(cpus)
        self.most = most or torch.get_num_threads()            # the count the user (or torch) chose
        self.interval_s = interval_s
        self.reader = reader or (lambda: read_cpu_times(cpus))
        self.set_threads = set_threads
        wanted = os.environ.get("EAGLE3_ADAPT_THREADS", "1") != "0" and self.most > 1
        self.threads = self.most
        self.other_cores = 0.0                                  # the last reading
        self._last = self.reader() if wanted else None
        self._pending: Optional[int] = None
        self.available = self._last is not None                 # on, and /proc readable
        self.enabled = self.available                           # a benchmark may switch it off for a comparison

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """Switching it off restores the starting thread count."""
        self._enabled = on
        if not on and self.threads != self.most:
            self.threads, self._pending = self.most, None
            self.set_threads(self.most)

    @contextmanager
    def all_threads(self):
        """Run a block on the starting thread count: the prefill where its many-row products (oneDNN) sum in an
        order that depends on the thread count (TargetModel.prefill_depends_on_threads), so a prompt's tokens would
        otherwise depend on what else runs. The decode and verify steps' kernels, and the widening kernels that serve
        every row count on CPUs without native bf16, split their work by output columns: the same sums on any count."""
        if self.threads == self.most:
            yield
            return
        self.set_threads(self.most)
        try:
            yield
        finally:
            self.set_threads(self.threads)

    def update(self) -> int:
        """Read the counters when interval_s has passed since the last reading; return the thread count in force."""
        if not self.enabled:
            return self.threads
        now = time.monotonic()
        if now - self._last.wall_s < self.interval_s:
            return self.threads
        cur = self.reader()
        if cur is None:
            self.available = self.enabled = False
            return self.threads
        wall = cur.wall_s - self._last.wall_s
        self.other_cores = max(0.0, (cur.busy_s - self._last.busy_s) - (cur.self_s - self._last.self_s)) / wall
        self._last = cur
        want = threads_for(self.other_cores, self.cores, self.most)
        if want == self.threads:
            self._pending = None
        elif want == self._pending:               # two readings in a row agree
            self.threads, self._pending = want, None
            self.set_threads(want)
        else:
            self._pending = want
        return self.threads


_governor: Optional[ThreadGovernor] = None


def governor() -> ThreadGovernor:
    """The process's governor (threads are a process-wide resource): made at first use, with the thread count in
    force then as its most."""
    global _governor
    if _governor is None:
        _governor = ThreadGovernor()
    return _governor
