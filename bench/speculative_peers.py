"""The speculative benchmark's peer: llama.cpp's server with and without its own n-gram lookup
decoding (``--spec-type ngram-simple``), on the same weights as our engine, the same prompts and
the same cells, the two servers running side by side and the sides alternating chunk by chunk as
ours do.

Its lookup is set to ours: the latest 3 tokens looked up, up to ``speculative_tokens`` drafted.
Requests are non-streaming chat completions (greedy, no prompt cache); tokens are the server's own
``usage.completion_tokens``, and the drafts it proposed and kept come from the ``timings`` llama.cpp
adds to each answer, where it does."""

from __future__ import annotations

import asyncio
import time

import httpx

from bench.serve_peer_weights import WeightsUnavailable
from bench.serve_peers import LLAMACPP, PeerConfig, PeerServer, PeerUnavailable, llamacpp_server
from bench.speculative_cells import alternating_cells
from shared.settings import get_settings

NGRAM_LOOKUP = 3  # tokens matched, as our speculative_ngram_max


async def _one(http: httpx.AsyncClient, server: PeerServer, text: str, max_new: int) -> tuple[int, int, int]:
    body = {
        "model": server.served_model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_new,
        "temperature": 0.0,
        **server.request_extra,
    }
    answer = await http.post(f"{server.base_url}/v1/chat/completions", json=body)
    answer.raise_for_status()
    data = answer.json()
    timings = data.get("timings") or {}
    return data["usage"]["completion_tokens"], timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)


async def _chunk(http: httpx.AsyncClient, server: PeerServer, texts: list[str], max_new: int) -> dict:
    started = time.perf_counter()
    answers = await asyncio.gather(*(_one(http, server, t, max_new) for t in texts))
    elapsed = time.perf_counter() - started
    tokens = sum(a[0] for a in answers)
    return {
        "tokens": tokens,
        "seconds": elapsed,
        # llama.cpp reports no per-sequence steps: tokens per step is left at 1 (merge's ratio of these)
        "generated": tokens,
        "steps": tokens,
        "proposed": sum(a[1] for a in answers),
        "accepted": sum(a[2] for a in answers),
    }


async def _cells(
    servers: dict[bool, PeerServer],
    workloads: dict[str, list[str]],
    streams_list: tuple[int, ...],
    rounds: int,
    max_new: int,
) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as http:
        for speculate in (False, True):
            await _chunk(http, servers[speculate], workloads["grounded"][:2], 16)

        async def chunk(texts: list[str], speculate: bool) -> dict:
            return await _chunk(http, servers[speculate], texts, max_new)

        cells = await alternating_cells(workloads, streams_list, rounds, chunk, label="llama.cpp ")
    return [cell for cell, _ in cells]


def run_llamacpp(
    workloads: dict[str, list[str]],
    streams_list: tuple[int, ...],
    rounds: int,
    max_new: int,
    speculative_tokens: int,
    model: str,
    dtype: str,
) -> dict:
    """{"label", "command", "cells"} for llama.cpp's server without and with lookup decoding, or
    {"skipped": why} where it is not installed or does not start."""
    settings = get_settings().model_copy(update={"model": model, "max_num_seqs": max(streams_list)})
    config = PeerConfig.for_run(settings, 1024, list(streams_list), dtype)
    try:
        plain = llamacpp_server(config)
        lookup = llamacpp_server(config)
    except (PeerUnavailable, WeightsUnavailable) as exc:
        return {"skipped": str(exc)}
    lookup.command += [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NGRAM_LOOKUP),
        "--spec-ngram-simple-size-m", str(speculative_tokens),
    ]  # fmt: skip
    servers = {False: plain, True: lookup}
    try:
        for server in servers.values():
            server.start(timeout=600)
        cells = asyncio.run(_cells(servers, workloads, streams_list, rounds, max_new))
    except (PeerUnavailable, TimeoutError, httpx.HTTPError) as exc:
        return {"skipped": f"{LLAMACPP}: {exc}"}
    finally:
        for server in servers.values():
            server.stop()
    return {"label": plain.label, "command": [*lookup.command], "cells": cells}
