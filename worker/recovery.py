"""Crash takeover, from both sides.

A live worker keeps the entries it is running fresh (XCLAIM ... JUSTID to itself every
``reclaim_after_s / 3``, only for entries it still owns), so a long generation is never stolen.
Every worker also runs XAUTOCLAIM with ``min-idle = reclaim_after_s`` on each priority stream,
most urgent first, taking over as much as it has room for: a dead worker's entries go idle and
land here. The new owner resumes each from its replay log (see ``admission``).

Handing work back on drain uses the same path: the entry stays pending but its idle time is
pushed past the threshold (XCLAIM ... IDLE), so the next XAUTOCLAIM of any live worker takes it
and continues from the tokens already sent; nothing is generated twice."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import redis

from shared.keys import CONSUMER_GROUP, Keys
from shared.request_lifecycle import DELIVERIES
from shared.settings import Settings
from shared.work_queue import REFRESH
from worker.admission import Admission
from worker.intake import ensure_groups
from worker.reconnect import TRANSIENT, Backoff

if TYPE_CHECKING:
    from worker.service import WorkerService

log = logging.getLogger("inflightq.worker")


class Recovery(threading.Thread):
    def __init__(
        self, settings: Settings, connection: redis.Redis, admission: Admission, service: WorkerService
    ) -> None:
        super().__init__(name="recovery", daemon=True)
        self.settings = settings
        self.keys = Keys.for_prefix(settings.key_prefix)
        self.redis = connection
        self.admission = admission
        self.service = service
        self.streams = [self.keys.stream(service.model, p) for p in range(settings.priority_levels)]
        self._refresh = connection.register_script(REFRESH)
        self.min_idle_ms = int(settings.reclaim_after_s * 1000)

    def run(self) -> None:
        backoff = Backoff(self.service.stopping)
        refresh_every = self.settings.reclaim_after_s / 3
        claim_every = self.settings.reclaim_after_s / 2
        next_refresh = next_claim = time.monotonic()
        while not self.service.stopping.wait(min(refresh_every, 0.5)):
            try:
                now = time.monotonic()
                if now >= next_refresh:
                    self.refresh()
                    next_refresh = now + refresh_every
                if now >= next_claim and not self.service.draining.is_set():
                    self.take_over()
                    next_claim = now + claim_every
                backoff.succeeded()
            except TRANSIENT as error:
                backoff.failed("recovery", error)
            except Exception:
                backoff.crashed("recovery")

    def refresh(self) -> None:
        for stream, owned in self.service.inflight_by_stream().items():
            try:
                lost = self._refresh(keys=[stream], args=[CONSUMER_GROUP, self.service.name, *owned])
            except redis.ResponseError as error:
                if "NOGROUP" not in str(error):
                    raise
                ensure_groups(self.redis, self.keys, self.service.model, self.settings.priority_levels)
                lost = list(owned)
            for entry_id in lost:
                self.service.lost(stream, str(entry_id))

    def take_over(self) -> None:
        room = self.service.room()
        for stream in self.streams:
            if room <= 0:
                return
            try:
                reply = self.redis.xautoclaim(
                    stream, CONSUMER_GROUP, self.service.name, self.min_idle_ms, start_id="0-0", count=room
                )
            except redis.ResponseError as error:
                if "NOGROUP" not in str(error):
                    raise
                ensure_groups(self.redis, self.keys, self.service.model, self.settings.priority_levels)
                continue
            for entry_id, fields in reply[1]:
                if self.service.owned.owner(stream, entry_id) is not None:
                    # Our own entry went idle (a stalled refresh, or a Redis restart that kept the
                    # old delivery time): XAUTOCLAIM just refreshed it, and it is still running here.
                    continue
                log.info("taking over entry %s of %s", entry_id, stream)
                if self.admission.admit(stream, entry_id, fields):
                    room -= 1

    def hand_back(self, stream: str, entry_id: str, request_id: str, *, failed: bool) -> None:
        """Leaves the entry pending but idle enough for any worker's next XAUTOCLAIM. A graceful
        hand-back (drain) gives its delivery back, so rolling restarts never dead-letter a long
        generation; one after an engine failure keeps it, so a request that keeps breaking the
        engine ends in the dead letters."""
        idle_ms = self.min_idle_ms * 10 + 60_000
        pipe = self.redis.pipeline(transaction=False)
        pipe.xclaim(stream, CONSUMER_GROUP, self.service.name, 0, [entry_id], idle=idle_ms, justid=True)
        if not failed:
            pipe.hincrby(self.keys.request(request_id), DELIVERIES, -1)
        pipe.execute()
