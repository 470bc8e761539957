"""``python -m bench.engine`` end to end on the tiny random model: both engines run the same
workload in the same process and the report's numbers agree with each other. No assertion on
speed (that is what the benchmark is for)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.timeout(600)
def test_engine_bench_runs_both_engines_and_reports_consistent_ratios(tiny_model_dir: Path, tmp_path: Path) -> None:
    from bench import engine

    args = ["--model", str(tiny_model_dir), "--dtypes", "float32", "--num-prompts", "4", "--repeats", "2"]
    results = engine.main([*args, "--out", str(tmp_path)])
    row = results["runs"]["float32"]
    ours, cb = row["ours"], row["transformers_cb"]
    assert len(ours["all_tok_per_s"]) == len(cb["all_tok_per_s"]) == 2
    assert ours["tok_per_s"] == max(ours["all_tok_per_s"]) and cb["tok_per_s"] == max(cb["all_tok_per_s"])
    # Every try generates exactly the workload's tokens (ignore_eos), in both engines.
    assert ours["tokens"] == cb["tokens"] == results["workload"]["new_tokens"]
    assert row["ratio"] == pytest.approx(ours["tok_per_s"] / cb["tok_per_s"], abs=0.01)
    pairs = [a / b for a, b in zip(ours["all_tok_per_s"], cb["all_tok_per_s"], strict=True)]
    assert row["pair_ratios"] == pytest.approx(pairs, abs=0.01)
    assert 0 < ours["forward_share_of_step"] <= 1
    written = json.loads(next(tmp_path.glob("engine-*.json")).read_text())
    assert written["runs"]["float32"]["median_pair_ratio"] == row["median_pair_ratio"]
    assert "ratio per pair" in next(tmp_path.glob("engine-*.md")).read_text()
    assert next(tmp_path.glob("engine-*.png")).stat().st_size > 0
