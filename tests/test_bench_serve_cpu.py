"""The CPU meter behind bench serve's "where the CPU went" table, on real processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis

from bench.serve_cpu import LOAD_GENERATOR, WORKERS, CpuMeter, local_redis_pid, process_cpu_s, table

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")

# Burns {s} s of CPU, says so on stdout, then idles.
BURN = (
    "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
    "print('burnt', flush=True)\ntime.sleep(30)"
)


def test_a_busy_child_and_an_idle_one_are_told_apart() -> None:
    busy = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.6)], stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        meter = CpuMeter({WORKERS: [busy.pid], "api": [idle.pid]}, cores=2)
        meter.start()
        assert busy.stdout is not None and busy.stdout.readline() == "burnt\n"  # its burn is over
        report = meter.stop(tokens=100)
    finally:
        busy.kill(), idle.kill()
    assert report is not None
    cpu = report["cpu_s"]
    assert 0.4 <= cpu[WORKERS] <= 0.8  # the child's burn, less its interpreter's start
    assert cpu["api"] < 0.1 and cpu[LOAD_GENERATOR] < 0.3
    assert report["ms_per_token"][WORKERS] == pytest.approx(1000 * cpu[WORKERS] / 100, abs=0.01)
    others = cpu["api"] + cpu[LOAD_GENERATOR]
    assert report["bound"] == pytest.approx(1 - others / (2 * report["wall_s"]), abs=0.002)
    lines = table([{"system": "API", "concurrency": 1, "metrics": {"cpu": report}}])
    assert lines[3].split(" | ")[2:6] == ["workers", "api", LOAD_GENERATOR, "others' share of the cores"]


def test_a_process_that_is_gone_counts_nothing() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_cpu_s(child.pid) is None


def test_the_local_redis_server_is_found_and_a_foreign_pid_is_not(redis_url: str) -> None:
    with redis.Redis.from_url(redis_url) as client:
        info = client.info("server")
    assert local_redis_pid(info) == info["process_id"]
    assert local_redis_pid({"process_id": os.getpid()}) is None  # a pid that is not redis-server
