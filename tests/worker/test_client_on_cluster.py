"""The queue client's key tests again, on a real Redis Cluster (3 masters + 3 replicas, the
session's ``redis_cluster`` fixture; the same test functions run on the standalone Redis in
``test_client.py``), and what only a Cluster shows: keys spread over the masters, one pub/sub
connection per node for any number of streams, prefixes still isolate deployments."""

# ruff: noqa: F811 - the fixtures imported below are the parameters of the tests defined here
from __future__ import annotations

import asyncio
import uuid

import pytest

from shared.async_client import AsyncQueueClient
from shared.client import QueueClient
from shared.keys import Keys
from shared.redis_connect import connect, primaries
from shared.schemas import ErrorEvent
from shared.settings import Settings
from tests.worker.test_client import (  # noqa: F401 - collected here again, on the Cluster
    client,
    client_settings,
    test_a_reused_request_id_is_refused_and_the_original_is_untouched,
    test_a_stream_resumed_while_the_left_one_is_still_unsubscribing_is_confirmed,
    test_cancel_of_a_queued_request_is_final_at_once,
    test_concurrent_submits_never_overfill_the_queue,
    test_stream_fills_a_missed_live_event_from_the_log,
    test_stream_replays_the_log_then_follows_live_without_duplicates,
    test_submit_past_the_queue_depth_is_overloaded_but_taken_work_does_not_count,
)

pytestmark = pytest.mark.timeout(300)
ON_CLUSTER = True  # tests/conftest.py: redis_backend is the session's private Cluster


def test_the_keys_of_1000_requests_spread_evenly_over_the_three_masters(client_settings: Settings) -> None:
    settings = client_settings
    with QueueClient(settings) as queue:
        for _ in range(1000):
            queue.submit("m", [1, 2, 3], check_depth=False)
        per_master = [
            sum(1 for _ in node.scan_iter(match=Keys.for_prefix(settings.key_prefix).pattern(), count=1000))
            for node in primaries(queue.redis)  # type: ignore[arg-type]
        ]
    # 1,000 request hashes, plus the model's queue keys and the deployment's keys on one master each.
    assert sum(per_master) >= 1000 and len(per_master) == 3
    assert all(250 < n < 420 for n in per_master), per_master


def test_an_async_client_follows_many_streams_over_one_connection_per_node(client_settings: Settings) -> None:
    async def main() -> tuple[int, list[object]]:
        async with AsyncQueueClient(client_settings) as queue:
            ids = [await queue.submit("m", [1], check_depth=False) for _ in range(200)]
            ends: list[object] = []

            async def follow(request_id: str) -> None:
                async for event in queue.stream(request_id, timeout=30):
                    ends.append(event)

            tasks = [asyncio.ensure_future(follow(r)) for r in ids]
            while queue.hub.channels < len(ids):
                await asyncio.sleep(0.05)
            connections = queue.hub.connections
            for request_id in ids:  # each cancel publishes its stream's terminal event
                assert await queue.cancel(request_id)
            await asyncio.gather(*tasks)
            return connections, ends

    connections, ends = asyncio.run(main())
    assert connections == 3, "one pub/sub connection per master, however many streams"
    assert len(ends) == 200 and all(isinstance(e, ErrorEvent) and e.error_type == "cancelled" for e in ends)


def test_a_prefix_still_isolates_deployments_on_the_cluster(client_settings: Settings) -> None:
    settings = client_settings
    other = settings.model_copy(update={"key_prefix": f"{settings.key_prefix}-{uuid.uuid4().hex[:4]}"})
    with QueueClient(settings) as mine, QueueClient(other) as theirs:
        mine.submit("m", [1], check_depth=False)
        assert theirs.queue_depth("m")[1] == 0 and mine.queue_depth("m")[1] == 1
    cluster = connect(settings, decode_responses=True)
    assert not list(cluster.scan_iter(match=Keys.for_prefix(other.key_prefix).pattern()))
    cluster.close()
