"""The API's bounded command pool again, on the session's Redis Cluster (3 masters + 3 replicas):
redis-py's asyncio Cluster client raises past its per-node ``max_connections`` instead of waiting,
so the bound there is ``shared.redis_pool.BoundedRedisCluster``'s; the same test functions run on a
standalone Redis in ``test_redis_pool.py``."""

from __future__ import annotations

import pytest

from tests.api.test_redis_pool import (  # noqa: F401 - collected here again, on the Cluster
    nodes,
    redis_backend,
    test_a_wait_for_a_connection_past_its_limit_is_a_503_not_a_hang,
    test_hundreds_of_requests_and_streams_at_once_share_a_bounded_pool,
)

pytestmark = pytest.mark.timeout(300)
ON_CLUSTER = True  # tests/conftest.py: redis_backend is the session's private Cluster
