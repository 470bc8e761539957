"""``bench.peers_guidellm``: guidellm's report read into our driver's figures, and the scenario it is given.
The report is a real one of guidellm 0.8.1 (one load point against our stack), trimmed to what is read;
guidellm itself is not installed in CI (its own venv, ``bench/peers/install.sh guidellm``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.peers_guidellm import metrics, scenario
from bench.serve_metrics import print_summary

REPORT = Path(__file__).parent / "data" / "guidellm-report-concurrent-32.json"


def test_guidellm_report_gives_our_drivers_figures(capsys: pytest.CaptureFixture[str]) -> None:
    got = metrics(json.loads(REPORT.read_text()))
    assert (got["requests"], got["completed"], got["failed"]) == (64, 64, 0)
    assert got["total_output_tokens"] == 64 * 64  # ignore_eos: every request ran to its 64 tokens
    # guidellm's throughput is its completed output tokens over the run
    assert abs(got["output_throughput"] - got["total_output_tokens"] / got["duration_s"]) < 0.5
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = got[name]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (name, s)
    assert got["e2e_ms"]["p50"] > got["ttft_ms"]["p50"]  # seconds in guidellm's report, ms here
    print_summary("guidellm", got)  # every key our console block reads is there
    assert "Output token throughput (tok/s)" in capsys.readouterr().out


def test_the_scenario_is_a_closed_loop_on_the_chat_route() -> None:
    spec = scenario("http://127.0.0.1:8000", "m", "/models/m", 32, 64, (128, 64))
    backend = spec["spec"]["backend"]
    assert backend == {
        "kind": "openai_http", "target": "http://127.0.0.1:8000", "model": "m",
        "request_format": "/v1/chat/completions",
    }  # fmt: skip
    assert spec["spec"]["profile"] == {"kind": "concurrent"} and spec["benchmarks"] == [{"profile.streams": 32}]
    assert spec["spec"]["data"] == [{"kind": "synthetic_text", "prompt_tokens": 128, "output_tokens": 64}]
    assert spec["spec"]["constraints"] == [{"kind": "max_requests", "count": 64}]
