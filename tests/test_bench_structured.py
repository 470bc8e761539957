"""``python -m bench.structured`` end to end on the tiny random model: both runs make the same
tokens, the constrained one masks its rows, and the report's numbers agree with each other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.timeout(600)
def test_structured_bench_compares_equal_work_and_reports_mask_times(tiny_model_dir: Path, tmp_path: Path) -> None:
    from bench import structured

    args = ["--model", str(tiny_model_dir), "--num-prompts", "4", "--repeats", "1", "--max-new-tokens", "48"]
    results = structured.main([*args, "--out", str(tmp_path)])
    constrained, free = results["best"]["constrained"], results["best"]["unconstrained"]
    assert constrained["tokens"] == free["tokens"] > 0
    assert constrained["masked_rows"] > 0 and free["masked_rows"] == 0
    assert constrained["mask_us_per_row"] > 0
    assert results["ratio"] == pytest.approx(constrained["tok_per_s"] / free["tok_per_s"], abs=0.01)
    assert json.loads(next(tmp_path.glob("structured-*.json")).read_text())["ratio"] == results["ratio"]
    assert "mask us/row" in next(tmp_path.glob("structured-*.md")).read_text()
    assert next(tmp_path.glob("structured-*.png")).stat().st_size > 0
