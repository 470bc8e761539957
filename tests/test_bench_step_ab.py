"""bench.step_ab switches the CPU kernels off and on in place on one engine and reports each variant."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import step_ab
from tests.ci_skips import missing


def test_step_ab_reports_every_variant_and_leaves_the_kernels_on(tiny_model_dir: Path, tmp_path: Path) -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(missing("a C++ compiler (the kernels this compares)", "apt-get install g++"))
    report = step_ab.main(
        ["--model", str(tiny_model_dir), "--batches", "1,3", "--steps", "2", "--out", str(tmp_path), "--tag", "t"]
    )
    assert report["rerouted"]["fused decoder layers"] == 2
    assert [row["batch"] for row in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert set(row["step_ms"]) == {*step_ab.VARIANTS, step_ab.FLOOR} and all(v > 0 for v in row["step_ms"].values())
        assert row["speedup_vs_neither"]["neither"] == 1.0
        # The report rounds the step times to 0.01 ms: the ratio lies within what those roundings allow.
        step, floor = row["step_ms"]["all"], row["step_ms"][step_ab.FLOOR]
        low, high = (step - 0.005) / (floor + 0.005), (step + 0.005) / max(floor - 0.005, 1e-9)
        assert low * 0.99 <= row["all_vs_weights_read"] <= high * 1.01
    saved = json.loads(next(tmp_path.glob("step-ab-*-t.json")).read_text())
    assert saved["rows"] == report["rows"]
    assert "| 3 |" in next(tmp_path.glob("step-ab-*-t.md")).read_text()
