"""The API's SSE framing and stream plumbing (producer_api/sse.py, producer_api/streaming.py) on
their own: exact frames, Last-Event-ID parsing, a stream closed (and its cleanup run) when its client
leaves, n choices merged as their events come, work abandoned when the HTTP client goes away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from producer_api import metrics, sse
from producer_api.dispatch import ClientDisconnected
from producer_api.streaming import merge, unless_disconnected

# Framing ----------------------------------------------------------------------------------------


def test_an_event_is_compact_json_with_an_optional_id() -> None:
    assert sse.event({"a": 1, "b": [1, 2]}) == 'data: {"a":1,"b":[1,2]}\n\n'
    assert sse.event({"a": "é"}, event_id=7) == 'id: 7\ndata: {"a":"\\u00e9"}\n\n'
    assert sse.event("[DONE]") == "data: [DONE]\n\n" == sse.DONE
    assert sse.event({}, event_id=0) == "id: 0\ndata: {}\n\n"


@pytest.mark.parametrize(
    ("header", "index"), [(None, None), ("", None), ("  ", None), ("x", None), ("-1", None), ("1.5", None),
                          ("0", 0), ("12", 12), (" 7 ", 7)]
)  # fmt: skip
def test_last_event_id_is_a_token_index_or_nothing(header: str | None, index: int | None) -> None:
    assert sse.parse_last_event_id(header) == index


# A stream's lifetime ----------------------------------------------------------------------------


class Body:
    """An SSE body that records how far it got and whether its cleanup ran."""

    def __init__(self, frames: int | None) -> None:
        self.frames = frames  # None: never ends by itself (a request still queued)
        self.sent = 0
        self.closed = False

    async def __call__(self) -> AsyncIterator[str]:
        try:
            while self.frames is None or self.sent < self.frames:
                if self.frames is None and self.sent >= 1:
                    await asyncio.Event().wait()
                self.sent += 1
                yield sse.event({"n": self.sent})
        finally:
            self.closed = True


def gauge(route: str) -> float:
    return metrics.STREAMS_IN_FLIGHT.labels(route)._value.get()  # type: ignore[attr-defined]


async def serve(
    body: Body, route: str, *, leave_after: int | None = None, keepalive_s: float = sse.KEEPALIVE_S
) -> tuple[list[dict[str, Any]], list[float]]:
    """Runs the streaming response as an ASGI app would; the client leaves after ``leave_after``
    body messages. Returns what was sent and the in-flight gauge seen at each body message."""
    response = sse.response(body(), route, headers={"x-request-id": "r1"}, keepalive_s=keepalive_s)
    sent: list[dict[str, Any]] = []
    seen: list[float] = []
    left = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            seen.append(gauge(route))
            if leave_after is not None and len(seen) >= leave_after:
                left.set()

    async def receive() -> dict[str, Any]:
        if leave_after is None:
            await asyncio.Event().wait()
        await left.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "GET", "path": route}
    await asyncio.wait_for(response(scope, receive, send), timeout=30)
    return sent, seen


def test_a_finished_stream_sends_every_frame_with_sse_headers_and_is_counted_while_open() -> None:
    route = "/test-finished"
    before = gauge(route)
    body = Body(frames=3)
    sent, seen = asyncio.run(serve(body, route))
    start = sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"
    assert headers["x-request-id"] == "r1"
    frames = [m["body"].decode() for m in sent if m["type"] == "http.response.body" and m.get("body")]
    assert frames == [sse.event({"n": i}) for i in (1, 2, 3)]
    assert seen == [before + 1] * 3  # counted while open
    assert gauge(route) == before and body.closed


def test_a_client_leaving_an_idle_stream_closes_it_and_runs_its_cleanup() -> None:
    route = "/test-left"
    before = gauge(route)
    body = Body(frames=None)  # one frame, then silence: only the disconnect can end it
    _, seen = asyncio.run(serve(body, route, leave_after=1))
    assert body.sent == 1 and body.closed, "the body's cleanup (cancelling its request) must run"
    assert seen == [before + 1] and gauge(route) == before


def test_a_silent_stream_sends_keep_alive_comments_until_its_client_leaves() -> None:
    body = Body(frames=None)  # one frame, then silence: a request waiting in the queue
    sent, _ = asyncio.run(serve(body, "/test-keep-alive", leave_after=3, keepalive_s=0.05))
    frames = [m["body"] for m in sent if m["type"] == "http.response.body" and m.get("body")]
    assert frames == [sse.event({"n": 1}).encode(), sse.KEEPALIVE, sse.KEEPALIVE]
    assert sse.KEEPALIVE.startswith(b":")  # an SSE comment: every client skips it
    assert body.closed


def test_a_stream_whose_frames_keep_coming_sends_no_keep_alive() -> None:
    async def run() -> list[dict[str, Any]]:
        async def body() -> AsyncIterator[str]:
            for n in range(20):  # 0.2 s in all, a frame every 0.01 s
                await asyncio.sleep(0.01)
                yield sse.event({"n": n})

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "GET", "path": "/"}
        await sse.response(body(), "/test-busy", keepalive_s=0.05)(scope, receive, send)  # type: ignore[arg-type]
        return sent

    bodies = [m.get("body") for m in asyncio.run(run()) if m["type"] == "http.response.body"]
    assert len([b for b in bodies if b]) == 20 and sse.KEEPALIVE not in bodies


# Merging n choices --------------------------------------------------------------------------------


async def items(name: str, count: int, gate: asyncio.Event | None = None, fail: bool = False) -> AsyncIterator[str]:
    for i in range(count):
        if gate is not None and i == 1:
            await gate.wait()
        yield f"{name}{i}"
    if fail:
        raise RuntimeError(f"{name} broke")


def test_one_stream_passes_through_tagged_zero() -> None:
    async def run() -> list[tuple[int, str]]:
        return [x async for x in merge([items("a", 3)])]

    assert asyncio.run(run()) == [(0, "a0"), (0, "a1"), (0, "a2")]


def test_streams_interleave_as_their_events_come_each_tagged_with_its_index() -> None:
    async def run() -> list[tuple[int, str]]:
        gate = asyncio.Event()
        out = []
        async for index, item in merge([items("a", 3, gate), items("b", 2)]):
            out.append((index, item))
            if len([o for o in out if o[0] == 1]) == 2:
                gate.set()  # "a" continues only once "b" is done: b's events came while a waited
        return out

    out = asyncio.run(run())
    assert sorted(out) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    assert out.index((1, "b1")) < out.index((0, "a1"))
    assert [i for _, i in out if i.startswith("a")] == ["a0", "a1", "a2"]  # each stream in its order


def test_a_failing_stream_fails_the_merge_and_the_others_are_closed() -> None:
    closed = []

    async def endless(name: str) -> AsyncIterator[str]:
        try:
            yield f"{name}0"
            await asyncio.Event().wait()
            yield "never"
        finally:
            closed.append(name)

    async def run() -> list[tuple[int, str]]:
        out = []
        with pytest.raises(RuntimeError, match="b broke"):
            async for pair in merge([endless("a"), items("b", 1, fail=True)]):
                out.append(pair)
        return out

    out = asyncio.run(run())
    assert (1, "b0") in out
    assert closed == ["a"]


def test_leaving_a_merge_early_closes_every_stream() -> None:
    closed = []

    async def endless(name: str) -> AsyncIterator[str]:
        try:
            while True:
                yield name
                await asyncio.sleep(0)
        finally:
            closed.append(name)

    async def run() -> None:
        async with contextlib.aclosing(merge([endless("a"), endless("b")])) as merged:
            async for _ in merged:
                break

    asyncio.run(run())
    assert sorted(closed) == ["a", "b"]


# Work abandoned with its client -------------------------------------------------------------------


class FakeRequest:
    def __init__(self, disconnect_after: int | None) -> None:
        self.asked = 0
        self.disconnect_after = disconnect_after

    async def is_disconnected(self) -> bool:
        self.asked += 1
        return self.disconnect_after is not None and self.asked >= self.disconnect_after


def test_work_that_finishes_returns_its_result() -> None:
    async def work() -> str:
        await asyncio.sleep(0)
        return "result"

    assert asyncio.run(unless_disconnected(FakeRequest(None), work(), poll_s=0.01)) == "result"  # type: ignore[arg-type]


def test_work_whose_client_left_is_cancelled_and_raises_client_disconnected() -> None:
    cancelled = asyncio.Event()

    async def run() -> None:
        async def work() -> str:
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()
            return "never"

        request = FakeRequest(disconnect_after=2)
        with pytest.raises(ClientDisconnected):
            await unless_disconnected(request, work(), poll_s=0.01)  # type: ignore[arg-type]
        assert request.asked == 2 and cancelled.is_set()

    asyncio.run(run())


def test_an_error_of_the_work_reaches_the_caller() -> None:
    async def work() -> str:
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        asyncio.run(unless_disconnected(FakeRequest(None), work(), poll_s=0.01))  # type: ignore[arg-type]
