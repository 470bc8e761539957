"""``inflightq bench priority`` end to end on the tiny random model: a real stack (API and a worker
with its metrics port, real Redis), a handful of requests, and a report whose numbers agree with
each other and with the workload asked for. No assertion on speed or on the targets."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.priority import BACKGROUND, URGENT, goodput, mixed_load
from bench.serve_dataset import synthetic_chat
from bench.serve_metrics import RequestResult
from shared.model_source import load_tokenizer
from shared.settings import get_settings

NUM, SEQS, TRANSFORMERS = 12, 4, 3


def test_mixed_load_starts_full_then_poisson_with_a_share_of_urgent(tiny_model_dir: Path) -> None:
    samples = synthetic_chat(load_tokenizer(str(tiny_model_dir)), 40, input_len=(50, 60), output_len=(3, 5))
    load = mixed_load(samples, burst=8, rate=2.0, urgent_share=0.05, seed=3)
    assert [r.offset for r in load[:8]] == [0.0] * 8 and all(r.klass == BACKGROUND for r in load[:8])
    offsets = [r.offset for r in load]
    assert offsets == sorted(offsets) and offsets[-1] > 0
    assert sum(r.klass == URGENT for r in load) == 2
    assert {r.priority for r in load if r.klass == URGENT} == {0}
    assert {r.priority for r in load if r.klass == BACKGROUND} <= {2, 3}
    assert load == mixed_load(samples, burst=8, rate=2.0, urgent_share=0.05, seed=3)


def test_goodput_counts_requests_meeting_both_slos() -> None:
    def done(ttft: float, latency: float, tokens: int) -> RequestResult:
        r = RequestResult(10, tokens, success=True, ttft=ttft, latency=latency)
        r.output_tokens = tokens
        return r

    fast, slow_first, slow_tokens = done(0.1, 0.5, 5), done(0.9, 1.0, 5), done(0.1, 2.1, 5)
    g = goodput([fast, slow_first, slow_tokens, RequestResult(10, 5)], {"ttft_ms": 200.0, "tpot_ms": 200.0})
    assert g == {"good": 1, "requests": 4, "share": 0.25}


def test_bench_priority_reports_consistent_figures_for_a_real_stack(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.priority import main

    monkeypatch.setenv("INFLIGHTQ_REDIS_URL", redis_url)
    get_settings.cache_clear()
    try:
        report = main(
            [
                "--model", str(tiny_model_dir), "--dtype", "float32", "--num-requests", str(NUM),
                "--calibration-requests", "8", "--max-num-seqs", str(SEQS), "--urgent-share", "0.2",
                "--input-len", "50,90", "--output-len", "3,8", "--transformers-requests", str(TRANSFORMERS),
                "--no-wait", "--out", str(tmp_path),
            ]
        )  # fmt: skip
    finally:
        get_settings.cache_clear()

    w, runs = report["workload"], report["runs"]
    assert (w["requests"], w["urgent"] + w["background"], w["burst"]) == (NUM, NUM, SEQS)
    assert w["urgent"] == round(0.2 * NUM) and len(w["urgent_offsets_s"]) == w["urgent"]
    assert report["saturation"]["requests_per_s"] > 0
    assert w["offered_rate_req_s"] == pytest.approx(1.2 * report["saturation"]["requests_per_s"], rel=1e-3)
    assert set(runs) == {"calibration", "idle", "priority", "fcfs", "transformers_cb"}
    assert runs["idle"]["classes"][URGENT]["completed"] == w["urgent"]
    idle_p99 = runs["idle"]["classes"][URGENT]
    assert report["slo"]["ttft_ms"] == pytest.approx(2 * idle_p99["ttft_ms"]["p99"], abs=0.1)
    assert report["slo"]["tpot_ms"] == pytest.approx(2 * idle_p99["tpot_ms"]["p99"], abs=0.1)

    for name in ("priority", "fcfs"):
        run = runs[name]
        classes, total = run["classes"], run["all"]
        assert (total["requests"], total["completed"], total["failed"]) == (NUM, NUM, 0), total["errors"]
        assert classes[URGENT]["requests"] == w["urgent"] and classes[BACKGROUND]["requests"] == w["background"]
        assert sum(c["total_output_tokens"] for c in classes.values()) == total["total_output_tokens"]
        assert total["total_output_tokens"] == report["dataset"]["output_tokens"]["total"]
        for m in (*classes.values(), total):
            assert m["token_count_mismatches"] == 0 and m["timing_inconsistencies"] == 0
            assert m["ttft_ms"]["p50"] <= m["ttft_ms"]["p90"] <= m["ttft_ms"]["p99"]
        for c in classes.values():
            assert 0 <= c["goodput"]["good"] <= c["goodput"]["requests"] == c["requests"]
        assert len(run["urgent_ttft_ms"]) == len(run["urgent_sent_s"]) == w["urgent"]
        assert max(run["urgent_ttft_ms"]) == pytest.approx(classes[URGENT]["ttft_ms"]["p99"], rel=0.1)
        worker = run["worker"]
        # The worker's own counters agree with what the clients received.
        assert worker["generated_tokens"] == total["total_output_tokens"]
        assert worker["engine_steps"] > 0
        assert worker["engine_preemptions"] == (
            worker["engine_preemptions_by_reason:urgency"] + worker["engine_preemptions_by_reason:kv_blocks"]
        )
        assert worker["preemptions_per_min"] == pytest.approx(
            worker["engine_preemptions"] / (total["duration_s"] / 60), rel=0.01
        )
        assert run["pool"]["samples"] == len(run["pool"]["series"]["t"]) >= 1
    # The worker splits each level's TTFT into time in Redis and time in the engine.
    assert {"mean_time_in_queue_ms:p0", "mean_time_to_first_token_ms:p0"} <= set(runs["priority"]["worker"])
    assert not any(k.endswith(":p0") for k in runs["fcfs"]["worker"])
    # FCFS sends every request at one priority: nothing is preempted for urgency.
    assert runs["fcfs"]["worker"]["engine_preemptions_by_reason:urgency"] == 0

    tf = runs["transformers_cb"]
    assert tf["all"]["completed"] == TRANSFORMERS and tf["all"]["token_count_mismatches"] == 0
    assert tf["all"]["total_output_tokens"] == tf["all"]["requested_output_tokens"]

    t = report["targets"]
    ttft = t["urgent_p99_ttft_vs_idle_p99"]
    assert ttft["ratio"] == pytest.approx(ttft["loaded_ms"] / ttft["idle_ms"], abs=5e-4)  # reported to 3 decimals
    assert ttft["met"] == (ttft["ratio"] <= 2.0)
    tput = t["background_throughput_vs_all_background"]
    assert tput["background_tok_s"] == runs["priority"]["classes"][BACKGROUND]["output_throughput"]
    assert tput["all_background_tok_s"] == runs["fcfs"]["all"]["output_throughput"]
    assert math.isclose(tput["ratio"], tput["background_tok_s"] / tput["all_background_tok_s"], rel_tol=1e-2)

    stem = tmp_path / f"priority-{report['date'][:10]}"
    assert json.loads(stem.with_suffix(".json").read_text())["workload"]["requests"] == NUM
    assert stem.with_suffix(".png").stat().st_size > 0
    md = stem.with_suffix(".md").read_text()
    assert report["command"] in md and "SLO goodput" in md and "transformers CB" in md
