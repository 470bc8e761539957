"""What waits for a slow streaming client is bounded in bytes (stream_buffer_bytes): a multi-choice
stream's merged events, and each choice's unread pub/sub messages; past it the client gets a
slow_reader error event in its dialect. (The API process's memory under slow readers at the default
settings: test_slow_reader_memory.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from producer_api.relay import relay
from producer_api.tgi.formatting import TgiStream
from shared.errors import SlowReaderError
from shared.schemas import AnyEvent, TokenEvent, TopLogprob
from shared.settings import Settings
from shared.subscriptions import ChannelHub
from tests.conftest import RedisBackend

CAP = 64 * 1024  # the smallest cap the setting allows


def heavy_token(request_id: str, index: int) -> TokenEvent:
    """A token as a request with top_logprobs=20 streams it (about 1.3 KB as JSON)."""
    tops = [TopLogprob(token_id=i, logprob=-i / 3, text=f" tok{i}") for i in range(20)]
    return TokenEvent(request_id=request_id, index=index, token_id=1, text=" x", logprob=-0.5, top_logprobs=tops)


def test_a_multi_choice_reader_past_the_byte_cap_gets_the_slow_reader_event() -> None:
    per_choice = 200  # 4 choices x 200 x ~1.3 KB: several times the cap, far below the event cap

    async def choice(i: int) -> AsyncIterator[AnyEvent]:
        for index in range(per_choice):
            yield heavy_token(f"r{i}", index)
            await asyncio.sleep(0)
        await asyncio.Event().wait()  # still generating

    async def slow_reader() -> list[str]:
        settings = Settings(stream_buffer_bytes=CAP)
        frames = relay([choice(i) for i in range(4)], TgiStream(seed=None, special_ids=frozenset()), settings=settings)
        out = [await anext(frames)]
        await asyncio.sleep(0.5)  # reads nothing while the choices keep coming
        out.extend([frame async for frame in frames])
        return out

    frames = asyncio.run(slow_reader())
    last = json.loads(frames[-1].removeprefix("data:"))
    assert last["error_type"] == "slow_reader" and "bytes" in last["error"]
    assert len(frames) < 4 * per_choice / 2  # cut off long before everything was relayed


def test_a_fast_reader_is_never_cut_off_by_the_byte_cap() -> None:
    async def choice(i: int) -> AsyncIterator[AnyEvent]:
        for index in range(200):
            yield heavy_token(f"r{i}", index)
            await asyncio.sleep(0.001)

    async def reader() -> list[str]:
        frames = relay(
            [choice(i) for i in range(4)],
            TgiStream(seed=None, special_ids=frozenset()),
            settings=Settings(stream_buffer_bytes=CAP),
        )
        return [frame async for frame in frames]

    frames = asyncio.run(reader())
    assert len(frames) == 800 and "slow_reader" not in frames[-1]


def test_a_choices_unread_messages_past_the_byte_cap_are_dropped_and_its_reader_told(
    redis_backend: RedisBackend, key_prefix: str
) -> None:
    if redis_backend.cluster:
        pytest.skip("one standalone Redis is enough for the hub's own queue")
    message = "x" * 1024

    async def run() -> None:
        client = aioredis.Redis.from_url(redis_backend.url, decode_responses=True)
        hub = ChannelHub(client, max_unread_bytes=CAP)
        channel = f"{{{key_prefix}}}:bytes-test"
        try:
            slow, fast = hub.subscription(), hub.subscription()
            await slow.subscribe(channel, 5)
            await fast.subscribe(channel, 5)
            got = 0
            for _ in range(2 * CAP // len(message)):
                await client.publish(channel, message)
                got += (await fast.get_message(5)) == message  # one reader keeps up...
            assert got == 2 * CAP // len(message)
            assert slow.follower.queue.qsize() == 1  # ...the other's backlog is gone from memory
            with pytest.raises(SlowReaderError):
                await slow.get_message(1)
            await slow.aclose()
            await fast.aclose()
        finally:
            await hub.close()
            await client.aclose()

    asyncio.run(run())
