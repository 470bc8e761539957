"""Async plumbing for relays: n choices' event streams merged into one, and work abandoned when
its HTTP client goes away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
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


async def merge(streams: list[AsyncIterator[T]], max_buffered: int = 4096) -> AsyncIterator[tuple[int, T]]:
    """Interleaves n choices' streams as events arrive, tagged with the choice index.

    The choices are read as fast as they come, so a client that reads slower than that leaves
    events waiting here: at most ``max_buffered`` of them. Past that the choices stop being read
    (their subscriptions close) and the client gets ``SlowReaderError`` as soon as it asks for
    the next event; other clients never notice. (A single stream needs no buffer: it is read only
    as fast as its client takes events.)"""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:  # type: ignore[type-var]
            async for item in stream:
                yield 0, item
        return
    # Holds at most max_buffered events, plus one end marker (and maybe an error) per stream.
    queue: asyncio.Queue[tuple[int, T] | tuple[int, BaseException] | None] = asyncio.Queue()
    overflowed = False

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        nonlocal overflowed
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    if overflowed or queue.qsize() >= max_buffered:
                        overflowed = True
                        return
                    queue.put_nowait((i, item))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            item = await queue.get()
            if overflowed:
                raise SlowReaderError(
                    f"the client read too slowly: {max_buffered} events waited unread, so the stream was dropped"
                )
            if item is None:
                open_streams -= 1
                continue
            if isinstance(item[1], BaseException):
                raise item[1]
            yield item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        # Shielded: this runs while the reader is being cancelled (its client left), and each
        # choice's own cleanup (cancelling its request) must finish.
        with anyio.CancelScope(shield=True):
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
