"""Riding out a Redis restart: the I/O threads retry with capped exponential backoff and keep going."""

from __future__ import annotations

import logging
import threading

import redis

log = logging.getLogger("inflightq.worker")

# Errors that mean "Redis is not there right now", as opposed to a bug or a rejected command.
TRANSIENT = (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError)


class Backoff:
    def __init__(self, stop: threading.Event, *, first: float = 0.1, cap: float = 2.0) -> None:
        self.stop = stop
        self.first = first
        self.cap = cap
        self.delay = first

    def failed(self, what: str, error: BaseException) -> None:
        log.warning("redis unavailable during %s (%s); retrying in %.1fs", what, error, self.delay)
        self.stop.wait(self.delay)
        self.delay = min(self.cap, self.delay * 2)

    def crashed(self, what: str) -> None:
        """A bug, not an outage: logged with its traceback, and the thread carries on (a dead
        intake or refresher would leave a worker that heartbeats but never works)."""
        log.exception("unexpected error in %s; carrying on in %.1fs", what, self.delay)
        self.stop.wait(self.delay)
        self.delay = min(self.cap, self.delay * 2)

    def succeeded(self) -> None:
        self.delay = self.first
