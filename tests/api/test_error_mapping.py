"""What a Redis Cluster's transient states read as to a client: 503 (retry), never our 500."""

from __future__ import annotations

import pytest
import redis.exceptions

from producer_api.errors import normalize
from shared.errors import UnavailableError


@pytest.mark.parametrize(
    "exc",
    [
        redis.exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"),
        redis.exceptions.TryAgainError("TRYAGAIN"),
        redis.exceptions.SlotNotCoveredError("Slot 1234 not covered by the cluster."),
        redis.exceptions.RedisClusterException(
            "Redis Cluster cannot be connected. Please provide at least one reachable node: Error 111"
        ),
        redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:7000. Connection refused."),
    ],
)
def test_a_cluster_between_failure_and_promotion_is_unavailable_not_a_bug(exc: Exception) -> None:
    error = normalize(exc)
    assert isinstance(error, UnavailableError) and error.http_status == 503


def test_other_cluster_client_errors_stay_ours() -> None:
    """A command the client cannot route (a missing key) is a bug on our side, not a failover."""
    error = normalize(redis.exceptions.RedisClusterException("No way to dispatch this command to Redis Cluster."))
    assert error.http_status == 500
