"""The speculative benchmark through the whole stack: ``inflightq api`` and one ``inflightq worker``
on a key prefix of their own, every request a streaming OpenAI chat completion (the ``openai``
client) that says ``speculate`` on or off, the two sides alternating chunk by chunk as offline.

Tokens are the server's own ``usage.completion_tokens``; the worker's Prometheus counters give the
proposed and kept draft tokens and the tokens per sequence-step of each side."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx

from bench.affinity import scrape_text
from bench.serve_stack import Stack
from bench.speculative_cells import alternating_cells
from shared.settings import get_settings

_COUNTERS = ("engine_generated_tokens", "engine_token_steps", "engine_draft_tokens", "engine_draft_accepted_tokens")


async def _counters(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    scraped = scrape_text((await http.get(url)).text)
    return {name: scraped.get(f"{name}_total", 0.0) for name in _COUNTERS}


async def _one(client: Any, model: str, text: str, max_new: int, speculate: bool) -> int:
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=max_new,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"speculate": speculate},
    )
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if not tokens:
        raise RuntimeError("a stream ended without usage")
    return tokens


async def _chunk(
    client: Any, http: httpx.AsyncClient, url: str, model: str, texts: list[str], max_new: int, speculate: bool
) -> dict:
    before = await _counters(http, url)
    started = time.perf_counter()
    tokens = await asyncio.gather(*(_one(client, model, t, max_new, speculate) for t in texts))
    elapsed = time.perf_counter() - started
    after = await _counters(http, url)
    generated, steps, proposed, kept = (after[n] - before[n] for n in _COUNTERS)
    return {
        "tokens": sum(tokens),
        "seconds": elapsed,
        "generated": int(generated),
        "steps": int(steps),
        "proposed": int(proposed),
        "accepted": int(kept),
    }


async def _cells(
    stack: Stack, key: str, workloads: dict[str, list[str]], streams_list: tuple[int, ...], rounds: int, max_new: int
) -> list[dict]:
    from openai import AsyncOpenAI

    model = stack.settings.model
    url = stack.metrics_urls[0]
    async with httpx.AsyncClient(timeout=30) as http:
        client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0, timeout=600)
        # Warm-up: each side once, so neither pays the first request's costs.
        for speculate in (False, True):
            await _chunk(client, http, url, model, workloads["grounded"][:2], 16, speculate)

        async def chunk(texts: list[str], speculate: bool) -> dict:
            return await _chunk(client, http, url, model, texts, max_new, speculate)

        cells = await alternating_cells(workloads, streams_list, rounds, chunk, label="stack ")
        await client.close()
    return [cell for cell, _ in cells]


def run_stack(
    workloads: dict[str, list[str]],
    streams_list: tuple[int, ...],
    rounds: int,
    max_new: int,
    speculative_tokens: int,
    model: str,
    dtype: str,
) -> list[dict]:
    """Each cell of the offline table, measured through the API and a worker on the configured Redis."""
    base = get_settings()
    settings = base.model_copy(
        update={
            "model": model,
            "dtype": dtype,
            "key_prefix": f"bench-speculative-{uuid.uuid4().hex[:8]}",
            "max_num_seqs": max(streams_list),
            "num_kv_blocks": base.num_kv_blocks or 3072,
        }
    )
    key = f"bench-{uuid.uuid4().hex[:12]}"
    env = {"INFLIGHTQ_SPECULATIVE_TOKENS": str(speculative_tokens), "INFLIGHTQ_SPECULATE_BY_DEFAULT": "false"}
    stack = Stack(settings, [key], worker_metrics=True, extra_env=env)
    try:
        stack.start()
        return asyncio.run(_cells(stack, key, workloads, streams_list, rounds, max_new))
    finally:
        stack.stop()
