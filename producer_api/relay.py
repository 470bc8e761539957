"""The one SSE relay: a request's events (n choices merged as they come) -> one dialect's frames.

Every streaming route (TGI's, OpenAI's chat and completions, Responses, jobs) runs this loop; a
``Formatter`` says only how events look in its dialect. What the loop reads is already positioned
and policed by ``Dispatcher.events``: where a resumed stream starts (Last-Event-ID, starting_after),
the request's deadline, cancelling a request whose stream ends unfinished (the client left) unless
the route keeps it (jobs, background responses). What waits for a slow client is bounded: n choices
in a buffer of at most ``stream_buffer_events`` events and ``stream_buffer_bytes`` bytes
(``streaming.merge``), one choice's unread messages at most ``stream_buffer_bytes``
(``shared.subscriptions``); past either the client gets a ``slow_reader`` error event. Keep-alive
comments and noticing the client leaving belong to the response (``sse.EventStreamResponse``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi.responses import StreamingResponse

from producer_api import sse
from producer_api.errors import normalize
from producer_api.streaming import merge
from shared.errors import InflightqError
from shared.schemas import AnyEvent, DoneEvent, ErrorEvent, FinalResult, TokenEvent
from shared.settings import Settings


class Formatter(Protocol):
    """One dialect's frames for one stream; ``choice`` is the index of the choice an event belongs to."""

    def opening(self) -> list[str]:
        """Frames before the first event."""
        ...

    def token(self, choice: int, event: TokenEvent) -> list[str]: ...

    def done(self, choice: int, result: FinalResult) -> list[str]: ...

    def failed(self, choice: int, event: ErrorEvent) -> list[str]:
        """Frames for a choice that ended in an error event; the stream ends after them and ``closing``."""
        ...

    async def closing(self) -> list[str]:
        """Frames after the last event."""
        ...

    def error(self, error: InflightqError) -> list[str]:
        """The last frames of a stream that failed while following its events (after its status line)."""
        ...


def event_bytes(event: AnyEvent) -> int:
    """What an event weighs in a stream's buffer: its size as JSON."""
    return len(event.model_dump_json())


async def relay(
    streams: list[AsyncIterator[AnyEvent]], formatter: Formatter, *, settings: Settings
) -> AsyncIterator[str]:
    try:
        for frame in formatter.opening():
            yield frame
        buffered = merge(streams, settings.stream_buffer_events, settings.stream_buffer_bytes, event_bytes)
        async with contextlib.aclosing(buffered) as merged:
            async for choice, event in merged:
                if isinstance(event, TokenEvent):
                    frames = formatter.token(choice, event)
                elif isinstance(event, DoneEvent):
                    frames = formatter.done(choice, event.result)
                else:
                    for frame in formatter.failed(choice, event):
                        yield frame
                    break  # one failed choice ends the response; leaving cancels the others
                for frame in frames:
                    yield frame
        for frame in await formatter.closing():
            yield frame
    except Exception as exc:
        for frame in formatter.error(normalize(exc)):
            yield frame


def stream_response(
    streams: list[AsyncIterator[AnyEvent]],
    formatter: Formatter,
    *,
    route: str,
    settings: Settings,
    headers: dict[str, str] | None = None,
) -> StreamingResponse:
    """The SSE response relaying ``streams``; ``route`` labels its metrics."""
    return sse.response(relay(streams, formatter, settings=settings), route, headers=headers)
