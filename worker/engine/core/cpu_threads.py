"""How many intra-op threads a CPU engine runs: the CPUs it really has, fewer while other
processes take some of them.

The CPUs it has: its affinity mask (taskset, a cpuset, Kubernetes' static CPU manager) capped by
its cgroup's CPU quota (a container's ``--cpus``, a pod's CPU limit: cgroup v2 ``cpu.max`` or v1
``cpu.cfs_quota_us``, the tightest along the path) rounded up, since a quota stops all of a
group's threads at once and a part of a core is still worth a thread; times the engine's share
when several engines share them (``inflightq up --workers N``). torch's own default counts the
host's cores and ignores the quota.

Fewer while others take CPUs: torch runs each op as a fork-join region over its threads, and every
region waits for its slowest thread. When another process takes one of the cores, the thread that
lost its core holds up every region while its peers spin at the barrier, burning what is left: on
2 cores beside one busy process, 2 threads gave 100 tokens/s where 1 thread gave 275 (and 2 threads
424 on an idle box). So ``ThreadGovernor`` looks, about once a second, at how much of the CPUs
other processes left it (its own CPU time plus the idle time of the CPUs it may run on, from
``/proc/stat``) and runs that many threads, rounded, between 1 and its maximum: fewer at once when
the others take more, more again once two looks in a row find the room."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.engine.core.cgroups import ROOT, binding_dirs

LOOK_EVERY_S = 1.0
RAISE_AFTER_LOOKS = 2  # threads are added back only when this many looks in a row find room for them
# torch's own default (all cores, or OMP_NUM_THREADS), read before any engine changes it: the most
# an adapting engine runs.
TORCH_DEFAULT_THREADS = torch.get_num_threads()


def affinity() -> set[int]:
    """The CPUs this process may be scheduled on."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return set(range(os.cpu_count() or 1))


def cgroup_cpu_quota(root: Path = ROOT, proc_cgroup: str | None = None) -> float | None:
    """CPUs' worth of time per period that this process's cgroup and its ancestors allow (the
    tightest); None where none sets a quota. cgroup v2 and v1; ``root`` and ``proc_cgroup`` (the
    text of /proc/self/cgroup) for tests."""
    tightest: float | None = None
    for directory, v2 in binding_dirs(("cpu", "cpu,cpuacct", "cpuacct,cpu"), "cpu", root, proc_cgroup):
        quota = _quota(directory, v2=v2)
        if quota is not None:
            tightest = quota if tightest is None else min(tightest, quota)
    return tightest


def _quota(directory: Path, *, v2: bool) -> float | None:
    try:
        if v2:
            limit, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
            return None if limit == "max" else int(limit) / int(period or 100_000)
        limit = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return limit / period if limit > 0 and period > 0 else None


def usable_cpus(cpus: int, quota: float | None, share: float = 1.0) -> int:
    """Threads worth running on ``cpus`` CPUs under ``quota`` (rounded up), for an engine that
    gets ``share`` of them; at least one."""
    if quota is not None:
        cpus = min(cpus, math.ceil(quota - 1e-9))
    return max(1, math.floor(cpus * share + 1e-9))


@dataclass(frozen=True)
class CpuTimes:
    at: float  # time.monotonic()
    own_s: float  # this process's CPU time, every thread
    idle_s: float  # idle (and iowait) time of the CPUs it may run on


def read_cpu_times(cpus: set[int], stat: Path = Path("/proc/stat")) -> CpuTimes:
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    idle = 0
    try:
        for line in stat.read_text().splitlines():
            name, _, fields = line.partition(" ")
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                values = fields.split()
                idle += int(values[3]) + int(values[4])  # idle, iowait
    except (OSError, ValueError, IndexError):
        pass
    return CpuTimes(time.monotonic(), time.process_time(), idle / tick)


class ThreadGovernor:
    """Called by the thread that runs the engine's steps (OpenMP's thread count is that thread's)."""

    def __init__(
        self,
        max_threads: int,
        *,
        sample: Callable[[], CpuTimes] | None = None,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        every_s: float = LOOK_EVERY_S,
    ) -> None:
        self.max_threads = max(1, max_threads)
        cpus = affinity()
        self.sample = sample or (lambda: read_cpu_times(cpus))
        self.set_threads = set_threads
        self.every_s = every_s
        self.threads = self.max_threads
        self.changes = 0
        self._last: CpuTimes | None = None
        self._room_streak = 0
        self.set_threads(self.threads)
        self._applied = False

    def tick(self) -> None:
        if not self._applied:  # in the stepping thread, which may not be the one that built the engine
            self.set_threads(self.threads)
            self._applied = True
        now = self.sample() if self._last is None or time.monotonic() - self._last.at >= self.every_s else None
        if now is None:
            return
        if self._last is not None and now.at > self._last.at:
            self.decide(self.room(self._last, now))
        self._last = now

    @staticmethod
    def room(before: CpuTimes, after: CpuTimes) -> float:
        """CPUs' worth the other processes left this one over the window: its own use plus what stood idle."""
        return ((after.own_s - before.own_s) + (after.idle_s - before.idle_s)) / (after.at - before.at)

    def decide(self, room: float) -> None:
        wanted = min(self.max_threads, max(1, math.floor(room + 0.5)))
        if wanted < self.threads:
            self._room_streak = 0
            self._use(wanted)
        elif wanted > self.threads:
            self._room_streak += 1
            if self._room_streak >= RAISE_AFTER_LOOKS:
                self._room_streak = 0
                self._use(wanted)
        else:
            self._room_streak = 0

    def _use(self, threads: int) -> None:
        self.threads = threads
        self.changes += 1
        self.set_threads(threads)


def thread_governor(configured: int | None, share: float, device: torch.device) -> ThreadGovernor | None:
    """What the engine does with torch's threads: ``configured`` None leaves them alone, N > 0 sets N
    (fixed), 0 sizes them to the CPUs this process may use (times ``share``) and adapts; off a CPU,
    0 leaves them alone."""
    if configured is not None and configured > 0:
        torch.set_num_threads(configured)
        return None
    if configured is None or device.type != "cpu":
        return None
    most = usable_cpus(len(affinity()), cgroup_cpu_quota(), share)
    return ThreadGovernor(min(TORCH_DEFAULT_THREADS, most))
