"""The low-load phase: each prompt sent alone through every system in turn (the offline engine and
each way into the stack), the order rotating from prompt to prompt, with the machine idle between.

What a serving path adds to time to first token is a few milliseconds on top of a prefill of
~100-700 ms that drifts by more than that from minute to minute on a shared 2-core box. Measured
as separate runs, the p50s of two systems differ by their prompts and by the drift between runs;
interleaved, every system meets the same prompt within a second or two, so the per-prompt
difference cancels both, and its median is the estimate (with its quartiles as the spread)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from bench.serve_dataset import ChatSample
from bench.serve_metrics import RequestResult

OneRequest = Callable[[ChatSample], Awaitable[RequestResult]]

# Idle time before each request: the previous system's threads (OpenMP spin-waits, the publisher's
# flush) settle, so no request shares the CPU with the tail of another.
GAP_S = 0.2


async def interleaved(
    systems: dict[str, OneRequest], samples: list[ChatSample], gap_s: float = GAP_S
) -> dict[str, tuple[list[RequestResult], float]]:
    """Per system: its results in sample order, and the wall time its requests took in all."""
    names = list(systems)
    results: dict[str, list[RequestResult]] = {name: [] for name in names}
    busy = dict.fromkeys(names, 0.0)
    for i, sample in enumerate(samples):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            await asyncio.sleep(gap_s)
            started = time.perf_counter()
            results[name].append(await systems[name](sample))
            busy[name] += time.perf_counter() - started
    return {name: (results[name], busy[name]) for name in names}


def paired_added_ms(path: list[RequestResult], base: list[RequestResult]) -> dict[str, Any]:
    """TTFT ``path`` adds over ``base`` on the same prompts: the median per-prompt difference, in ms."""
    diffs = [(p.ttft - b.ttft) * 1000.0 for p, b in zip(path, base, strict=True) if p.success and b.success]
    if not diffs:
        return {"median": float("nan"), "p25": float("nan"), "p75": float("nan"), "pairs": 0}
    arr = np.asarray(diffs)
    return {
        "median": round(float(np.median(arr)), 2),
        "p25": round(float(np.percentile(arr, 25)), 2),
        "p75": round(float(np.percentile(arr, 75)), 2),
        "pairs": len(diffs),
    }
