"""Riding out a Redis restart: every I/O thread of a worker is a ``ResilientLoop``, which runs its
``turn()`` over and over, waits with capped exponential backoff (redis-py's) while Redis is gone,
and keeps going after a bug, logged with its traceback (a dead intake or refresher would leave a
worker that heartbeats but never works)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis
from redis.backoff import ExponentialBackoff

from shared.redis_connect import refresh_topology

log = logging.getLogger("inflightq.worker")

# Errors that mean "Redis is not there right now", as opposed to a bug or a rejected command. On a
# Cluster, a failover also answers CLUSTERDOWN (the dead master's slots have no owner until its
# replica is promoted) and TRYAGAIN (a multi-key command during resharding): both pass.
TRANSIENT = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    ConnectionError,
    OSError,
)


class ResilientLoop(threading.Thread):
    # The client the loop works through (set by each loop); on a Cluster, its view of who serves
    # which slots is refreshed after every turn that found Redis unreachable.
    redis: Any = None

    def __init__(self, name: str, stopping: threading.Event, *, first_s: float = 0.1, cap_s: float = 2.0) -> None:
        super().__init__(name=name, daemon=True)
        self.stopping = stopping
        self._backoff = ExponentialBackoff(cap=cap_s, base=first_s)
        self._failures = 0

    def turn(self) -> None:
        raise NotImplementedError

    def done(self) -> bool:
        """Whether the loop ends before its next turn."""
        return self.stopping.is_set()

    def after_failure(self) -> None:
        """Puts the thread's own state right after a failed turn (e.g. a pub/sub connection)."""

    def run(self) -> None:
        try:
            while not self.done():
                try:
                    self.turn()
                    self._failures = 0
                except TRANSIENT as error:
                    self.after_failure()
                    refresh_topology(self.redis)
                    delay = self._next_delay()
                    log.warning("redis unavailable during %s (%s); retrying in %.1fs", self.name, error, delay)
                    self.stopping.wait(delay)
                except Exception:
                    self.after_failure()
                    delay = self._next_delay()
                    log.exception("unexpected error in %s; carrying on in %.1fs", self.name, delay)
                    self.stopping.wait(delay)
        finally:
            self.close()

    def close(self) -> None:
        """Runs once when the loop ends."""

    def _next_delay(self) -> float:
        delay = self._backoff.compute(self._failures)
        self._failures += 1
        return delay
