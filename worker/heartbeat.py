"""A worker's advertisement: model, capacity and load, refreshed well inside its TTL.

The document lives in ``keys.worker(name)`` with a TTL, and the name in the ``keys.workers()``
sorted set scored by time, so readers find live workers without scanning keys."""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING

import redis

from shared.keys import Keys
from shared.settings import Settings
from worker.reconnect import TRANSIENT, Backoff

if TYPE_CHECKING:
    from worker.service import WorkerService


class Heartbeat(threading.Thread):
    def __init__(self, settings: Settings, connection: redis.Redis, service: WorkerService) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.settings = settings
        self.keys = Keys.for_prefix(settings.key_prefix)
        self.redis = connection
        self.service = service
        self.every = min(1.0, settings.heartbeat_ttl_s / 3)

    def run(self) -> None:
        backoff = Backoff(self.service.stopping)
        while True:
            try:
                self.beat()
                backoff.succeeded()
            except TRANSIENT as error:
                backoff.failed("heartbeat", error)
            except Exception:
                backoff.crashed("heartbeat")
            if self.service.stopping.wait(self.every):
                return

    def beat(self) -> None:
        beat = self.service.heartbeat()
        ttl = max(1, math.ceil(self.settings.heartbeat_ttl_s))
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.worker(beat.name), beat.to_json(), ex=ttl)
        pipe.zadd(self.keys.workers(), {beat.name: now})
        # Forget names dead for a while, so the set does not grow with every restart.
        pipe.zremrangebyscore(self.keys.workers(), "-inf", now - 60 * self.settings.heartbeat_ttl_s)
        pipe.execute()

    def remove(self) -> None:
        try:
            self.redis.delete(self.keys.worker(self.service.name))
            self.redis.zrem(self.keys.workers(), self.service.name)
        except redis.RedisError:
            pass
