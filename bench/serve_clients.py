"""The load generator: one coroutine per way in (TGI SSE, OpenAI chat SSE, the queue client), and
the driver that releases requests on a Poisson clock or under a concurrency cap.

Every sender times the request itself from just before it is sent, so the three ways in are
measured by the same ruler; an error never raises out of a sender, it is recorded."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from bench.serve_dataset import ChatSample
from bench.serve_metrics import RequestResult
from shared.async_client import AsyncQueueClient
from shared.schemas import DoneEvent, ErrorEvent, SamplingSpec, TokenEvent

Sender = Callable[[ChatSample], Awaitable[RequestResult]]
ENDPOINTS = ("generate_stream", "chat", "queue")


async def sse_data(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def tgi_sender(http: httpx.AsyncClient, headers: dict[str, str], priority: int | None = None) -> Sender:
    async def send(sample: ChatSample) -> RequestResult:
        result = RequestResult(sample.prompt_len, sample.output_len)
        parameters: dict[str, Any] = {"max_new_tokens": sample.output_len, "ignore_eos": True}
        if priority is not None:
            parameters["priority"] = priority
        body = {"inputs": sample.prompt_text, "parameters": parameters}
        started = last = time.perf_counter()
        try:
            async with http.stream("POST", "/generate_stream", json=body, headers=headers) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return result
                async for data in sse_data(response):
                    if "error" in data:
                        result.error = f"{data.get('error_type')}: {data['error']}"
                        return result
                    last = result.record_token(started, time.perf_counter(), last)
                    if data.get("details"):
                        result.reported_tokens = data["details"]["generated_tokens"]
                        result.reported_prompt_tokens = data["details"]["input_length"]
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        result.latency = last - started
        result.success = result.reported_tokens is not None
        result.error = "" if result.success else "stream ended without details"
        return result

    return send


def chat_body(model: str, sample: ChatSample) -> dict[str, Any]:
    """The streaming chat request every system gets: greedy, exactly ``output_len`` tokens, usage at the end."""
    return {
        "model": model,
        "messages": sample.messages,
        "max_tokens": sample.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def chat_sender(http: httpx.AsyncClient, headers: dict[str, str], model: str, priority: int | None = None) -> Sender:
    async def send(sample: ChatSample, result: RequestResult | None = None) -> RequestResult:
        # ``result``: the caller's record, which keeps the tokens that came when the caller cancels the request.
        result = RequestResult(sample.prompt_len, sample.output_len) if result is None else result
        body = chat_body(model, sample)
        if priority is not None:
            body["priority"] = priority
        started = last = time.perf_counter()
        opened: set[int] = set()  # choices whose opening chunk has come
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return result
                async for data in sse_data(response):
                    if "error" in data:
                        result.error = f"{data['error'].get('type')}: {data['error'].get('message')}"
                        return result
                    if data.get("usage"):
                        result.reported_tokens = data["usage"]["completion_tokens"]
                        result.reported_prompt_tokens = data["usage"]["prompt_tokens"]
                    for choice in data.get("choices", []):
                        delta = choice.get("delta", {})
                        # The server sends one chunk per token after an opening chunk per choice (role, empty
                        # content, written with the first token's); every chunk names the role, as TGI's do, so
                        # the opening one is told by order and the first token is timed at its own chunk.
                        if "content" in delta and choice.get("index", 0) in opened:
                            last = result.record_token(started, time.perf_counter(), last)
                        opened.add(choice.get("index", 0))
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        result.latency = last - started
        result.success = result.reported_tokens is not None
        result.error = "" if result.success else "stream ended without usage"
        return result

    return send


def openai_chat_sender(http: httpx.AsyncClient, model: str, extra: dict[str, Any] | None = None) -> Sender:
    """Another server's OpenAI chat route (the benchmark's peers), with our chat route's request body.

    Token arrivals are timed per chunk that carries text, since a peer may send a chunk with no text (the
    role, or bytes held back for an incomplete character) or, in principle, several tokens in one. The
    token count is the server's own ``usage.completion_tokens``: the count our routes report too, and
    that ``summarize`` checks against what was asked (``ignore_eos`` makes it exact)."""

    async def send(sample: ChatSample) -> RequestResult:
        result = RequestResult(sample.prompt_len, sample.output_len)
        body = chat_body(model, sample) | (extra or {})
        started = last = time.perf_counter()
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return result
                async for data in sse_data(response):
                    if "error" in data:
                        result.error = f"error: {str(data['error'])[:200]}"
                        return result
                    if data.get("usage"):
                        result.reported_tokens = data["usage"]["completion_tokens"]
                        result.reported_prompt_tokens = data["usage"]["prompt_tokens"]
                    if any((c.get("delta") or {}).get("content") for c in data.get("choices") or []):
                        last = result.record_token(started, time.perf_counter(), last)
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        result.latency = last - started
        result.success = result.reported_tokens is not None and result.output_tokens > 0
        if result.success:
            result.chunks, result.output_tokens = result.output_tokens, result.reported_tokens or 0
        result.error = "" if result.success else "stream ended without usage or text"
        return result

    return send


def queue_sender(client: AsyncQueueClient, model: str, tenant: str | None, priority: int | None = None) -> Sender:
    async def send(sample: ChatSample) -> RequestResult:
        result = RequestResult(sample.prompt_len, sample.output_len)
        spec = SamplingSpec(max_new_tokens=sample.output_len, ignore_eos=True)
        started = last = time.perf_counter()
        try:
            request_id = await client.submit(model, sample.prompt_token_ids, spec, tenant=tenant, priority=priority)
            async for event in client.stream(request_id, timeout=600):
                if isinstance(event, TokenEvent):
                    last = result.record_token(started, time.perf_counter(), last)
                elif isinstance(event, DoneEvent):
                    result.reported_tokens = event.result.usage.completion_tokens
                    result.reported_prompt_tokens = event.result.usage.prompt_tokens
                elif isinstance(event, ErrorEvent):
                    result.error = f"{event.error_type}: {event.message}"
                    return result
        except Exception as exc:  # a benchmark records a failure and goes on
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        result.latency = last - started
        result.success = result.reported_tokens is not None
        result.error = "" if result.success else "stream ended without a result"
        return result

    return send


async def run_load(
    send: Sender,
    samples: list[ChatSample],
    *,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    offsets: list[float] | None = None,
) -> tuple[list[RequestResult], float]:
    """Releases ``samples`` in order with exponential gaps (Poisson arrivals; inf = all at once),
    or each at its own ``offsets`` (seconds from the start, non-decreasing), at most
    ``max_concurrency`` in flight; returns the results and the wall time of the whole run."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(sample: ChatSample) -> RequestResult:
        if gate is None:
            return await send(sample)
        async with gate:
            return await send(sample)

    started = time.perf_counter()
    tasks = []
    for i, sample in enumerate(samples):
        if offsets is not None:  # on an absolute clock, so the schedule does not drift with the loop's lag
            await asyncio.sleep(max(0.0, started + offsets[i] - time.perf_counter()))
        tasks.append(asyncio.create_task(one(sample)))
        if offsets is None and not math.isinf(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - started
