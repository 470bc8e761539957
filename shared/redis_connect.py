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
from redis.cluster import PRIMARY, RedisCluster

from shared.client_core import redis_kwargs
from shared.redis_pool import BoundedRedisCluster, blocking_client
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
    (redis.asyncio's own Retry: the sync one does not retry an asyncio client).

    Its command pool is bounded and waits (``shared.redis_pool``): at most ``max_connections``
    (``api_redis_max_connections`` unless given) per node, and a command past them waits up to
    ``api_redis_pool_wait_s`` for a free one, then raises ``redis.ConnectionError``."""
    kwargs = dict(options or redis_kwargs(settings, asyncio=True))
    max_connections = kwargs.pop("max_connections", settings.api_redis_max_connections)
    wait_s = settings.api_redis_pool_wait_s
    if settings.redis_cluster:
        return BoundedRedisCluster.from_url(
            settings.redis_url, max_connections=max_connections, wait_s=wait_s, **_for_cluster(kwargs)
        )
    return blocking_client(settings.redis_url, max_connections, wait_s, **kwargs)


def _for_cluster(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in _NOT_FOR_CLUSTER}


def is_cluster_client(client: Any) -> bool:
    return isinstance(client, RedisCluster | AsyncRedisCluster)


def refresh_topology(client: object) -> None:
    """After a failed command on a Cluster: ask the Cluster again who serves which slots.

    redis-py does this itself after a plain command's connection error, but not reliably after a
    pipeline's: a pipeline may keep connecting to a dead master after its replica's promotion,
    while the client's other commands have moved on. A no-op for a standalone client; an
    unreachable Cluster is left for the next try."""
    if isinstance(client, RedisCluster):
        try:
            client.nodes_manager.initialize()
        except (redis.RedisError, OSError):
            pass


def primaries(client: RedisCluster) -> list[redis.Redis]:
    """A plain client for each master of a Cluster (DBSIZE, INFO, SCAN per node)."""
    return [client.get_redis_connection(node) for node in client.get_primaries()]


def load_script(client: redis.Redis | RedisCluster, script: str) -> str:
    """SCRIPT LOAD everywhere an EVALSHA of ``script`` may land; returns its SHA.

    On a Cluster that is every node, replicas included: scripts are not replicated, so a replica
    promoted by a failover answers NOSCRIPT to every call its dead master knew, and a load sent
    to "the primaries" of a client whose view of the Cluster predates the failover misses it
    (seen: a publisher reloading and retrying forever). So the client first asks the Cluster who
    serves what now, and a replica that is down is skipped (it will get the script when a
    NOSCRIPT brings us back here); a master that is down is an outage, raised as such."""
    if not is_cluster_client(client):
        return str(client.script_load(script))
    client.nodes_manager.initialize()
    sha = ""
    for node in client.get_nodes():
        try:
            sha = str(client.get_redis_connection(node).script_load(script))
        except (redis.ConnectionError, redis.TimeoutError):
            if node.server_type == PRIMARY:
                raise
    return sha
