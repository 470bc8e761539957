"""bench.step_bounds splits a decode step into its parts and times its bounds beside it, on any CPU:
its packed-GEMM bound packs as the engine does (the fp32 upcast where oneDNN packs no bf16 weight)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import step_bounds
from tests.ci_skips import missing


def test_step_bounds_reports_each_part_and_bound(tiny_model_dir: Path, tmp_path: Path) -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(missing("a C++ compiler (the kernels the step runs on)", "apt-get install g++"))
    argv = ["--model", str(tiny_model_dir), "--batches", "1,3", "--context", "8", "--rounds", "2"]
    report = step_bounds.main([*argv, "--peak-rows", "16", "--out", str(tmp_path), "--tag", "t"])
    assert report["dtype"] == "bfloat16" and [row["batch"] for row in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert all(row["ms"][part] > 0 for part in ("step", "matmuls", "attention", "GEMM packed", "read"))
        assert row["gemm_bound_ms"] == min(row["ms"]["GEMM plain"], row["ms"]["GEMM packed"])
        assert row["read_bytes"] == report["weight_bytes"] + row["kv_bytes"] and row["kv_bytes"] > 0
    saved = json.loads(next(tmp_path.glob("step-bounds-*-t.json")).read_text())
    assert saved["rows"] == report["rows"]
    assert "| 3 |" in next(tmp_path.glob("step-bounds-*-t.md")).read_text()
