"""Crash takeover, from both sides.

A live worker keeps the entries it is running fresh (XCLAIM ... JUSTID to itself every
``reclaim_after_s / 3``, only for entries it still owns), so a long generation is never stolen.

Every worker looks at the group's consumers every ``LOOK_EVERY_S``: one whose heartbeat stopped
(``heartbeat_watch``: SIGKILL, an OOM kill, a lost host) loses its held prefixes (``held_blocks``)
and has its pending entries taken over at once, most urgent stream first, as many as this worker
has room for. Behind that, XAUTOCLAIM with
``min-idle = reclaim_after_s`` on each lane and offer stream (the lanes set) takes what went idle with a live owner (a
worker whose heartbeat goes on but whose refresh stopped) and what was handed back. The new owner
resumes each from its replay log (see ``acceptance``).

Handing work back on drain uses the same path: the entry stays pending but its idle time is
pushed past the threshold (XCLAIM ... IDLE), so the next XAUTOCLAIM of any live worker (within
``LOOK_EVERY_S``) takes it and continues from the tokens already sent; nothing is generated twice."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from shared.keys import CONSUMER_GROUP, Keys
from shared.request_lifecycle import DELIVERIES
from shared.settings import Settings
from shared.work_queue import CLAIM_FROM_DEAD, REFRESH
from worker.acceptance import Acceptance
from worker.heartbeat_watch import HeartbeatWatch, dead_after_s
from worker.inbox import OwnedEntries
from worker.reconnect import ResilientLoop
from worker.run_state import RunState
from worker.streams import ensure_groups, is_missing_group, model_streams, priority_streams

log = logging.getLogger("inflightq.worker")

# How often a worker looks for dead workers' and handed-back entries.
LOOK_EVERY_S = 0.5


class Recovery(ResilientLoop):
    def __init__(
        self,
        settings: Settings,
        connection: redis.Redis,
        acceptance: Acceptance,
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
        self.acceptance = acceptance
        self.owned = owned
        self.state = state
        self.worker_name = name
        self.room = room
        self.on_lost = on_lost
        self.model = model
        self.streams = priority_streams(self.keys, model, settings.priority_levels)
        self._refresh = connection.register_script(REFRESH)
        self._claim_from_dead = connection.register_script(CLAIM_FROM_DEAD)
        self.min_idle_ms = int(settings.reclaim_after_s * 1000)
        self.refresh_every = settings.reclaim_after_s / 3
        self.claim_every = min(settings.reclaim_after_s / 2, LOOK_EVERY_S)
        dead_after = dead_after_s(settings)
        # A look later than this (the thread starved) says nothing about who beat meanwhile.
        self.watch = HeartbeatWatch(dead_after, max_gap=max(dead_after / 2, 4 * self.claim_every))
        self._next_refresh = self._next_claim = time.monotonic()

    def turn(self) -> None:
        if self.stopping.wait(min(self.refresh_every, self.claim_every)):
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

    def after_failure(self) -> None:
        self.watch.forget()

    def take_over(self) -> None:
        lanes = model_streams(self.redis, self.keys, self.model, self.settings.priority_levels)
        room = self.take_over_dead(self.room(), lanes)
        for stream in lanes:
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
                if self.acceptance.accept(stream, entry_id, fields):
                    room -= 1

    def take_over_dead(self, room: int, lanes: list[str]) -> int:
        """Takes over dead workers' entries of ``lanes``, as many as ``room``, and forgets dead
        consumers left holding none; returns the room left."""
        held: dict[str, dict[str, int]] = {}  # consumer -> {stream: its entries pending there}
        for stream in lanes:
            try:
                consumers = self.redis.xinfo_consumers(stream, CONSUMER_GROUP)
            except redis.ResponseError as error:
                if not is_missing_group(error) and "no such key" not in str(error):
                    raise
                if stream in self.streams:
                    ensure_groups(self.redis, self.streams)
                    return room
                continue  # an offer stream deleted meanwhile (its dead worker's, emptied)
            for consumer in consumers:
                if consumer["name"] != self.worker_name:
                    held.setdefault(str(consumer["name"]), {})[stream] = int(consumer["pending"])
        if not held:
            return room
        beats = dict(self.redis.zrange(self.keys.workers(), 0, -1, withscores=True))
        dead = self.watch.look(time.monotonic(), held, beats)
        if dead:  # their offers become stealable at once, and the API offers them nothing more
            self.redis.delete(*(self.keys.held(self.model, name) for name in dead))
        for stream in lanes:  # most urgent first
            for name in dead:
                pending = held[name].get(stream)
                if pending is None or (pending and room <= 0):
                    continue
                room -= self._take_from(stream, name, min(room, pending))
        return room

    def _take_from(self, stream: str, dead: str, count: int) -> int:
        """Up to ``count`` of ``dead``'s entries of ``stream`` to the engine; how many went."""
        claimed = self._claim_from_dead(keys=[stream], args=[CONSUMER_GROUP, dead, self.worker_name, count])
        accepted = 0
        for entry in claimed:
            if not entry:  # deleted while pending (an older Redis answers nil for it)
                continue
            entry_id, flat = entry
            log.info("taking over entry %s of %s from %s (its heartbeat stopped)", entry_id, stream, dead)
            fields = dict(zip(flat[::2], flat[1::2], strict=True)) if flat else None
            if self.acceptance.accept(stream, str(entry_id), fields):
                accepted += 1
        return accepted

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
