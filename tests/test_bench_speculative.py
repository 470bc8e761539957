"""``python -m bench.speculative`` end to end on the tiny random model: both sides run every cell
of the same workload in the same process, and the report's figures agree with each other. No
assertion on speed (that is what the benchmark is for)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.timeout(600)
def test_speculative_bench_runs_both_sides_per_cell_and_reports_consistent_ratios(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import speculative

    monkeypatch.setenv("INFLIGHTQ_PEERS_DIR", str(tmp_path / "no-peers"))  # llama.cpp not installed there
    args = ["--model", str(tiny_model_dir), "--dtype", "float32", "--prompts", "2", "--max-new-tokens", "6"]
    results = speculative.main([*args, "--rounds", "1", "--peers", "llamacpp", "--out", str(tmp_path)])
    cells = results["cells"]
    assert [(c["workload"], c["streams"]) for c in cells] == [
        ("grounded", 1),
        ("grounded", 8),
        ("chat", 1),
        ("chat", 8),
    ]
    for cell in cells:
        off, on = cell["off"], cell["on"]
        assert off["tokens"] == on["tokens"] <= 2 * 6  # greedy: the same answers either way
        assert off["proposed"] == 0 and off["tokens_per_step"] == 1.0
        assert cell["ratio"] == pytest.approx(on["tok_s"] / off["tok_s"], abs=0.01)
    written = json.loads(next(tmp_path.glob("speculative-*.json")).read_text())
    assert written["cells"] == cells
    # A peer that is not installed is recorded as skipped, with the script that installs it.
    assert "bench/peers/install.sh" in written["peers"]["llamacpp"]["skipped"]
    markdown = next(tmp_path.glob("speculative-*.md")).read_text()
    assert "on / off" in markdown and "llama.cpp's lookup decoding:" in markdown
    assert next(tmp_path.glob("speculative-*.png")).stat().st_size > 0


@pytest.mark.timeout(600)
def test_speculative_bench_through_the_stack_counts_the_servers_tokens_and_the_workers_drafts(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import speculative
    from shared.settings import get_settings

    monkeypatch.setenv("INFLIGHTQ_REDIS_URL", redis_url)
    get_settings.cache_clear()
    try:
        args = ["--model", str(tiny_model_dir), "--dtype", "float32", "--prompts", "2", "--max-new-tokens", "6"]
        results = speculative.main([*args, "--rounds", "1", "--stack", "--out", str(tmp_path)])
    finally:
        get_settings.cache_clear()
    offline, stack = results["cells"], results["stack_cells"]
    assert [(c["workload"], c["streams"]) for c in stack] == [(c["workload"], c["streams"]) for c in offline]
    for cell, alone in zip(stack, offline, strict=True):
        off, on = cell["off"], cell["on"]
        # Greedy: the same answers either way, and the same as the offline engine's.
        assert off["tokens"] == on["tokens"] == alone["off"]["tokens"]
        # The worker's own counters, read around each chunk: every token the server reported was generated.
        assert off["generated"] == off["tokens"] and on["generated"] == on["tokens"]
        assert off["proposed"] == 0 and off["tokens_per_step"] == 1.0
        assert on["accepted"] <= on["proposed"]
        assert cell["ratio"] == pytest.approx(on["tok_s"] / off["tok_s"], abs=0.01)
    assert "Through the whole stack" in next(tmp_path.glob("speculative-*.md")).read_text()
