"""``inflightq bench fairness`` end to end on the tiny random model: real stacks (API and workers with
their metrics ports, on real Redis and on a private Redis Cluster), a few seconds per phase, and a
report whose numbers agree with each other and with the load asked for. No assertion on speed or on
the targets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.fairness import HEAVY, LIGHT, A, B, Phase, Sent, arrivals, flood_summary, merged, weights_summary
from bench.serve_metrics import RequestResult

SEQS, FLOOD_S, WEIGHTS_S, ROUNDS = 4, 5.0, 4.0, 2


def _done(prompt: int, ttft: float, gaps: list[float]) -> RequestResult:
    r = RequestResult(prompt, len(gaps) + 1, success=True, ttft=ttft, latency=ttft + sum(gaps), itl=gaps)
    r.output_tokens = len(gaps) + 1
    return r


def test_arrivals_are_seeded_poisson_times_inside_the_window() -> None:
    times = arrivals(5.0, 2.0, 12.0, seed=1)
    assert times == sorted(times) and times[0] > 2.0 and times[-1] < 12.0
    assert 25 <= len(times) <= 80  # 50 expected
    assert times == arrivals(5.0, 2.0, 12.0, seed=1) != arrivals(5.0, 2.0, 12.0, seed=2)


def test_tokens_served_count_only_the_window() -> None:
    phase = Phase(
        [
            Sent(HEAVY, 0.0, _done(100, 1.0, [1.0, 1.0])),  # tokens at 1, 2, 3 s
            Sent(HEAVY, 3.5, _done(50, 1.0, [1.0])),  # 4.5, 5.5: only its first in a 5 s window
            Sent(LIGHT, 0.0, _done(10, 4.0, [2.0])),  # 4, 6
            Sent(LIGHT, 4.9, RequestResult(70, 3)),  # cancelled before its first token: nothing served
        ],
        cancelled=1,
    )
    w = weights_summary(phase, 5.0)
    assert w["tenants"][HEAVY] == {
        "weight": 3.0, "sent": 2, "completed": 2, "output_tokens": 4, "prompt_tokens": 150, "tokens": 154
    }  # fmt: skip
    assert w["tenants"][LIGHT]["tokens"] == 1 + 10 and w["tenants"][LIGHT]["completed"] == 1
    assert w["ratio"] == round(154 / 11, 3) and w["output_ratio"] == 4.0
    assert w["error"] == round(abs(154 / 11 / 3 - 1), 3) and not w["met"]
    assert w["series"]["t"][-1] == 5.0 and w["series"][HEAVY][-1] == 4 and w["series"][LIGHT][-1] == 1
    settled = weights_summary(phase, 5.0, settle_s=2.5)["tenants"][HEAVY]  # tokens at 3 and 4.5 s; one prompt
    assert (settled["output_tokens"], settled["prompt_tokens"]) == (2, 50)


def test_flood_throughput_counts_every_tenants_tokens_in_the_window() -> None:
    phase = Phase([Sent(A, 0.0, _done(10, 1.0, [1.0, 1.0])), Sent(B, 2.5, _done(10, 0.5, [3.0]))], cancelled=0)
    f = flood_summary(phase, (1.5, 4.0))  # A's tokens at 1, 2, 3 s; B's at 3, 6 s
    assert f["window_output_tokens"] == 3 and f["window_output_tok_s"] == round(3 / 2.5, 2)
    assert f["b_sent_s"] == [2.5] and f["b_ttft_ms"] == [500.0]
    assert f[A]["sent"] == f[A]["completed"] == 1 and f[A]["total_output_tokens"] == 3


def test_rounds_pool_requests_and_counters_and_average_the_throughput() -> None:
    one = Phase([Sent(A, 0.0, _done(10, 1.0, [1.0, 1.0]))], cancelled=1, preemptions={"fair_share": 2.0})
    two = Phase([Sent(B, 2.5, _done(10, 0.5, [3.0]))], cancelled=0, preemptions={"fair_share": 1.0, "urgency": 1.0})
    both = merged([one, two])
    assert len(both.sent) == 2 and both.cancelled == 1 and both.preemptions == {"fair_share": 3.0, "urgency": 1.0}
    f = flood_summary(both, (1.5, 4.0), rounds=2)  # A's tokens at 2, 3 s (round 1); B's at 3 s (round 2)
    assert f["rounds"] == 2 and f["window_output_tokens"] == 3
    assert f["window_output_tok_s"] == round(3 / (2.5 * 2), 2)
    assert f[B]["sent"] == 1 and f["b_ttft_ms"] == [500.0]


def test_bench_fairness_reports_consistent_figures_for_real_stacks(
    tiny_model_dir: Path, bench_env: str, tmp_path: Path
) -> None:
    from bench.fairness import main

    report = main(
        [
            "--model", str(tiny_model_dir), "--dtype", "float32", "--setups", "standalone:1,cluster:2",
            "--max-num-seqs", str(SEQS), "--flood-s", str(FLOOD_S), "--warmup-s", "1", "--tail-s", "1",
            "--weights-s", str(WEIGHTS_S), "--weights-settle-s", "1", "--input-len", "50,90", "--output-len", "3,8",
            "--rounds", str(ROUNDS), "--out", str(tmp_path),
        ]
    )  # fmt: skip

    assert list(report["setups"]) == ["standalone:1", "cluster:2"]
    for name, row in report["setups"].items():
        assert (row["workers"], row["cluster"]) == ((1, False) if name == "standalone:1" else (2, True))
        assert row["slots"] == row["workers"] * SEQS
        light = row["light"]
        assert light["requests"] == len(light["offsets_s"]) >= 1
        assert all(1.0 <= o <= FLOOD_S - 1.0 for o in light["offsets_s"])
        assert light["rate_req_s"] == pytest.approx(0.2 * row["saturation"]["requests_per_s"], rel=1e-3)
        assert row["idle"]["completed"] == row["idle"]["requests"] == light["requests"]
        for run in ("fair", "fcfs"):
            flood = row[run]
            # Every B request finished with the tokens it asked for; every A request finished or was
            # cancelled when the flood ended (none failed).
            assert flood[B]["sent"] == flood[B]["completed"] == light["requests"], flood[B]["errors"]
            assert flood[A]["completed"] + flood["cancelled"] == flood[A]["sent"] > 0, flood[A]["errors"]
            assert flood["cancelled"] <= 3 * row["slots"] * ROUNDS
            for tenant in (A, B):
                assert flood[tenant]["token_count_mismatches"] == flood[tenant]["timing_inconsistencies"] == 0
            assert len(flood["b_ttft_ms"]) == len(flood["b_sent_s"]) == light["requests"]
            # The per-request list and the summary agree: its p99 is the list's (each value rounded to 0.1 ms).
            assert flood[B]["ttft_ms"]["p99"] == pytest.approx(float(np.percentile(flood["b_ttft_ms"], 99)), abs=0.1)
            assert (
                0
                < flood["window_output_tokens"]
                <= flood[A]["total_output_tokens"] + flood[B]["total_output_tokens"] + flood["cancelled"] * 8
            )
            # Pooled over the rounds, each on a fresh stack: the rate is the rounds' tokens over their windows.
            assert flood["rounds"] == len(flood["rounds_output_tok_s"]) == ROUNDS
            assert flood["window_output_tok_s"] == round(flood["window_output_tokens"] / (FLOOD_S - 1.0) / ROUNDS, 2)
            assert sum(flood["rounds_output_tok_s"]) / ROUNDS == pytest.approx(flood["window_output_tok_s"], abs=0.02)
        assert row["fcfs"]["anchor"] == report["fcfs_anchor"]
        assert len(row["load_average"]) == 2
        for run in (row["fair"], row["fcfs"], row["weights"]):
            assert all(count >= 0 for count in run["preemptions"].values())
        w = row["weights"]
        for tenant in (HEAVY, LIGHT):
            x = w["tenants"][tenant]
            assert x["tokens"] == x["output_tokens"] + x["prompt_tokens"] and x["output_tokens"] > 0
            assert x["completed"] <= x["sent"] and 0 < x["output_tokens"] <= w["series"][tenant][-1]
        assert w["ratio"] == round(w["tenants"][HEAVY]["tokens"] / w["tenants"][LIGHT]["tokens"], 3)
        t = row["targets"]
        assert t["b_fair_vs_idle"] == round(t["b_fair_p99_ms"] / t["b_idle_p99_ms"], 3)
        assert t["b_fcfs_vs_idle"] == round(t["b_fcfs_p99_ms"] / t["b_idle_p99_ms"], 3)
        assert t["ttft_met"] == (t["b_fair_vs_idle"] <= 2.0)
        assert t["throughput_ratio"] == round(
            row["fair"]["window_output_tok_s"] / row["fcfs"]["window_output_tok_s"], 3
        )
        assert t["throughput_met"] == (t["throughput_ratio"] >= 0.95)
        assert (t["weights_ratio"], t["weights_met"]) == (w["ratio"], w["error"] <= 0.1)

    stem = tmp_path / f"fairness-{report['date'][:10]}"
    saved = json.loads(stem.with_suffix(".json").read_text())
    assert list(saved["setups"]) == list(report["setups"])
    assert stem.with_suffix(".png").stat().st_size > 0
    md = stem.with_suffix(".md").read_text()
    assert report["command"] in md and "`cluster:2`" in md and "weights 3:1" in md
