"""API keys on a real Redis Cluster: the per-key rate limiter (the ``limits`` library's sliding
window on its Cluster client) and the key checks, with the API's Redis client a RedisCluster."""

from __future__ import annotations

import pytest

from tests.api.test_auth import (  # noqa: F401 - collected here again, on the Cluster
    api,
    test_missing_or_wrong_key_is_401,
    test_rate_limit_per_key_is_429_rate_limited,
)

pytestmark = pytest.mark.timeout(120)
ON_CLUSTER = True  # tests/conftest.py: redis_backend is the session's private Cluster
