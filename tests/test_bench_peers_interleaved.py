"""``bench.peers_interleaved``: the parts that run without vLLM or llama.cpp (CI has neither): each round's
order, the per-round ratios and their medians, and the report it writes."""

from __future__ import annotations

import json
from pathlib import Path

from bench.peers_interleaved import OURS, markdown, plot, ratios, rotation
from bench.results_files import save


def test_each_system_leads_one_round_in_turn() -> None:
    systems = [OURS, "vllm", "llama.cpp"]
    orders = [rotation(systems, i) for i in range(4)]
    assert [order[0] for order in orders] == [OURS, "vllm", "llama.cpp", OURS]
    assert all(sorted(order) == sorted(systems) for order in orders)


def test_ratios_pair_rounds_and_take_the_median() -> None:
    throughput = {OURS: {1: [60.0, 40.0, 50.0], 8: [200.0]}, "vllm": {1: [50.0, 50.0, 25.0], 8: [0.0]}}
    got = ratios(throughput, "vllm")
    assert got[1] == {"per_round": [1.2, 0.8, 2.0], "median": 1.2}
    assert got[8] == {"per_round": [], "median": None}  # a peer that produced nothing gives no ratio


def test_the_report_names_the_command_and_holds_every_round(tmp_path: Path) -> None:
    throughput = {OURS: {1: [60.0, 40.0], 32: [300.0, 310.0]}, "vllm": {1: [50.0, 50.0], 32: [280.0, 290.0]}}
    report = {
        "command": "python -m bench.peers_interleaved --rounds 2",
        "date": "2026-12-02T05:00:00+00:00",
        "machine": "x86_64, 2 cpus, 2 torch threads, torch 2.13.0+cpu",
        "model": "smollm2-135m-instruct",
        "dtype": "bfloat16",
        "requests_per_run": 32,
        "systems": {OURS: "inflightq", "vllm": "vllm serve ..."},
        "throughput": throughput,
        "ours_over_peer": {"vllm": ratios(throughput, "vllm")},
    }
    save(tmp_path / "peers-interleaved", report, markdown(report), plot)
    text = (tmp_path / "peers-interleaved.md").read_text()
    assert "python -m bench.peers_interleaved --rounds 2" in text
    assert "| 1 | 60.0 / 40.0 | 50.0 / 50.0 |" in text
    assert "**1.00x** (1.20, 0.80)" in text
    assert json.loads((tmp_path / "peers-interleaved.json").read_text())["throughput"][OURS]["32"] == [300.0, 310.0]
