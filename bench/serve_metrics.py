"""What one request measured, and the run's summary in ``vllm bench serve``'s terms.

TTFT: send -> first token. TPOT: (e2e - TTFT) / (output tokens - 1), per request. ITL: every gap
between consecutive tokens of a request, pooled over requests. E2E: send -> last event. Times are
kept in seconds and reported in milliseconds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # what the request asked for (ignore_eos makes it exact)
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0  # token events seen on the stream
    reported_tokens: int | None = None  # the server's own count (usage / details), when it gives one
    reported_prompt_tokens: int | None = None
    chunks: int | None = None  # stream chunks with text, where they need not be one per token (the peers)

    def record_token(self, started: float, now: float, last: float) -> float:
        if self.output_tokens == 0:
            self.ttft = now - started
        else:
            self.itl.append(now - last)
        self.output_tokens += 1
        return now


def stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    out = {"mean": round(float(arr.mean()), 2)}
    out.update({f"p{p}": round(float(np.percentile(arr, p)), 2) for p in PERCENTILES})
    return out


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    done = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.success})
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors[:5],
        "duration_s": round(duration_s, 3),
        "total_input_tokens": sum(r.prompt_len for r in done),
        "total_output_tokens": output_tokens,
        "requested_output_tokens": sum(r.output_len for r in results),
        "token_count_mismatches": sum(
            1 for r in done if r.output_tokens != r.output_len or r.reported_tokens not in (None, r.output_tokens)
        ),
        # The server tokenized the same chat-templated prompt to as many tokens as our tokenizer did: the same
        # template and vocabulary (what makes the peers' figures comparable with ours).
        "prompt_token_mismatches": sum(1 for r in done if r.reported_prompt_tokens not in (None, r.prompt_len)),
        # Requests whose text came in fewer stream chunks than tokens (a peer holding bytes back): their ITL
        # gaps are per chunk, while TPOT still divides by tokens.
        "chunked_requests": sum(1 for r in done if r.chunks is not None and r.chunks != r.output_tokens),
        # Each request's own clock must add up: first token before the last, gaps summing to the span between.
        "timing_inconsistencies": sum(
            1 for r in done if r.ttft > r.latency or abs(r.ttft + sum(r.itl) - r.latency) > 1e-6
        ),
        "request_throughput": round(len(done) / duration_s, 3) if duration_s > 0 else math.nan,
        "output_throughput": round(output_tokens / duration_s, 2) if duration_s > 0 else math.nan,
        "ttft_ms": stats_ms([r.ttft for r in done]),
        "tpot_ms": stats_ms(tpots),
        "itl_ms": stats_ms([gap for r in done for gap in r.itl]),
        "e2e_ms": stats_ms([r.latency for r in done]),
    }


def print_summary(title: str, m: dict[str, Any]) -> None:
    """vllm bench serve's console block, one run."""
    print(f"{'=' * 16} {title} {'=' * max(4, 50 - len(title))}")
    rows = [
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Benchmark duration (s)", m["duration_s"]),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total generated tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", m["request_throughput"]),
        ("Output token throughput (tok/s)", m["output_throughput"]),
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = m[f"{name}_ms"]
        rows.append(
            (f"{name.upper()} ms mean / p50 / p90 / p99", f"{s['mean']} / {s['p50']} / {s['p90']} / {s['p99']}")
        )
    for label, value in rows:
        print(f"{label:<42}{value}")
    if m["errors"]:
        print(f"{'Errors':<42}{'; '.join(m['errors'])}")
