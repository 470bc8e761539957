# ruff: noqa: F811 - the fixtures imported below are the parameters of the tests collected here
"""The API's key end-to-end tests again, on a real Redis Cluster (3 masters + 3 replicas, the
session's ``redis_cluster`` fixture; the same test functions run on the standalone Redis in
``test_end_to_end.py`` and ``test_takeover.py``): jobs with ``Last-Event-ID``, streams, cancel on
DELETE and on disconnect, many concurrent streams through the API's one subscriber connection
per node, and a job's stream across a worker's SIGKILL."""

from __future__ import annotations

import pytest

from tests.api.test_end_to_end import (  # noqa: F401 - collected here again, on the Cluster
    http,
    test_delete_cancels_a_running_job,
    test_job_lifecycle_and_resumable_stream,
    test_leaving_a_stream_cancels_its_request,
    test_many_concurrent_streams_each_get_their_own_tokens,
    test_openai_chat_stream_matches_non_stream_and_reports_usage,
    test_resuming_a_running_jobs_stream_continues_after_the_last_seen_token,
)
from tests.api.test_takeover import test_job_stream_survives_a_worker_crash  # noqa: F401

pytestmark = pytest.mark.timeout(300)
ON_CLUSTER = True  # tests/conftest.py: redis_backend is the session's private Cluster


def test_the_api_follows_its_streams_over_one_connection_per_node(api, http) -> None:
    dispatcher = api.app.state.inflightq.dispatcher
    assert dispatcher.client.hub.sharded
    assert dispatcher.client.hub.connections <= 3
