"""Prefix affinity with real workers again, on a real Redis Cluster (the session's ``redis_cluster``
fixture): the held sets, offers and wake-up lists share the model's slot, the heartbeat refreshes a
held set beside keys of other slots, and a dead worker's offers still go to the live one."""

from __future__ import annotations

from tests.worker.test_affinity_workers import (  # noqa: F401 - collected here again, on the Cluster
    affinity_settings,
    test_a_follow_up_turn_runs_on_the_worker_holding_its_history,
    test_an_offer_to_a_dead_worker_is_taken_at_once,
    test_with_every_worker_idle_the_follow_up_still_runs_on_its_holder,
)

ON_CLUSTER = True
