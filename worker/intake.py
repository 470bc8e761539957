"""Pulling work: a model's queue, read in strict priority order, as much as the policy allows.

For each priority from 0 (most urgent) down, the intake peeks (``PEEK``) at the entries the fair
pick would hand it next, across the tenants' lanes and the offer streams (``shared.work_queue``),
and takes (``PULL``) exactly as many as ``Capacity.how_many_to_take`` (``policy``) allows; a less
urgent priority is only read once every more urgent one is drained, and what is not taken stays in
Redis for any other worker. With room but nothing to read, it blocks on the model's notify list
and its own (an offer made to it wakes it alone), never busy-polling; with prefix affinity on, for the
steal bound at most, as others' offers become its to take with no wake-up to say so.

A full worker keeps reading, every ``urgent_poll_s``, the priorities whose entries would displace
work it runs (``Capacity.displacing_levels``), and takes those; when the fair pick's first entry would
displace nothing there, its pick passes over to a tenant far under its share (``policy.passed_over``).
A free slot elsewhere in the pool wins first: while another live worker of the model advertises
one, an urgent entry is left for it until ``how_many_to_steal`` lets this worker take it,
``urgent_handoff_s`` after it first saw it (an idle worker is woken by the enqueue and takes it
within milliseconds). XREADGROUP hands an entry to one consumer only, so of several full workers
exactly one takes it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import redis

from shared.client_core import filter_heartbeats
from shared.keys import Keys
from shared.settings import Settings
from shared.work_queue import PULL, TENANT_FIELD, WEIGHT_FIELD, pull_args, pull_keys
from worker.acceptance import Acceptance
from worker.engine.core.policy import (
    Capacity,
    EngineLoad,
    PassOver,
    Urgency,
    after_waiting,
    arriving,
    how_many_to_steal,
    load_of,
    passed_over,
)
from worker.offer_stats import OfferStats
from worker.reconnect import ResilientLoop
from worker.run_state import RunState
from worker.streams import ensure_groups, is_missing_group, priority_streams, steal_after_ms

log = logging.getLogger("inflightq.worker")

# How long an idle worker blocks on the notify list before looking at the streams again anyway
# (a wake-up can be lost to a Redis restart, or taken by a busier worker).
IDLE_BLOCK_S = 1.0
# The shortest such block with prefix affinity on, where it is the steal bound: offers another worker
# holds become this one's to take as they age, with no wake-up to say so.
MIN_OFFER_BLOCK_S = 0.1
# How long the pool's advertised free slots are trusted before asking again.
POOL_VIEW_S = 0.25

Outcome = Literal["took", "empty", "blocked"]


@dataclass
class WorkerLoad:
    """What the intake reads of its own worker, each call fresh."""

    engine_load: Callable[[], EngineLoad]
    in_transit: Callable[[], Sequence[int]]  # priorities of the starts handed to the engine loop, not yet in it
    is_idle: Callable[[], bool]
    prefill_ms_per_token: Callable[[], float] = lambda: 0.0  # ``PrefillRate``'s; 0: not measured yet


class Intake(ResilientLoop):
    def __init__(
        self,
        settings: Settings,
        connection: redis.Redis,
        acceptance: Acceptance,
        capacity: Capacity,
        load: WorkerLoad,
        state: RunState,
        *,
        name: str,
        model: str,
    ) -> None:
        super().__init__("intake", state.stopping)
        self.settings = settings
        self.keys = Keys.for_prefix(settings.key_prefix)
        self.redis = connection
        self.acceptance = acceptance
        self.capacity = capacity
        self.load = load
        self.state = state
        self.consumer = name  # not `name`: that is the thread's, which the logs show
        self.model = model
        self.streams = priority_streams(self.keys, model, settings.priority_levels)
        self._pull = connection.register_script(PULL)
        self.steal_after_ms = steal_after_ms(settings)
        self.offer_stats = OfferStats(self.keys, model, name, self.steal_after_ms)
        self._block_s = (
            max(MIN_OFFER_BLOCK_S, min(IDLE_BLOCK_S, self.steal_after_ms / 1000)) if settings.affinity else IDLE_BLOCK_S
        )
        # The model's wake-ups, and those of offers made to this worker alone.
        self._wake_lists = [self.keys.notify(model), self.keys.notify_worker(model, name)]
        self._first_seen: dict[str, float] = {}  # urgent entries left for a free worker, by entry id
        self._pool_free: tuple[float, bool] = (0.0, False)  # (when asked, another worker has a free slot)

    def done(self) -> bool:
        return self.state.stopping.is_set() or self.state.draining.is_set()

    def turn(self) -> None:
        self.state.capacity_changed.clear()
        try:
            outcome = self.read_once()
        except redis.ResponseError as error:
            if not is_missing_group(error):
                raise
            ensure_groups(self.redis, self.streams)
            return
        full = self.capacity.room(self.load.engine_load(), self.load.in_transit()) <= 0
        if outcome == "empty" and not full:
            self.redis.blpop(self._wake_lists, timeout=self._block_s)
        elif outcome != "took":
            # Full or blocked: a freed slot wakes us at once; urgent work is looked for again soon.
            urgent_possible = self.capacity.displacing_levels(self.load.engine_load(), len(self.streams)) > 0
            self.state.capacity_changed.wait(self.settings.urgent_poll_s if urgent_possible else IDLE_BLOCK_S)

    def read_once(self) -> Outcome:
        """One pass over the priorities, most urgent first."""
        load, in_transit = self.load.engine_load(), self.load.in_transit()
        room = self.capacity.room(load, in_transit)
        streams = self.streams if room > 0 else self.streams[: self.capacity.displacing_levels(load, len(self.streams))]
        if not streams:
            return "blocked"
        took = False
        idle = self.load.is_idle()
        # As the engine will rank entries: their tenant's share and load decide between tenants at a level,
        # the load counted once the requests already waiting in the engine have started.
        settled, counts = after_waiting(load)
        for priority in range(len(streams)):
            # Full: when the pick's first entry would displace nothing, it passes over to a tenant far under its share.
            passed = passed_over(settled, counts, priority) if room <= 0 and self.settings.fair_share else PassOver()
            waiting = self.pull(priority, max(room, 1), idle=idle, peek=True, passed_over=passed)
            if not waiting:
                if passed.cannot_displace:  # so nothing runs here at a less urgent level: nothing to displace
                    return "took" if took else "blocked"
                continue
            lengths = [self.acceptance.prompt_length(fields) for _, _, fields, _ in waiting]
            urgencies = self._arriving(priority, counts, waiting)
            # Fresh: what a more urgent stream just handed over claims its victims.
            in_transit = self.load.in_transit()
            take = self.capacity.how_many_to_take(
                settled, in_transit, priority, lengths, idle=idle, urgencies=urgencies
            )
            count = take.fit + self._urgent_share(waiting[take.fit : take.total])
            if count:
                for stream, entry_id, fields, share in self.pull(
                    priority, count, idle=idle, peek=False, passed_over=passed
                ):
                    took = self.acceptance.accept(stream, entry_id, fields, share) or took
                if take.displace:
                    log.info(
                        "took %d urgent entries of priority %d to displace less urgent work", count - take.fit, priority
                    )
            room -= count
            if count < len(waiting) or room <= 0:
                # Strict priority: less urgent streams wait while this one still has work.
                return "took" if count else "blocked"
        return "took" if took else "empty"

    def _arriving(
        self, priority: int, running: Counter[str], entries: list[tuple[str, str, dict[str, str], float]]
    ) -> list[Urgency]:
        """The peeked ``entries``' urgencies: each with its tenant's load counting its tenant's requests in
        the engine (``running``: ``policy.after_waiting``'s counts), those ahead of it in ``entries``, and itself."""
        ahead: Counter[str] = Counter()
        out = []
        for _, _, fields, share in entries:
            # Fair share off: one tenant for who runs next, as the engine's policy counts them.
            tenant = fields.get(TENANT_FIELD, "") if self.settings.fair_share else ""
            try:
                weight = float(fields.get(WEIGHT_FIELD, "1"))
            except ValueError:
                weight = 1.0
            load = load_of(running[tenant] + ahead[tenant], weight, counting_itself=True)
            ahead[tenant] += 1
            out.append(arriving(priority, share=share if self.settings.fair_share else 0.0, tenant=tenant, load=load))
        return out

    def pull(
        self, priority: int, count: int, *, idle: bool, peek: bool, passed_over: PassOver | None = None
    ) -> list[tuple[str, str, dict[str, str], float]]:
        """``PULL`` (or ``PEEK``) at ``priority``: (stream, entry id, fields, tenant's virtual time) of each
        pick, past the tenants ``passed_over`` says (a full worker's)."""
        keys = pull_keys(self.keys, self.model, priority, self.consumer)
        args = pull_args(
            self.keys,
            self.model,
            priority,
            self.consumer,
            count,
            idle=idle,
            steal_after_ms=self.steal_after_ms,
            peek=peek,
            prefill_ms_per_token=self.load.prefill_ms_per_token(),
            cannot_displace=passed_over.cannot_displace if passed_over else (),
            at_the_edge=passed_over.at_the_edge if passed_over else (),
        )
        picks = [
            (str(stream), str(entry_id), dict(zip(flat[::2], flat[1::2], strict=True)), float(share))
            for stream, entry_id, flat, share, _tenant in self._pull(keys=keys, args=args)
        ]
        if not peek:
            for stream, entry_id, _, _ in picks:
                self.offer_stats.pulled(stream, entry_id, idle=idle)
        return picks

    def _urgent_share(self, urgent: list[tuple[str, str, dict[str, str], float]]) -> int:
        """How many of the entries that would displace work here to take now: all of them, unless
        another worker has a free slot and has not had ``urgent_handoff_s`` to take them."""
        if not urgent:
            return 0
        now = time.monotonic()
        self._first_seen = {e: t for e, t in self._first_seen.items() if now - t < 60}
        if not self._free_slot_elsewhere(now):
            return len(urgent)
        first_seen = (self._first_seen.setdefault(entry_id, now) for _, entry_id, _, _ in urgent)
        return how_many_to_steal(first_seen, now, self.settings.urgent_handoff_s)

    def _free_slot_elsewhere(self, now: float) -> bool:
        asked, free = self._pool_free
        if now - asked < POOL_VIEW_S:
            return free
        names = self.redis.zrange(self.keys.workers(), 0, -1)
        others = [n for n in names if n != self.consumer]
        beats = filter_heartbeats(self.redis.mget([self.keys.worker(n) for n in others]), self.model) if others else []
        free = any(b.running < b.max_num_seqs and not b.draining for b in beats)
        self._pool_free = (now, free)
        return free
