"""Async plumbing for relays: n choices' event streams merged into one, and work abandoned when
its HTTP client goes away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from fastapi import Request

from producer_api.dispatch import ClientDisconnected
from shared.errors import SlowReaderError

T = TypeVar("T")


async def unless_disconnected(request: Request, work: Awaitable[T], poll_s: float = 0.25) -> T:
    """Runs ``work``; if the HTTP client goes away first, cancels it (its cleanup cancels the request)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def merge(
    streams: list[AsyncIterator[T]],
    max_buffered: int = 4096,
    max_bytes: int = 1024 * 1024,
    size: Callable[[T], int] = lambda _: 0,
) -> AsyncIterator[tuple[int, T]]:
    """Interleaves n choices' streams as events arrive, tagged with the choice index.

    The choices are read as fast as they come, so a client that reads slower than that leaves
    events waiting here: at most ``max_buffered`` of them, of at most ``max_bytes`` together
    (each event's ``size``). Past either the choices stop being read
    (their subscriptions close) and the client gets ``SlowReaderError`` as soon as it asks for
    the next event; other clients never notice. (A single stream is read only as fast as its
    client takes events: what waits for it waits in its subscription, bounded in bytes likewise.)"""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:  # type: ignore[type-var]
            async for item in stream:
                yield 0, item
        return
    # Holds at most max_buffered events, plus one end marker (and maybe an error) per stream.
    queue: asyncio.Queue[tuple[int, T, int] | tuple[int, BaseException, int] | None] = asyncio.Queue()
    overflowed = False
    buffered_bytes = 0

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        nonlocal overflowed, buffered_bytes
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    item_bytes = size(item)
                    if overflowed or queue.qsize() >= max_buffered or buffered_bytes + item_bytes > max_bytes:
                        overflowed = True
                        return
                    buffered_bytes += item_bytes
                    queue.put_nowait((i, item, item_bytes))
        except Exception as exc:
            queue.put_nowait((i, exc, 0))
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            item = await queue.get()
            if overflowed:
                raise SlowReaderError(
                    f"the client read too slowly: more than {max_buffered} events or {max_bytes} bytes waited "
                    "unread, so the stream was dropped"
                )
            if item is None:
                open_streams -= 1
                continue
            choice, event, event_bytes = item
            if isinstance(event, BaseException):
                raise event
            buffered_bytes -= event_bytes
            yield choice, event
    finally:
        for task in tasks:
            task.cancel()
        # Shielded: this runs while the reader is being cancelled (its client left), and each
        # choice's own cleanup (cancelling its request) must finish.
        with anyio.CancelScope(shield=True):
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
