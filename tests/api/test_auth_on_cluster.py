"""API keys on a real Redis Cluster: the per-key rate limiter (INCR + EXPIRE of one key, in a
MULTI on the Cluster client) and the key checks, with the API's Redis client a RedisCluster."""

from __future__ import annotations

import pytest

from inflightq_cli.redis_cluster import PrivateRedisCluster
from tests.api.test_auth import (  # noqa: F401 - collected here again, on the Cluster
    api,
    test_missing_or_wrong_key_is_401,
    test_rate_limit_per_key_is_429_rate_limited,
)
from tests.conftest import RedisBackend, cluster_backend

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def redis_backend(redis_cluster: PrivateRedisCluster) -> RedisBackend:
    return cluster_backend(redis_cluster)
