"""``inflightq bench serve`` end to end on the tiny random model: a real stack (API and worker
subprocesses, real Redis), a handful of requests through every way in, and a report whose numbers
agree with each other and with what was asked. No assertion on speed."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from bench.serve_dataset import synthetic_chat
from bench.serve_metrics import RequestResult, summarize
from shared.model_source import load_tokenizer
from shared.settings import get_settings

NUM_REQUESTS = 5


def test_dataset_has_exact_lengths_and_the_chat_routes_token_ids(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model_dir))
    samples = synthetic_chat(tokenizer, 20, input_len=(50, 120), output_len=(3, 9), seed=7)
    again = synthetic_chat(tokenizer, 20, input_len=(50, 120), output_len=(3, 9), seed=7)
    assert [s.prompt_token_ids for s in samples] == [s.prompt_token_ids for s in again]
    for s in samples:
        assert 50 <= s.prompt_len <= 120 and 3 <= s.output_len <= 9
        # /generate_stream tokenizes the templated text itself: it must arrive as the same ids.
        assert tokenizer(s.prompt_text, add_special_tokens=True)["input_ids"] == s.prompt_token_ids


def test_summary_follows_vllm_definitions() -> None:
    a = RequestResult(prompt_len=10, output_len=3)
    last = a.record_token(0.0, 0.5, 0.0)
    last = a.record_token(0.0, 0.6, last)
    last = a.record_token(0.0, 0.8, last)
    a.latency, a.success, a.reported_tokens = last, True, 3
    b = RequestResult(prompt_len=20, output_len=4, error="HTTP 503")
    m = summarize([a, b], duration_s=2.0)
    assert (m["completed"], m["failed"], m["total_output_tokens"], m["errors"]) == (1, 1, 3, ["HTTP 503"])
    assert m["ttft_ms"]["p50"] == pytest.approx(500.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(150.0)  # (800 - 500) / (3 - 1)
    assert m["itl_ms"]["mean"] == pytest.approx(150.0)  # gaps of 100 and 200
    assert m["output_throughput"] == pytest.approx(1.5)
    assert m["token_count_mismatches"] == 0 and m["timing_inconsistencies"] == 0


def test_bench_serve_reports_consistent_figures_for_a_real_stack(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.serve import main

    monkeypatch.setenv("INFLIGHTQ_REDIS_URL", redis_url)
    get_settings.cache_clear()
    try:
        report = main(
            [
                "--model", str(tiny_model_dir), "--dtype", "float32", "--num-requests", str(NUM_REQUESTS),
                "--input-len", "50,90", "--output-len", "3,8", "--request-rate", "50,inf",
                "--low-load-requests", "2", "--workers", "1", "--no-wait", "--out", str(tmp_path),
            ]
        )  # fmt: skip
    finally:
        get_settings.cache_clear()
        gc.unfreeze()  # the benchmark froze this process's objects, as it does its own

    requested = report["dataset"]["output_tokens"]["total"]
    offline = report["anchors"]["offline_engine"]
    assert offline["completed"] == NUM_REQUESTS and offline["total_output_tokens"] == requested
    assert report["anchors"]["transformers_cb"]["total_output_tokens"] == requested
    assert report["anchors"]["offline_engine_low_load"]["completed"] == 2

    kinds = {(r["phase"], r["endpoint"], r["rate"]) for r in report["runs"]}
    for endpoint in ("generate_stream", "chat", "queue"):
        assert {("low_load", endpoint, "inf"), ("sweep", endpoint, 50.0), ("sweep", endpoint, "inf")} <= kinds
    for run in report["runs"]:
        m = run["metrics"]
        expected = 2 if run["phase"] == "low_load" else NUM_REQUESTS
        assert (m["requests"], m["completed"], m["failed"]) == (expected, expected, 0), m["errors"]
        assert m["total_output_tokens"] == m["requested_output_tokens"]
        assert m["token_count_mismatches"] == 0 and m["timing_inconsistencies"] == 0
        if run["phase"] == "sweep":
            assert m["total_output_tokens"] == requested
            # Each run says where the box's CPU went: the stack's processes and this load generator.
            cpu = m["cpu"]
            assert set(cpu["cpu_s"]) == {"api", "workers", "redis", "load generator"}
            assert cpu["cpu_s"]["workers"] > 0 and cpu["cpu_s"]["load generator"] > 0
            assert min(cpu["cpu_s"].values()) >= 0 and 0 < cpu["bound"] < 1
        for stat in ("mean", "p50", "p90", "p99"):
            assert m["ttft_ms"][stat] <= m["e2e_ms"][stat]
        assert m["ttft_ms"]["p50"] <= m["ttft_ms"]["p90"] <= m["ttft_ms"]["p99"]
        # duration_s is reported in ms (3 decimals), throughput from the unrounded duration: a 46 ms
        # low-load run's rounding alone is 1%. Consistent to the precision the report gives.
        duration, tokens = m["duration_s"], m["total_output_tokens"]
        fastest, slowest = tokens / max(duration - 0.0005, 1e-9), tokens / (duration + 0.0005)
        assert slowest - 0.01 <= m["output_throughput"] <= fastest + 0.01
    # (/proc counts in 10 ms ticks: one short run may show none; the API's runs together do.)
    api_runs = [r for r in report["runs"] if r["phase"] == "sweep" and r["endpoint"] != "queue"]
    assert sum(r["metrics"]["cpu"]["cpu_s"]["api"] for r in api_runs) > 0

    assert set(report["targets"]) == {"throughput_vs_offline_engine", "p50_ttft_added_ms_at_low_load"}
    # Low load is interleaved prompt by prompt: every path is paired with the offline engine (and the API
    # paths with the queue client) on each of the 2 prompts.
    paired = report["low_load_paired_ttft_added_ms"]
    assert set(paired) == {
        "generate_stream vs offline_engine", "chat vs offline_engine", "queue vs offline_engine",
        "generate_stream vs queue", "chat vs queue",
    }  # fmt: skip
    for added in paired.values():
        assert added["pairs"] == 2 and added["p25"] <= added["median"] <= added["p75"]
    added = report["targets"]["p50_ttft_added_ms_at_low_load"]
    assert set(added["met"]) == {"generate_stream vs offline_engine", "chat vs offline_engine"}
    assert added["added"]["chat vs offline_engine"] == paired["chat vs offline_engine"]["median"]
    stem = tmp_path / f"serve-{report['date'][:10]}"
    assert json.loads(stem.with_suffix(".json").read_text())["dataset"]["requests"] == NUM_REQUESTS
    assert stem.with_suffix(".png").stat().st_size > 0
    assert "API /generate_stream" in stem.with_suffix(".md").read_text()
    assert "CPU per generated token by process" in stem.with_suffix(".md").read_text()
    assert f"{stem.name}.png" in (tmp_path / "README-serve.md").read_text()
