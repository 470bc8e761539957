"""The asyncio command pool: a bounded number of Redis connections, and callers past the bound wait.

redis.asyncio opens a pooled connection whenever more commands are in flight than it has idle
connections, and keeps it: an API replica's pool follows the peak of commands in flight at once,
thousands of connections for an API with many open streams (``bench streams``, docs/benchmarks.md).
Bounded here, with redis-py's own means:

- standalone: ``redis.asyncio.BlockingConnectionPool``: past ``max_connections`` a command waits
  for a connection to come back, up to ``wait_s``;
- Cluster: redis-py's asyncio Cluster client has a per-node ``max_connections`` too, but past it
  raises ``MaxConnectionsError`` at once instead of waiting. ``BoundedRedisCluster`` puts a
  semaphore of that size in front of every command and pipeline: at most ``max_connections``
  commands are in flight at once, so no node ever needs more connections than that, and a caller
  past the bound waits for a free slot.

A wait past ``wait_s`` raises ``redis.ConnectionError`` (what the pool itself raises): the API's
outage handling answers 503 with Retry-After, a followed stream pauses and checks its log, as for
any unreachable Redis. The pub/sub side is one connection per node already
(``shared.subscriptions.ChannelHub``); on a standalone Redis it is taken from this pool."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster

# The bounded Cluster client whose slot the current task holds: a pipeline that re-sends a
# redirected (MOVED/ASK) command through the client's ``execute_command`` must not wait for a
# second slot of its own (with every slot held by such pipelines, none would ever come back).
_HOLDER: ContextVar[BoundedRedisCluster | None] = ContextVar("inflightq_redis_slot_holder", default=None)


def blocking_client(url: str, max_connections: int, wait_s: float, **kwargs: Any) -> aioredis.Redis:
    """A standalone redis.asyncio client on a pool of at most ``max_connections`` that waits."""
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=wait_s, **kwargs)
    return aioredis.Redis.from_pool(pool)  # closing the client closes its pool


class BoundedRedisCluster(RedisCluster):
    """redis-py's asyncio Cluster client, at most ``max_connections`` commands in flight at once
    (and so at most that many connections per node); ``wait_s`` bounds the wait for a slot."""

    def __init__(self, *args: Any, max_connections: int, wait_s: float, **kwargs: Any) -> None:
        super().__init__(*args, max_connections=max_connections, **kwargs)
        self.wait_s = wait_s
        self.slots = asyncio.Semaphore(max_connections)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if _HOLDER.get() is self:
            yield
            return
        try:
            async with asyncio.timeout(self.wait_s):
                await self.slots.acquire()
        except TimeoutError as error:
            raise redis.ConnectionError(f"no Redis connection came free within {self.wait_s:g} s") from error
        token = _HOLDER.set(self)
        try:
            yield
        finally:
            _HOLDER.reset(token)
            self.slots.release()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.slot():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:  # what redis-py's own pipeline() refuses
            return super().pipeline(transaction, shard_hint)
        return _BoundedPipeline(self, transaction)


class _BoundedPipeline(ClusterPipeline):
    """One slot for the whole pipeline: it holds at most one connection per node at once."""

    cluster_client: BoundedRedisCluster

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        async with self.cluster_client.slot():
            return await super().execute(raise_on_error, allow_redirections)
