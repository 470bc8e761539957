"""Server-sent events: framing, and the streaming response that owns a stream's lifetime."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from producer_api import metrics

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
DONE = "data: [DONE]\n\n"


def event(data: Any, *, event_id: int | None = None, name: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"id: {event_id}\n" if event_id is not None else ""
    if name is not None:
        head += f"event: {name}\n"
    return f"{head}data: {payload}\n\n"


def parse_last_event_id(value: str | None) -> int | None:
    """Last-Event-ID as a token index; anything else means 'from the start'."""
    if value is None or not value.strip().isdigit():
        return None
    return int(value.strip())


# Bound on a stream's cleanup (closing its Redis subscription, cancelling its request).
_CLEANUP_TIMEOUT_S = 5.0
# A comment frame goes out after this long without a frame, as TGI sends them: a proxy must not close
# a stream whose request still waits in the queue (nginx closes one silent for 60 s by default).
KEEPALIVE_S = 15.0
KEEPALIVE = b": keep-alive\n\n"


class EventStreamResponse(StreamingResponse):
    """A stream that notices its client leaving even while no event is due (a request still queued),
    and then closes its body at once, so the body's cleanup cancels the request; while no event is
    due it sends a keep-alive comment every ``keepalive_s``, which every SSE client skips.

    Starlette alone notices an idle disconnect only on servers speaking ASGI < 2.4 (on newer ones, only
    when the next send fails), and leaves closing the body generator to the garbage collector."""

    def __init__(self, *args: Any, keepalive_s: float = KEEPALIVE_S, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keepalive_s = keepalive_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lock = anyio.Lock()  # a keep-alive never interleaves with a frame
        last_sent: float | None = None  # None before the status line and after the last frame

        async def send_locked(message: Message) -> None:
            nonlocal last_sent
            async with lock:
                await send(message)
                ended = message["type"] == "http.response.body" and not message.get("more_body", False)
                last_sent = None if ended else anyio.current_time()

        async def keep_alive() -> None:
            nonlocal last_sent
            while True:
                due = self.keepalive_s if last_sent is None else last_sent + self.keepalive_s - anyio.current_time()
                await anyio.sleep(max(0.0, due))
                async with lock:
                    if last_sent is None or anyio.current_time() - last_sent < self.keepalive_s:
                        continue
                    try:
                        await send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
                    except OSError:
                        return  # the client went away; the watcher ends the stream
                    last_sent = anyio.current_time()

        async with anyio.create_task_group() as group:

            async def watch() -> None:
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()

            group.start_soon(watch)
            group.start_soon(keep_alive)
            try:
                await self.stream_response(send_locked)
            except OSError:
                pass  # the client went away mid-send
            finally:
                with anyio.move_on_after(_CLEANUP_TIMEOUT_S, shield=True):
                    await self.body_iterator.aclose()  # type: ignore[union-attr]
                group.cancel_scope.cancel()


def response(
    body: AsyncIterator[str], route: str, headers: dict[str, str] | None = None, *, keepalive_s: float = KEEPALIVE_S
) -> StreamingResponse:
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

    return EventStreamResponse(
        counted(),
        media_type="text/event-stream",
        headers={**SSE_HEADERS, **(headers or {})},
        keepalive_s=keepalive_s,
    )
