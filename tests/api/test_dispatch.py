"""The dispatcher's shared liveness answer, against a real Redis: many silent streams, one query."""

from __future__ import annotations

import asyncio
import time

from producer_api import dispatch
from producer_api.dispatch import Dispatcher
from shared.async_client import AsyncQueueClient
from shared.schemas import WorkerHeartbeat
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
