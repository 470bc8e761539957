"""bench.contention: the engine's throughput alone and beside processes that take a set share of
the cores, from real runs of the offline engine and real burner processes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from bench import contention
from bench.serve_cpu import process_cpu_s


def test_burners_add_up_to_the_share_asked_for() -> None:
    for share, cores in [(0.05, 2), (0.1, 2), (0.1, 16), (0.4, 4)]:
        idles = contention.burners(share, cores)
        busy = sum(contention.BURST_MS / (contention.BURST_MS + idle) for idle in idles)
        assert busy == pytest.approx(share * cores)
        assert all(contention.BURST_MS / (contention.BURST_MS + i) <= 0.5 for i in idles)
    with pytest.raises(ValueError):
        contention.burners(1.0, 2)


def test_a_burner_takes_about_its_share_and_stops() -> None:
    cores = os.cpu_count() or 1
    burner = contention.Burner(0.1, cores)
    with burner:
        started = [process_cpu_s(p.pid) for p in burner.processes]
        time.sleep(2.0)
        used = sum(process_cpu_s(p.pid) - s for p, s in zip(burner.processes, started, strict=True))
    assert 0.5 * 0.1 * cores * 2.0 <= used <= 1.5 * 0.1 * cores * 2.0
    assert all(p.poll() is not None for p in burner.processes)


def test_contention_reports_each_share_against_the_engine_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    report = contention.main(
        [
            "--model", str(tiny_model_dir), "--dtype", "float32", "--shares", "0.1", "--requests", "3",
            "--input-len", "20", "--output-len", "3", "--rounds", "1", "--out", str(tmp_path), "--tag", "t",
        ]
    )  # fmt: skip
    alone, taken = report["rows"]
    assert (alone["share_taken"], alone["vs_alone"], alone["amplification"]) == (0.0, 1.0, None)
    assert taken["share_taken"] == 0.1 and taken["output_throughput"] > 0
    assert taken["amplification"] == pytest.approx((1 - taken["vs_alone"]) / 0.1, abs=0.06)
    saved = json.loads(next(tmp_path.glob("contention-*-t.json")).read_text())
    assert saved["rows"] == report["rows"]
    assert "| 10% |" in next(tmp_path.glob("contention-*-t.md")).read_text()


def test_a_cpu_quota_cgroup_is_made_in_either_layout_and_removed(tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    with contention.CpuQuota(1.5, root=v1) as quota:
        assert quota.path is not None and quota.path.parent == v1 / "cpu,cpuacct"
        assert (quota.path / "cpu.cfs_quota_us").read_text() == "150000"
        assert (quota.path / "cpu.cfs_period_us").read_text() == "100000"
        assert quota.procs == quota.path / "cgroup.procs"
        for made in quota.path.iterdir():  # a real cgroup's files vanish with it; these are plain files
            made.unlink()
    assert not quota.path.exists()
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    with contention.CpuQuota(1.0, root=v2) as quota:
        assert (v2 / "cgroup.subtree_control").read_text() == "+cpu"
        assert quota.path is not None and (quota.path / "cpu.max").read_text() == "100000 100000"
        (quota.path / "cpu.max").unlink()
    with pytest.raises(OSError, match="no cpu controller"):
        contention.CpuQuota(1.0, root=tmp_path / "none").__enter__()


def test_neighbours_reports_each_condition_from_fresh_processes(tiny_model_dir: Path, tmp_path: Path) -> None:
    from worker.engine.core.cpu_threads import usable_cpus

    report = contention.main(
        [
            "--neighbours", "--engines", "ours", "--model", str(tiny_model_dir), "--dtype", "float32",
            "--requests", "2", "--input-len", "8", "--output-len", "3", "--rounds", "1", "--quota-cpus", "1",
            "--out", str(tmp_path), "--tag", "n",
        ]
    )  # fmt: skip
    (row,) = report["rows"]
    assert row["engine"] == "ours" and row["idle"]["vs_idle"] == 1.0
    assert row["busy core"]["output_throughput"] > 0
    if "cpu quota" in report["not_measured"]:  # no root or no writable cgroup tree here: it says why
        assert report["not_measured"]["cpu quota"] and "cpu quota" not in row
    else:  # the engine found the quota: one thread's worth, whatever the cores
        assert row["cpu quota"]["threads"] == [usable_cpus(report["cores"], 1.0)]
    saved = json.loads(next(tmp_path.glob("contention-*-n.json")).read_text())
    assert saved["rows"] == report["rows"]
    assert "| ours |" in next(tmp_path.glob("contention-*-n.md")).read_text()
