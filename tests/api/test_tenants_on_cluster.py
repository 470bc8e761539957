"""Tenants' limits on a real Redis Cluster: the per-tenant queued limit (the enqueue script in the
model's slot) and the requests and tokens per minute per key (the ``limits`` library's sliding
window, both keys in the deployment's slot, on its own Cluster client)."""

from __future__ import annotations

import pytest

from tests.api.test_tenants import (  # noqa: F401 - collected here again, on the Cluster
    make_api,
    test_a_tenant_over_its_queued_limit_gets_429_while_another_is_served,
    test_requests_and_tokens_per_minute_per_key,
    test_tokens_per_minute_count_prompt_and_max_new_tokens,
)

pytestmark = pytest.mark.timeout(180)
ON_CLUSTER = True  # tests/conftest.py: redis_backend is the session's private Cluster
