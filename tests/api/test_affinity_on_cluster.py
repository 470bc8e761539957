"""The affinity lookup and the dispatcher's offers again, on a real Redis Cluster (the session's
``redis_cluster`` fixture): the held sets, the offer streams and the lookup script share the model's
slot, so the one script call per request is legal there."""

from __future__ import annotations

from tests.api.test_affinity_dispatch import (  # noqa: F401 - collected here again, on the Cluster
    test_a_request_is_offered_to_the_worker_holding_its_prefix,
    test_an_adapter_request_is_offered_to_its_history_else_to_a_worker_holding_the_adapter,
    test_the_lookup_finds_the_longest_held_prefix,
)

ON_CLUSTER = True
