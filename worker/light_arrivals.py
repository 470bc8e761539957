"""Waking a full worker for a light tenant's request, instead of at its next poll.

A full worker reads the queue every ``urgent_poll_s`` for work that would displace what it runs. A
request of a tenant that had nothing waiting (``ENQUEUE`` pushes a token to the model's light
arrivals list) may be such work: a tenant far under its share takes a flooding one's place. This
thread blocks on that list and tells the intake to look at once (``capacity_changed``), so the light
tenant's first token does not wait for the poll. One token wakes one worker; the others still poll.
"""

from __future__ import annotations

import logging

import redis

from shared.keys import Keys
from worker.reconnect import ResilientLoop
from worker.run_state import RunState

log = logging.getLogger("inflightq.worker")

# How long one wait blocks on the list: the loop notices a stop within it.
BLOCK_S = 1.0


class LightArrivals(ResilientLoop):
    def __init__(self, connection: redis.Redis, keys: Keys, model: str, state: RunState) -> None:
        super().__init__("light-arrivals", state.stopping)
        self.redis = connection
        self.list = keys.light_arrivals(model)
        self.state = state

    def done(self) -> bool:
        return self.state.stopping.is_set() or self.state.draining.is_set()

    def turn(self) -> None:
        if self.redis.blpop([self.list], timeout=BLOCK_S):
            self.state.capacity_changed.set()
