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
import time
from collections.abc import Callable

import redis

from shared.keys import CONSUMER_GROUP, Keys
from shared.request_lifecycle import DELIVERIES
from shared.settings import Settings
from shared.work_queue import REFRESH
from worker.admission import Admission
from worker.inbox import OwnedEntries
from worker.reconnect import ResilientLoop
from worker.run_state import RunState
from worker.streams import ensure_groups, is_missing_group, priority_streams

log = logging.getLogger("inflightq.worker")


class Recovery(ResilientLoop):
    def __init__(
        self,
        settings: Settings,
        connection: redis.Redis,
        admission: Admission,
        owned: OwnedEntries,
        state: RunState,
        *,
        name: str,
        model: str,
        room: Callable[[], int],
        on_lost: Callable[[str, str], None],
    ) -> None:
        super().__init__("recovery", state.stopping)
        self.settings = settings
        self.keys = Keys.for_prefix(settings.key_prefix)
        self.redis = connection
        self.admission = admission
        self.owned = owned
        self.state = state
        self.worker_name = name
        self.room = room
        self.on_lost = on_lost
        self.streams = priority_streams(self.keys, model, settings.priority_levels)
        self._refresh = connection.register_script(REFRESH)
        self.min_idle_ms = int(settings.reclaim_after_s * 1000)
        self.refresh_every = settings.reclaim_after_s / 3
        self.claim_every = settings.reclaim_after_s / 2
        self._next_refresh = self._next_claim = time.monotonic()

    def turn(self) -> None:
        if self.stopping.wait(min(self.refresh_every, 0.5)):
            return
        now = time.monotonic()
        if now >= self._next_refresh:
            self.refresh()
            self._next_refresh = now + self.refresh_every
        if now >= self._next_claim and not self.state.draining.is_set():
            self.take_over()
            self._next_claim = now + self.claim_every

    def refresh(self) -> None:
        for stream, owned in self.owned.by_stream().items():
            try:
                lost = self._refresh(keys=[stream], args=[CONSUMER_GROUP, self.worker_name, *owned])
            except redis.ResponseError as error:
                if not is_missing_group(error):
                    raise
                ensure_groups(self.redis, self.streams)
                lost = list(owned)
            for entry_id in lost:
                self.on_lost(stream, str(entry_id))

    def take_over(self) -> None:
        room = self.room()
        for stream in self.streams:
            if room <= 0:
                return
            try:
                reply = self.redis.xautoclaim(
                    stream, CONSUMER_GROUP, self.worker_name, self.min_idle_ms, start_id="0-0", count=room
                )
            except redis.ResponseError as error:
                if not is_missing_group(error):
                    raise
                ensure_groups(self.redis, self.streams)
                continue
            for entry_id, fields in reply[1]:
                if self.owned.owner(stream, entry_id) is not None:
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
        pipe.xclaim(stream, CONSUMER_GROUP, self.worker_name, 0, [entry_id], idle=idle_ms, justid=True)
        if not failed:
            pipe.hincrby(self.keys.request(request_id), DELIVERIES, -1)
        pipe.execute()
