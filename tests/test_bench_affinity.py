"""``inflightq bench affinity`` end to end on the tiny random model (real stacks: API, workers with their
metrics ports, a private Redis), and its simulation on its own. No assertion on speed or on the targets:
the figures must agree with each other and with the workload asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.affinity import AFFINITY, PLAIN, SINGLE, Timeline, idle_while_queued, scrape_text
from bench.affinity_sim import MULTI_TURN, SHARED_PREFIX, Costs, Engine, linear_in_workers, simulate

CONVERSATIONS, TURNS, PREFIX_REQUESTS = 3, 3, 6
ENGINE = Engine(max_num_seqs=4, max_batched_tokens=256, max_prefill_beside_decodes=64, num_kv_blocks=400, block_size=16)
COSTS = Costs(prefill_s=2e-4, decode_s=2e-3)
TURN_PROMPTS = [100, 200, 300, 400]


def test_idle_while_queued_counts_the_longest_run_of_a_worker_idle_beside_waiting_work() -> None:
    tl = Timeline(
        t=[0.0, 0.25, 0.5, 0.75, 1.0, 1.25],
        held=[[0, 3], [0, 3], [0, 3], [1, 3], [0, 0], [0, 2]],
        queued=[2, 2, 2, 2, 0, 1],
    )
    idle = idle_while_queued(tl, 0.25)
    assert (idle["longest_s"], idle["worker"]) == (0.75, 0)  # three samples in a row, worker 0
    assert idle["idle_share_by_worker"] == [round(5 / 6, 3), round(1 / 6, 3)]
    assert idle["samples_with_queue"] == 5


def test_scrape_text_keeps_counters_and_labels_other_than_worker_and_model() -> None:
    text = "\n".join(
        [
            "# TYPE inflightq_worker_engine_prefix_cache_hits counter",
            'inflightq_worker_engine_prefix_cache_hits_total{model="m",worker="w"} 96.0',
            "# TYPE inflightq_worker_engine_preemptions_by_reason counter",
            'inflightq_worker_engine_preemptions_by_reason_total{model="m",reason="kv_blocks",worker="w"} 2.0',
            "# TYPE process_cpu_seconds_total counter",
            "process_cpu_seconds_total 1.5",
        ]
    )
    assert scrape_text(text) == {
        "engine_prefix_cache_hits_total": 96.0,
        "engine_preemptions_by_reason_total:kv_blocks": 2.0,
    }


def test_linear_in_workers_goes_through_two_points() -> None:
    assert linear_in_workers({2: 10.0, 4: 14.0}) == (6.0, 2.0)
    assert linear_in_workers({2: 10.0}) is None


def multi_turn(workers: int, affinity: bool, conversations: int = 8, engine: Engine = ENGINE) -> dict:
    wl = {"conversations": conversations, "prompt_by_turn": TURN_PROMPTS, "answer_len": 16, "start_spread": 0.5}
    return simulate(MULTI_TURN, workers, affinity, COSTS, engine, wl, steal_after_s=0.5)


def test_simulated_follow_up_turns_reuse_their_history_where_affinity_sends_them() -> None:
    """One worker reuses every earlier turn; affinity on two keeps that, plain pull loses part of it."""
    single, plain, aff = multi_turn(1, False), multi_turn(2, False), multi_turn(2, True)
    assert single["requests"] == plain["requests"] == aff["requests"] == 8 * len(TURN_PROMPTS)
    assert aff["hit_rate"] >= 0.9 * single["hit_rate"] > 0
    assert plain["hit_rate"] < aff["hit_rate"]
    assert aff["prefilled_tokens"] < plain["prefilled_tokens"]
    # Every prompt token is either prefilled or found cached, once per request.
    total = 8 * sum(TURN_PROMPTS)
    for run in (single, plain, aff):
        assert run["prefilled_tokens"] == pytest.approx(total * (1 - run["hit_rate"]), rel=1e-3)


def test_simulated_idle_worker_steals_a_full_workers_offers_without_waiting_the_bound() -> None:
    """Four conversations on four one-slot workers: the worker holding the chat template's block is offered
    every first turn and is full; an idle worker takes its offers once they waited the held prefix's prefill
    time, long before the bound, so affinity runs no slower than plain pull here."""
    one_slot = Engine(
        max_num_seqs=1, max_batched_tokens=256, max_prefill_beside_decodes=64, num_kv_blocks=400, block_size=16
    )
    plain = multi_turn(4, False, conversations=4, engine=one_slot)
    aff = multi_turn(4, True, conversations=4, engine=one_slot)
    assert aff["steals"] > 0
    assert aff["output_throughput"] >= 0.95 * plain["output_throughput"]


def test_simulated_shared_prefixes_partition_across_the_pool() -> None:
    wl = {
        "prefixes": 8,
        "requests": 96,
        "clients": 4,
        "shared_prefix_tokens": 320,
        "prompt_tokens": 350,
        "answer_len": 8,
    }
    small = Engine(4, 256, 64, num_kv_blocks=90, block_size=16)  # four prompts of twenty blocks fit, not eight
    plain = simulate(SHARED_PREFIX, 2, False, COSTS, small, wl, 0.5)
    aff = simulate(SHARED_PREFIX, 2, True, COSTS, small, wl, 0.5)
    assert plain["requests"] == aff["requests"] == 96
    assert aff["hit_rate"] > plain["hit_rate"]


@pytest.mark.slow
def test_bench_affinity_reports_consistent_figures_for_real_stacks(
    tiny_model_dir: Path, bench_env: str, tmp_path: Path
) -> None:
    from bench.affinity import main

    report = main(
        [
            "--model", str(tiny_model_dir), "--dtype", "float32", "--workers", "2",
            "--conversations", str(CONVERSATIONS), "--turns", str(TURNS), "--first-turn-len", "40",
            "--turn-len", "12", "--answer-len", "4", "--start-spread", "0.2",
            "--prefixes", "2", "--prefix-len", "48", "--prefix-requests", str(PREFIX_REQUESTS),
            "--suffix-len", "8", "--prefix-answer-len", "3", "--prefix-clients", "2",
            "--num-kv-blocks", "256", "--prefix-kv-blocks", "32", "--sim-workers", "2,4",
            "--out", str(tmp_path), "--tag", "t",
        ]
    )  # fmt: skip

    runs = {(r["workload"], r["mode"], r["workers"]): r for r in report["runs"]}
    assert set(runs) == {
        (w, m, n) for w in (MULTI_TURN, SHARED_PREFIX) for m, n in ((SINGLE, 1), (PLAIN, 2), (AFFINITY, 2))
    }
    for (workload, _, workers), run in runs.items():
        a, p = run["all"], run["prefix"]
        n = CONVERSATIONS * TURNS if workload == MULTI_TURN else PREFIX_REQUESTS
        assert (a["requests"], a["completed"], a["failed"]) == (n, n, 0), a["errors"]
        assert a["token_count_mismatches"] == 0 and a["timing_inconsistencies"] == 0
        counters = run["workers_counters"]
        assert len(counters) == workers == len(p["hit_rate_by_worker"])
        # The workers generated what the clients received, and looked up at least every prompt token.
        assert sum(c["generated_tokens"] for c in counters) == a["total_output_tokens"]
        assert p["queried_tokens"] >= p["prompt_tokens"] == a["total_input_tokens"]
        assert 0 <= p["hit_tokens"] <= p["queried_tokens"]
        assert p["prefilled_tokens"] == p["queried_tokens"] - p["hit_tokens"]
        assert run["redis"]["commands_per_request"] > 0
        assert run["idle_while_queued"]["samples"] == len(run["timeline"]["t"]) > 0
    # Histories grow turn by turn, and one worker finds each earlier turn in its cache.
    single = runs[(MULTI_TURN, SINGLE, 1)]
    by_turn = list(single["prompt_tokens_by_turn"].values())
    assert by_turn == sorted(by_turn) and len(by_turn) == TURNS and by_turn[0] < by_turn[-1]
    assert single["prefix"]["hit_rate"] > 0
    # With affinity on, each worker's summary of what it holds is in Redis while it runs.
    held = runs[(MULTI_TURN, AFFINITY, 2)]["redis"]["keys_after"].get("held", {})
    assert held.get("keys") == 2 and held["set_members"] > 0

    targets = {t["workload"]: t for t in report["targets"]}
    assert set(targets) == {MULTI_TURN, SHARED_PREFIX}
    for workload, t in targets.items():
        aff, plain = runs[(workload, AFFINITY, 2)], runs[(workload, PLAIN, 2)]
        h = t["hit_rate_vs_single"]
        assert h["ratio"] == pytest.approx(aff["prefix"]["hit_rate"] / h["single"], abs=1e-3)
        assert t["prefilled_vs_plain"]["ratio"] == pytest.approx(
            aff["prefix"]["prefilled_tokens"] / max(1, plain["prefix"]["prefilled_tokens"]), abs=1e-3
        )
        assert t["throughput_vs_plain"]["met"] == (t["throughput_vs_plain"]["ratio"] >= 1.0)
        assert t["idle_while_queued"]["bound_s"] == pytest.approx(report["steal_after_ms"] / 1000 + 0.25)

    costs = report["costs"]  # a point per worker of the four two-worker runs
    assert costs["points"] == 8 and costs["prefill_ms_per_token"] > 0 and costs["decode_ms_per_token"] > 0
    proj = report["projection"]
    for workload in (MULTI_TURN, SHARED_PREFIX):
        rows = proj["workloads"][workload]["rows"]
        assert [r["workers"] for r in rows] == [2, 4]
        assert all(r[m]["requests"] > 0 for r in rows for m in (PLAIN, AFFINITY))
        assert [r["workers"] for r in proj["redis"][workload]["rows"]] == [2, 4]
    assert proj["limits"]

    stem = tmp_path / f"affinity-{report['date'][:10]}-t"
    saved = json.loads(stem.with_suffix(".json").read_text())
    assert saved["targets"] == report["targets"]
    assert stem.with_suffix(".png").stat().st_size > 0
    md = stem.with_suffix(".md").read_text()
    assert report["command"] in md and "## Projection to larger pools" in md and "| 2 | affinity |" in md
