"""Server-sent events: framing, and the streaming response that owns a stream's lifetime."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from producer_api import metrics

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
DONE = "data: [DONE]\n\n"


def event(data: Any, *, event_id: int | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {payload}\n\n"


def parse_last_event_id(value: str | None) -> int | None:
    """Last-Event-ID as a token index; anything else means 'from the start'."""
    if value is None or not value.strip().isdigit():
        return None
    return int(value.strip())


def response(body: AsyncIterator[str], route: str, headers: dict[str, str] | None = None) -> StreamingResponse:
    async def counted() -> AsyncIterator[str]:
        gauge = metrics.STREAMS_IN_FLIGHT.labels(route)
        gauge.inc()
        try:
            async for chunk in body:
                yield chunk
        finally:
            # Closing `body` runs its own cleanup (cancelling the request if it did not finish).
            await body.aclose()  # type: ignore[attr-defined]
            gauge.dec()

    return StreamingResponse(counted(), media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})
