"""Prefix affinity at dispatch: which live worker a request is offered to (``shared.affinity``).

One script call per request, in the model's slot, over the held sets of the model's live workers
(the ones the dispatch already knows); the least loaded of them come first, so a tie goes to the
one with most room. A request with a LoRA adapter hashes its prefix from the adapter's key (as the engine
does), and goes to a worker holding the adapter when none holds its prefix. Off (``affinity=false``), or a
prompt shorter than a block without an adapter: no lookup."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from producer_api import metrics
from shared.adapters import lookup_async
from shared.affinity import LONGEST_PREFIX, holder, lookup
from shared.keys import Keys
from shared.schemas import QueuedRequest, WorkerHeartbeat
from shared.settings import Settings


class Affinity:
    def __init__(self, settings: Settings, redis: Any) -> None:
        self.settings = settings
        self.keys = Keys.for_prefix(settings.key_prefix)
        self.redis = redis
        self._script = redis.register_script(LONGEST_PREFIX)

    async def offer_to(self, request: QueuedRequest, workers: Sequence[WorkerHeartbeat]) -> str | None:
        """The worker to offer ``request`` to, or None (any worker takes it)."""
        return (await self.offer(request, workers))[0]

    async def offer(self, request: QueuedRequest, workers: Sequence[WorkerHeartbeat]) -> tuple[str | None, int]:
        """The worker to offer ``request`` to (None: any worker takes it) and the prompt tokens it holds cached."""
        if not self.settings.affinity or len(workers) < 2:
            return None, 0
        by_load = sorted(workers, key=lambda w: (w.running + w.waiting) / max(1, w.max_num_seqs))
        names = [w.name for w in by_load]
        adapter = None
        if request.adapter:
            record = await lookup_async(self.redis, self.keys, request.adapter)
            adapter = record.key if record is not None else None
        keys, args = lookup(
            self.keys, request.model, names, request.prompt_token_ids, self.settings.block_size, request.tenant,
            adapter,
        )  # fmt: skip
        if len(args) < 2 and not adapter:
            return None, 0
        worker, blocks = holder(await self._script(keys=keys, args=args), names)
        metrics.AFFINITY_LOOKUPS.labels(request.model, "offered" if worker else "none").inc()
        if worker is None:
            return None, 0
        metrics.AFFINITY_OFFERED_TOKENS.labels(request.model).inc(blocks * self.settings.block_size)
        return worker, blocks * self.settings.block_size
