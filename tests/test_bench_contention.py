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
