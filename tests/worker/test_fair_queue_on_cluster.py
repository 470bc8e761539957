"""The fair-share queue's tests again, on a real Redis Cluster (3 masters + 3 replicas): every queue
script names keys of the model's slot only, the tenants' lanes and other workers' offer streams
included, so the pick stays one atomic script there too."""

from __future__ import annotations

import pytest

from tests.worker.test_fair_queue import (  # noqa: F401 - collected here again, on the Cluster
    queue,
    queue_settings,
    test_a_flooding_tenant_does_not_hold_back_the_next_tenant,
    test_a_light_tenants_offer_behind_a_floods_offers_to_the_same_worker_is_picked_and_moves_to_its_lane,
    test_a_tenant_past_its_queued_limit_is_refused_alone,
    test_a_tenant_that_becomes_active_banks_no_credit_for_its_idle_time,
    test_an_offer_goes_to_its_worker_first_and_is_stolen_after_the_bound,
    test_every_lane_and_offer_stream_is_in_the_lanes_set_with_its_group,
    test_settle_charges_what_was_used_once_however_often_it_runs,
    test_the_lua_pick_agrees_with_the_policy_rules_on_a_random_scenario,
    test_weights_3_to_1_both_backlogged_serve_tokens_3_to_1,
)

pytestmark = pytest.mark.timeout(300)
ON_CLUSTER = True  # tests/conftest.py: redis_backend is the session's private Cluster
