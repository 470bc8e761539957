"""A full worker is woken for a light tenant's request (``worker/light_arrivals.py``): the token ``ENQUEUE``
pushes when a tenant that had nothing waiting queues a request tells the intake to look at once."""

from __future__ import annotations

import redis

from shared.client import QueueClient
from shared.keys import Keys
from shared.schemas import SamplingSpec
from shared.settings import Settings
from worker.light_arrivals import LightArrivals
from worker.run_state import RunState

MODEL = "m"


def test_a_light_tenants_request_wakes_the_intake_and_a_flooding_tenants_next_one_does_not(
    redis_url: str, key_prefix: str
) -> None:
    settings = Settings(redis_url=redis_url, key_prefix=key_prefix, model=MODEL)
    state = RunState()
    connection = redis.Redis.from_url(redis_url, decode_responses=True)
    thread = LightArrivals(connection, Keys.for_prefix(key_prefix), MODEL, state)
    thread.start()
    try:
        with QueueClient(settings) as client:
            client.ensure_groups(MODEL)
            client.submit(MODEL, [1, 2], SamplingSpec(max_new_tokens=2), priority=1, tenant="flood")
            assert state.capacity_changed.wait(5), "the flood's first request: it had nothing waiting"
            state.capacity_changed.clear()
            client.submit(MODEL, [1, 2], SamplingSpec(max_new_tokens=2), priority=1, tenant="flood")
            assert not state.capacity_changed.wait(1.5), "its second finds one waiting: no wake-up"
            client.submit(MODEL, [1, 2], SamplingSpec(max_new_tokens=2), priority=1, tenant="light")
            assert state.capacity_changed.wait(5)
    finally:
        state.stopping.set()
        thread.join(timeout=5)
        connection.close()
    assert not thread.is_alive()
