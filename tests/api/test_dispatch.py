"""The dispatcher's shared liveness answer, against a real Redis: many silent streams, one query."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from producer_api import dispatch
from producer_api.dispatch import Dispatcher
from shared.async_client import AsyncQueueClient
from shared.errors import UnavailableError
from shared.schemas import TokenEvent, WorkerHeartbeat
from shared.settings import Settings


class CountingClient(AsyncQueueClient):
    """The real client, counting how often it asks Redis for live workers."""

    asked = 0

    async def live_workers(self, model: str | None = None) -> list[WorkerHeartbeat]:
        self.asked += 1
        return await super().live_workers(model)


def test_silent_streams_share_one_liveness_query(redis_url: str, key_prefix: str) -> None:
    settings = Settings(redis_url=redis_url, key_prefix=key_prefix)

    async def scenario() -> None:
        async with CountingClient(settings) as client:
            dispatcher = Dispatcher(settings, client)
            answers = await asyncio.gather(*(dispatcher.is_served("m") for _ in range(500)))
            assert answers == [False] * 500 and client.asked == 1
            # A worker appears: the next window asks again and sees it.
            heartbeat = WorkerHeartbeat(
                name="w", model="m", device="cpu", dtype="float32", max_num_seqs=1, num_kv_blocks=1,
                running=0, waiting=0, free_kv_blocks=1, started_at=time.time(),
            )  # fmt: skip
            await client.redis.set(client.keys.worker("w"), heartbeat.model_dump_json())
            await client.redis.zadd(client.keys.workers(), {"w": time.time()})
            await asyncio.sleep(dispatch._SERVED_CACHE_S)
            assert await dispatcher.is_served("m") and client.asked == 2

    asyncio.run(scenario())


def test_silent_streams_set_no_timer_of_their_own_and_all_end_when_no_worker_is_left(
    redis_url: str, key_prefix: str
) -> None:
    """One watch per model checks for every followed stream; with no worker for no_worker_wait_s,
    every stream ends with 503 (the real client against a real Redis that has no worker)."""
    settings = Settings(redis_url=redis_url, key_prefix=key_prefix, no_worker_wait_s=0.5)

    async def silent() -> AsyncIterator[TokenEvent]:
        await asyncio.Event().wait()  # a request that waits in the queue
        yield TokenEvent(request_id="never", index=0, token_id=0)

    async def follow(dispatcher: Dispatcher) -> None:
        async for _ in dispatcher._watched(silent(), "m"):
            pass

    async def scenario() -> None:
        async with CountingClient(settings) as client:
            dispatcher = Dispatcher(settings, client)
            streams = [asyncio.ensure_future(follow(dispatcher)) for _ in range(300)]
            while ("m" not in dispatcher._watches or dispatcher._watches["m"].followers < 300) and not any(
                s.done() for s in streams
            ):
                await asyncio.sleep(0)  # until every stream is being followed
            loop = asyncio.get_running_loop()
            assert len(loop._scheduled) < 10, "a timer per silent stream"  # type: ignore[attr-defined]
            outcomes = await asyncio.gather(*streams, return_exceptions=True)
            assert all(isinstance(o, UnavailableError) for o in outcomes)
            assert client.asked <= 4  # shared, not one query per stream
            assert dispatcher._watches["m"].followers == 0

    asyncio.run(scenario())
