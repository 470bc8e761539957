"""Prefetched work against urgency: requests a worker took beyond its slots wait in its engine, and a
later, more urgent request must still start before them (strict priority holds inside the worker
too, not only in Redis). Counted in tokens, not seconds: the urgent request runs many steps, and
while it does no priority-3 request can have started on a one-slot worker."""

from __future__ import annotations

import pytest

from shared.client import QueueClient
from tests.worker.conftest import greedy
from tests.worker.test_worker import prompt, tokens_sent, wait_for

pytestmark = pytest.mark.slow

LONG = 400  # tokens: the urgent request's run is this many steps, the window the check looks at


def taken_by(client: QueueClient, request_id: str) -> str | None:
    info = client.status(request_id)
    assert info is not None
    return info.worker


@pytest.mark.timeout(300)
def test_a_later_urgent_request_starts_before_prefetched_less_urgent_ones(spawn_worker, client, reference) -> None:
    spawn_worker("one-slot", "--max-num-seqs", "1", env={"INFLIGHTQ_PREFETCH_SEQS": "2"})
    model = client.settings.model
    running = client.submit(model, prompt(0), greedy(LONG), priority=3)
    wait_for(lambda: tokens_sent(client, running) > 0, timeout=60)
    prefetched = [client.submit(model, prompt(i), greedy(4), priority=3) for i in (1, 2)]
    # Both are in the worker (taken from Redis), waiting in its engine behind the running one.
    wait_for(lambda: all(taken_by(client, r) == "one-slot" for r in prefetched), timeout=60)
    assert all(tokens_sent(client, r) == 0 for r in prefetched)
    assert tokens_sent(client, running) < LONG, "the running request must still be running"

    urgent = client.submit(model, prompt(7), greedy(LONG), priority=0)
    wait_for(lambda: tokens_sent(client, urgent) > 0, timeout=60)
    # The urgent request has just started and runs LONG steps on the only slot: had a prefetched
    # priority-3 request started first, it would have its 4 tokens by now.
    assert [tokens_sent(client, r) for r in prefetched] == [0, 0], "a prefetched priority-3 request went first"
    assert client.result(urgent, timeout=120).token_ids == reference(prompt(7), LONG)
    for i, request_id in zip((1, 2), prefetched, strict=True):
        assert client.result(request_id, timeout=120).token_ids == reference(prompt(i), 4)
    assert client.result(running, timeout=120).token_ids == reference(prompt(0), LONG)
