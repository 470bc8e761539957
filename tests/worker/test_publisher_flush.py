"""``Publisher.flush`` returns only once everything handed over has reached Redis.

A draining worker flushes and exits: a flush that returns early loses the last tokens or final
writes of its requests. The round trip is held open here (its send waits on a gate), on a real
Redis, after several round trips have completed, so that a miscount carried over from an earlier
round trip (found by mutation: the token-batch count not reset to 0) makes ``flush`` return while
the held one is still on its way."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from shared.keys import Keys
from shared.settings import Settings
from worker.engine import EngineEvent
from worker.publisher import InHand, Publisher

pytestmark = pytest.mark.timeout(120)


class GatedPublisher(Publisher):
    """A real publisher whose round trips can be held before they are sent."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.sending = threading.Event()  # set while a round trip waits at the gate

    def _send(self, in_hand: InHand) -> None:
        if not self.gate.is_set():
            self.sending.set()
            self.gate.wait(60)
        super()._send(in_hand)


@pytest.fixture
def publisher(redis_url: str, key_prefix: str) -> Iterator[GatedPublisher]:
    settings = Settings(redis_url=redis_url, key_prefix=key_prefix, model="m")
    connection = redis.Redis.from_url(redis_url, decode_responses=True)
    p = GatedPublisher(settings, connection, "w")
    p.start()
    yield p
    p.gate.set()
    p.stop()
    connection.close()


def tokens(request_id: str, start: int, count: int) -> list[tuple[EngineEvent, int]]:
    return [(EngineEvent(request_id, i, 100 + i, f"t{i}"), 0) for i in range(start, start + count)]


def test_flush_waits_for_a_round_trip_in_flight_after_earlier_ones(
    publisher: GatedPublisher, redis_url: str, key_prefix: str
) -> None:
    # Several round trips, each of token batches and other writes, all completed.
    for step in range(4):
        publisher.publish_tokens(tokens("req-a", 2 * step, 2))
        publisher.publish_tokens(tokens("req-b", step, 1))
        assert publisher.flush(timeout=30)
    sent = publisher.round_trips

    # The next one is held before it reaches Redis: flush must not claim it arrived.
    publisher.gate.clear()
    publisher.publish_tokens(tokens("req-a", 8, 1))
    assert publisher.sending.wait(30), "the held round trip never started"
    assert publisher.flush(timeout=0.5) is False, "flush returned while a round trip was still on its way"

    log = Keys.for_prefix(key_prefix).replay_log("req-a")
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        assert r.xlen(log) == 8  # the held token is not in Redis yet
        publisher.gate.set()
        assert publisher.flush(timeout=30)
        assert r.xlen(log) == 9  # and flush returned only once it was
    assert publisher.round_trips > sent
