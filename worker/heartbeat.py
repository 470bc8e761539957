"""A worker's advertisement: model, capacity and load, refreshed well inside its TTL.

The document lives in ``keys.worker(name)`` with a TTL, and the name in the ``keys.workers()``
sorted set scored by time, so readers find live workers without scanning keys. The same round trip
refreshes the TTL of the worker's held prefixes (``held_blocks``)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis

from shared.keys import Keys
from shared.schemas import WorkerHeartbeat
from shared.settings import Settings
from worker.reconnect import ResilientLoop

if TYPE_CHECKING:
    from worker.held_blocks import HeldBlocks


def beat_interval(settings: Settings) -> float:
    """How often every worker beats: each second, or three times per heartbeat_ttl_s if shorter."""
    return min(1.0, settings.heartbeat_ttl_s / 3)


class Heartbeat(ResilientLoop):
    def __init__(
        self,
        settings: Settings,
        connection: redis.Redis,
        name: str,
        advertisement: Callable[[], WorkerHeartbeat],
        stopping: threading.Event,
        held: HeldBlocks | None = None,
    ) -> None:
        super().__init__("heartbeat", stopping)
        self.settings = settings
        self.keys = Keys.for_prefix(settings.key_prefix)
        self.redis = connection
        self.worker_name = name
        self.advertisement = advertisement
        self.held = held
        self.every = beat_interval(settings)
        self._beat_due = 0.0

    def turn(self) -> None:
        self.stopping.wait(max(0.0, self._beat_due - time.monotonic()))
        if not self.stopping.is_set():
            self.beat()
            self._beat_due = time.monotonic() + self.every

    def beat(self) -> None:
        beat = self.advertisement()
        ttl = max(1, math.ceil(self.settings.heartbeat_ttl_s))
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.worker(beat.name), beat.to_json(), ex=ttl)
        pipe.zadd(self.keys.workers(), {beat.name: now})
        # Forget names dead for a while, so the set does not grow with every restart.
        pipe.zremrangebyscore(self.keys.workers(), "-inf", now - 60 * self.settings.heartbeat_ttl_s)
        # ... and so the set itself goes once no worker has beaten for that long.
        pipe.expire(self.keys.workers(), max(1, math.ceil(60 * self.settings.heartbeat_ttl_s)))
        held = self.held.refresh(pipe) if self.held is not None else 0
        replies = pipe.execute()
        if held and self.held is not None:
            self.held.refreshed(replies[-held:])

    def remove(self) -> None:
        try:
            self.redis.delete(self.keys.worker(self.worker_name))
            self.redis.zrem(self.keys.workers(), self.worker_name)
        except redis.RedisError:
            pass
