"""Server-sent events: framing, and the streaming response that owns a stream's lifetime."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

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


# Bound on a stream's cleanup (closing its Redis subscription, cancelling its request).
_CLEANUP_TIMEOUT_S = 5.0


class EventStreamResponse(StreamingResponse):
    """A stream that notices its client leaving even while no event is due (a request still queued),
    and then closes its body at once, so the body's cleanup cancels the request.

    Starlette alone notices an idle disconnect only on servers speaking ASGI < 2.4 (on newer ones, only
    when the next send fails), and leaves closing the body generator to the garbage collector."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def watch() -> None:
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                await self.stream_response(send)
            except OSError:
                pass  # the client went away mid-send
            finally:
                with anyio.move_on_after(_CLEANUP_TIMEOUT_S, shield=True):
                    await self.body_iterator.aclose()  # type: ignore[union-attr]
                group.cancel_scope.cancel()


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

    return EventStreamResponse(counted(), media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})
