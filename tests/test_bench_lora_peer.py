"""``bench.lora --peers vllm``: the parts that run without vLLM (CI has none): reading the peer script's
answer out of its stdout, and merging its cells, rounds included, into the second table."""

from __future__ import annotations

import json
from pathlib import Path

from bench.lora import parse_peer_output, peer_rows, peer_table


def _cell(streams: int, adapters: int, tokens: int, seconds: float, tpot: float | None) -> dict:
    return {"streams": streams, "adapters": adapters, "tokens": tokens, "seconds": seconds, "tpot_ms": tpot}


def test_the_answer_is_the_last_json_line_and_the_log_gives_the_cpu_binding(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("INFO \tlocal_rank=0, core ids=[0]\nINFO \treserved_cpus=[1]\n")
    answer = {"version": "0.32.0", "start_s": 20.0, "cells": []}
    got = parse_peer_output("a stray print\n" + json.dumps(answer) + "\n", 0, log, ".installed-0.32.0")
    assert got["version"] == "0.32.0" and got["installed"] == "0.32.0"
    assert got["cpu_binding"] == "core ids=[0], reserved_cpus=[1]"


def test_an_error_or_no_answer_is_recorded_with_the_log(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("Traceback ...\nValueError: LoRA is not supported\n")
    error = parse_peer_output(json.dumps({"error": "ValueError: no", "stage": "start"}), 3, log)
    assert error["error"] == "ValueError: no" and error["stage"] == "start" and error["log"] == str(log)
    silent = parse_peer_output("", -9, log)
    assert "exited with -9" in silent["error"] and "LoRA is not supported" in silent["error"]


def test_peer_rows_merge_rounds_against_the_peers_own_base_and_ours() -> None:
    cells = [
        _cell(8, 0, 100, 1.0, 10.0),
        _cell(8, 4, 50, 1.0, 20.0),
        _cell(8, 0, 100, 1.0, 12.0),  # a second round
        _cell(8, 4, 70, 1.0, None),  # a round without a TPOT (each request one token)
    ]
    ours = [{"streams": 8, "adapters": 0, "tok_s": 150.0}, {"streams": 8, "adapters": 4, "tok_s": 120.0}]
    rows = peer_rows({"cells": cells}, ours, [8], [0, 4])
    assert rows[0] == {
        "streams": 8,
        "adapters": 0,
        "tok_s": 100.0,
        "tpot_ms": 11.0,
        "throughput_vs_base": 1.0,
        "tpot_vs_base": 1.0,
        "throughput_vs_base_rounds": [1.0, 1.0],
        "throughput_vs_base_median": 1.0,
        "ours_vs_vllm": 1.5,
    }
    assert rows[1]["tok_s"] == 60.0 and rows[1]["throughput_vs_base"] == 0.6
    assert rows[1]["tpot_ms"] == 20.0 and rows[1]["tpot_vs_base"] == 1.818
    assert rows[1]["ours_vs_vllm"] == 2.0
    table = peer_table(rows)
    assert table.splitlines()[0].startswith("| streams | adapters | vLLM tok/s")
    assert "| 8 | 4 | 60.0 | 0.60 | 20.0 | 1.82 | 2.00 |" in table


def test_each_round_is_set_against_the_base_cell_of_the_same_round() -> None:
    """A round the host's load slowed (the third: every cell at a third of its speed, the adapters' more)
    moves the summed ratio; the per-round ratios keep the rounds apart and their median stands."""
    from bench.lora import base_rows, merge

    rounds = [(100.0, 90.0), (110.0, 99.0), (30.0, 12.0)]  # (base, adapters) tok/s per round, 10 s each
    cells = {
        (8, 0): [{"tokens": b * 10, "seconds": 10.0, "tok_s": b, "tpot_ms": 1.0} for b, _ in rounds],
        (8, 16): [{"tokens": a * 10, "seconds": 10.0, "tok_s": a, "tpot_ms": 1.0} for _, a in rounds],
    }
    (base, adapters) = base_rows(merge(cells, [8], [0, 16]), [8], [0, 16], cells)
    assert base["throughput_vs_base_rounds"] == [1.0, 1.0, 1.0]
    assert adapters["throughput_vs_base_rounds"] == [0.9, 0.9, 0.4]
    assert adapters["throughput_vs_base_median"] == 0.9
    assert adapters["throughput_vs_base"] == round(201 / 240, 3)  # the sums: the slow round counts
