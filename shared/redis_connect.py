"""Connecting to Redis: a standalone server, or a Redis Cluster through redis-py's own Cluster
client (``INFLIGHTQ_REDIS_CLUSTER=true``; ``INFLIGHTQ_REDIS_URL`` names any one node, the
client discovers the rest and follows failovers and resharding).

What else differs on a Cluster: where keys live (``shared.keys``), sharded token channels
(``shared.event_delivery.publish_command``, ``shared.subscriptions``), and a worker's token
events grouped by slot (``worker.publisher``)."""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from shared.client_core import redis_kwargs
from shared.settings import Settings

# Options the Cluster client does not take (it sizes pools per node itself).
_NOT_FOR_CLUSTER = ("retry_on_error",)


def connect(settings: Settings, **options: Any) -> redis.Redis | RedisCluster:
    """A sync client for the settings' Redis; ``options`` default to ``redis_kwargs``."""
    kwargs = options or redis_kwargs(settings)
    if settings.redis_cluster:
        return RedisCluster.from_url(settings.redis_url, **_for_cluster(kwargs))
    return redis.Redis.from_url(settings.redis_url, **kwargs)


def connect_async(settings: Settings, **options: Any) -> aioredis.Redis | AsyncRedisCluster:
    """The asyncio twin of ``connect``; ``options`` default to ``redis_kwargs(asyncio=True)``
    (redis.asyncio's own Retry: the sync one does not retry an asyncio client)."""
    kwargs = options or redis_kwargs(settings, asyncio=True)
    if settings.redis_cluster:
        return AsyncRedisCluster.from_url(settings.redis_url, **_for_cluster(kwargs))
    return aioredis.Redis.from_url(settings.redis_url, **kwargs)


def _for_cluster(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in _NOT_FOR_CLUSTER}


def is_cluster_client(client: Any) -> bool:
    return isinstance(client, RedisCluster | AsyncRedisCluster)


def primaries(client: RedisCluster) -> list[redis.Redis]:
    """A plain client for each master of a Cluster (DBSIZE, INFO, SCAN per node)."""
    return [client.get_redis_connection(node) for node in client.get_primaries()]
