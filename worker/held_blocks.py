"""The worker's advertisement of its prefix cache: ``Keys.held(model, worker)``, a SET of the block
hashes its engine holds (``shared.prefix_hash``, hex) plus ``shared.affinity.LIVE``, which the API
reads to offer a request to the worker holding its longest prefix (``shared.affinity``), and a
member per LoRA adapter its engine holds loaded (``shared.affinity.adapter_member``), so a request
with an adapter goes to a worker that has it.

After each step the engine loop takes what the engine cached and evicted (``prefix_cache_changes``)
and hands it to the publisher, which sends it in the step's round trip (SADD, SREM, EXPIRE). A request
the worker has started is advertised at once with its prompt's blocks (``promise``), before its
prefill computes them: a request with the same prefix that arrives meanwhile is offered here, where
the prefix is about to be, instead of being prefilled again on another worker. What a request promised
and the cache does not hold when it ends (``settled``: cancelled, failed, or evicted) is removed. The
heartbeat refreshes the TTL and checks ``LIVE``: a set that is gone or lacks it (it expired during an
outage, or another worker's recovery took this one for dead) is written again whole at the next
step. On drain the set is deleted first thing (this worker's offers become stealable at once, and no
new ones come), and nothing is written after. With ``affinity`` off nothing is written at all: the
API makes no offers, and the worker spends no Redis commands on them."""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import redis

from shared.affinity import LIVE, adapter_member
from shared.keys import Keys
from shared.prefix_hash import chain, to_hex
from shared.settings import Settings
from worker.engine_port import Engine
from worker.publisher import Publisher

# Members per SADD: a whole cache (tens of thousands of blocks) goes in several commands.
MEMBERS_PER_COMMAND = 4096


class HeldBlocks:
    def __init__(
        self,
        settings: Settings,
        connection: redis.Redis,
        publisher: Publisher,
        engine: Engine,
        *,
        name: str,
        model: str,
        draining: threading.Event,
    ) -> None:
        self.redis = connection
        self.publisher = publisher
        self.engine = engine
        self.key = Keys.for_prefix(settings.key_prefix).held(model, name)
        self.ttl = max(1, math.ceil(settings.heartbeat_ttl_s))
        self.draining = draining
        self._adapters: set[str] = set()  # adapter members as last written
        self._rewrite = threading.Event()  # set by the heartbeat; the engine loop writes the whole set
        self._rewrite.set()  # the first write creates it
        self._withdrawn = not settings.affinity
        self.rewrites = 0
        self.block_size = settings.block_size  # the API's, which must be the engine's
        self._cache: set[int] = set()  # the engine's cached hashes, as its changes reported them
        self._promised: Counter[int] = Counter()  # hashes promised by the requests running here
        self._promises: dict[str, list[int]] = {}  # request id -> the hashes it promised
        self._promise_add: list[int] = []  # to advertise at the next sync
        self._promise_drop: list[int] = []  # to withdraw at the next sync

    # The engine loop ---------------------------------------------------------------------
    def promise(self, request_id: str, prompt_token_ids: Sequence[int], tenant: str | None) -> None:
        """A request started here: its prompt's full blocks are advertised from the next sync on."""
        if self._withdrawn:
            return
        hashes = chain(prompt_token_ids, self.block_size, tenant=tenant)
        self._promises[request_id] = hashes
        for h in hashes:
            if not self._promised[h] and h not in self._cache:
                self._promise_add.append(h)
            self._promised[h] += 1

    def settled(self, request_id: str) -> None:
        """A request ended here (or left): what it promised and the cache does not hold is withdrawn."""
        for h in self._promises.pop(request_id, ()):
            self._promised[h] -= 1
            if not self._promised[h]:
                del self._promised[h]
                if h not in self._cache:
                    self._promise_drop.append(h)

    def sync(self) -> None:
        """Hands the publisher what the engine cached and evicted since the last call."""
        if self._withdrawn:
            return
        if self.draining.is_set():
            self._withdrawn = True
            key = self.key
            self.publisher.mirror(lambda pipe: pipe.delete(key))
            return
        full = self._rewrite.is_set()
        self._rewrite.clear()
        changes = self.engine.prefix_cache_changes(full)
        if changes.full:
            self._cache = set(changes.cached)
        else:
            self._cache.update(changes.cached)
            self._cache.difference_update(changes.evicted)
        # A block evicted while a running request promised it: that request computes it again.
        add = {h for h in self._promise_add if self._promised[h]} - self._cache
        drop = {h for h in self._promise_drop if not self._promised[h]} - self._cache
        self._promise_add, self._promise_drop = [], []
        if changes.full:
            add = set(self._promised) - self._cache
        cached = [to_hex(h) for h in (*changes.cached, *sorted(add))]
        evicted = [to_hex(h) for h in (*changes.evicted, *sorted(drop)) if not self._promised[h]]
        adapters = self._adapter_members()
        if changes.full:
            cached.extend(sorted(adapters))
        else:
            cached.extend(sorted(adapters - self._adapters))
            evicted.extend(sorted(self._adapters - adapters))
        self._adapters = adapters
        if changes.full:
            self.rewrites += 1
            self.publisher.mirror(self._whole(cached))
        elif cached or evicted:
            self.publisher.mirror(self._delta(cached, evicted))

    def _adapter_members(self) -> set[str]:
        held = getattr(self.engine, "adapters", None)
        return {adapter_member(key) for key in held.loaded_keys()} if held is not None else set()

    def _whole(self, members: list[str]) -> Any:
        key, ttl = self.key, self.ttl

        def write(pipe: Any) -> None:
            pipe.delete(key)
            pipe.sadd(key, LIVE)
            for chunk in _chunks(members):
                pipe.sadd(key, *chunk)
            pipe.expire(key, ttl)

        return write

    def _delta(self, cached: list[str], evicted: list[str]) -> Any:
        key, ttl = self.key, self.ttl

        def write(pipe: Any) -> None:
            for chunk in _chunks(evicted):
                pipe.srem(key, *chunk)
            for chunk in _chunks(cached):
                pipe.sadd(key, *chunk)
            pipe.expire(key, ttl)  # a set re-created here (it had expired) goes again if never rewritten

        return write

    # The heartbeat -----------------------------------------------------------------------
    def refresh(self, pipe: Any) -> int:
        """Adds the TTL refresh to the heartbeat's pipeline; the number of commands it added."""
        if self.draining.is_set() or self._withdrawn:
            return 0
        pipe.sismember(self.key, LIVE)
        pipe.expire(self.key, self.ttl)
        return 2

    def refreshed(self, replies: list[Any]) -> None:
        """The replies of ``refresh``'s commands: a set without ``LIVE`` is written again whole."""
        if not replies[0]:
            self._rewrite.set()

    # Stopping ----------------------------------------------------------------------------
    def remove(self) -> None:
        try:
            self.redis.delete(self.key)
        except redis.RedisError:
            pass  # it expires after its TTL


def _chunks(members: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(members), MEMBERS_PER_COMMAND):
        yield members[i : i + MEMBERS_PER_COMMAND]
