"""A CPU engine's thread count: the CPUs it may use (affinity, cgroup CPU quota, its share of the host),
and fewer while other processes take some of them. Files and CPU times are given, not measured."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from worker.engine.core.cpu_threads import (
    TORCH_DEFAULT_THREADS,
    CpuTimes,
    ThreadGovernor,
    affinity,
    cgroup_cpu_quota,
    read_cpu_times,
    thread_governor,
    usable_cpus,
)


def write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text)


def test_cgroup_v2_quota_is_cpus_worth_per_period_and_the_tightest_ancestor_binds(tmp_path: Path) -> None:
    write(tmp_path, cpu_max="max 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/\n") is None
    write(tmp_path / "kubepods" / "pod1", cpu_max="150000 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/kubepods/pod1\n") == 1.5
    write(tmp_path / "kubepods", cpu_max="50000 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/kubepods/pod1\n") == 0.5
    # In a container (cgroup namespace) its own cgroup is the root.
    write(tmp_path, cpu_max="200000 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/\n") == 2.0


def test_cgroup_v1_quota_under_either_mount_name(tmp_path: Path) -> None:
    write(tmp_path / "cpu,cpuacct" / "docker" / "abc", cpu_cfs_quota_us="250000\n", cpu_cfs_period_us="100000\n")
    write(tmp_path / "cpu,cpuacct", cpu_cfs_quota_us="-1\n", cpu_cfs_period_us="100000\n")
    proc = "12:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"
    assert cgroup_cpu_quota(tmp_path, proc) == 2.5
    write(tmp_path / "cpu" / "bench", cpu_cfs_quota_us="-1\n", cpu_cfs_period_us="100000\n")
    assert cgroup_cpu_quota(tmp_path, "4:cpu:/bench\n") is None


def test_no_cgroup_files_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path, "0::/some/where\n4:cpu:/x\n") is None


def test_usable_cpus_take_the_quota_rounded_up_and_the_engines_share() -> None:
    assert usable_cpus(2, None) == 2
    assert usable_cpus(64, 2.0) == 2  # a 2-CPU container on a 64-core host: not 64
    assert usable_cpus(64, 1.5) == 2  # a quota stops all threads together: half a core is worth a thread
    assert usable_cpus(2, 0.5) == 1
    assert usable_cpus(2, 4.0) == 2  # a quota above the affinity gives no more CPUs
    assert usable_cpus(4, None, 1 / 2) == 2  # `inflightq up --workers 2`
    assert usable_cpus(4, None, 1 / 3) == 1
    assert usable_cpus(2, 1.0, 1 / 4) == 1  # at least one


def test_cpu_times_sum_the_idle_and_iowait_of_the_cpus_it_may_use(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  900 0 90 300 30 0 0 0 0 0\n"
        "cpu0 400 0 40 100 10 0 0 0 0 0\n"
        "cpu1 400 0 40 150 20 0 0 0 0 0\n"
        "cpu10 100 0 10 50 0 0 0 0 0 0\n"
        "intr 1 2 3\n"
    )
    tick = os.sysconf("SC_CLK_TCK")
    assert read_cpu_times({0, 10}, stat).idle_s == (110 + 50) / tick
    assert read_cpu_times({1}, stat).idle_s == 170 / tick
    real = read_cpu_times(affinity())
    assert real.own_s > 0 and real.idle_s >= 0


class Recorder:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, threads: int) -> None:
        self.calls.append(threads)


def governor(max_threads: int, recorder: Recorder) -> ThreadGovernor:
    return ThreadGovernor(max_threads, sample=lambda: CpuTimes(0.0, 0.0, 0.0), set_threads=recorder)


def test_room_is_its_own_cpu_plus_what_stood_idle() -> None:
    # One second: this process used 1.3 CPUs, the CPUs it may use stood idle 0.2 s together.
    assert ThreadGovernor.room(CpuTimes(10.0, 5.0, 100.0), CpuTimes(11.0, 6.3, 100.2)) == pytest.approx(1.5)
    # Two seconds with the engine idle and another process busy on one of two CPUs.
    assert ThreadGovernor.room(CpuTimes(0.0, 0.0, 0.0), CpuTimes(2.0, 0.0, 2.0)) == 1.0


def test_a_busy_neighbour_on_one_of_two_cores_leaves_one_thread_and_its_departure_two() -> None:
    recorder = Recorder()
    g = governor(2, recorder)
    assert g.threads == 2 and recorder.calls == [2]  # set where it is built
    g.decide(2.0)  # idle box
    assert g.threads == 2
    g.decide(1.33)  # 2 spinning threads and a busy process share 2 cores: a third of each is lost
    assert g.threads == 1 and recorder.calls == [2, 1]
    g.decide(1.0)  # 1 thread beside it: it keeps its core
    assert g.threads == 1
    g.decide(2.0)  # the neighbour left: one look is not enough ...
    assert g.threads == 1
    g.decide(2.0)  # ... two in a row are
    assert g.threads == 2 and recorder.calls == [2, 1, 2]


def test_a_light_neighbour_keeps_every_thread_and_rooms_round_to_the_nearest() -> None:
    recorder = Recorder()
    g = governor(2, recorder)
    for room in (1.8, 1.6, 1.5, 1.9):  # the API and Redis taking a fifth of a core or so
        g.decide(room)
    assert g.threads == 2 and recorder.calls == [2]
    g = governor(8, Recorder())
    g.decide(5.4)
    assert g.threads == 5
    g.decide(6.6)
    g.decide(5.2)  # the streak is broken: no raise
    assert g.threads == 5
    g.decide(7.7)
    g.decide(12.0)  # never above the most it may run
    assert g.threads == 8
    g.decide(0.1)  # never below one
    assert g.threads == 1


def test_the_first_tick_sets_the_threads_in_the_stepping_thread_and_looks_each_period() -> None:
    recorder = Recorder()
    samples = iter([CpuTimes(0.0, 0.0, 0.0), CpuTimes(1.0, 0.7, 0.0), CpuTimes(2.0, 1.4, 0.0)])
    g = ThreadGovernor(2, sample=lambda: next(samples), set_threads=recorder, every_s=0.0)
    g.tick()  # first look: nothing to compare yet
    assert recorder.calls == [2, 2] and g.threads == 2
    g.tick()  # 0.7 CPUs of room: one thread
    assert g.threads == 1 and recorder.calls == [2, 2, 1]


def test_the_engine_leaves_torch_alone_sets_a_fixed_count_or_adapts() -> None:
    before = torch.get_num_threads()
    try:
        assert thread_governor(None, 1.0, torch.device("cpu")) is None
        assert torch.get_num_threads() == before
        assert thread_governor(1, 1.0, torch.device("cpu")) is None
        assert torch.get_num_threads() == 1
        assert thread_governor(0, 1.0, torch.device("cuda")) is None
        adapting = thread_governor(0, 1.0, torch.device("cpu"))
        assert adapting is not None
        assert adapting.max_threads == min(TORCH_DEFAULT_THREADS, usable_cpus(len(affinity()), cgroup_cpu_quota()))
        assert torch.get_num_threads() == adapting.max_threads
    finally:
        torch.set_num_threads(before)
