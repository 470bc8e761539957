"""The worker's side of the deployment's LoRA adapters (``shared.adapters``): registers the ones its
settings name, finds the files of the one a request names, and has its engine load the registry's
adapters of its model at start, so a restarted worker holds them again before work arrives."""

from __future__ import annotations

import logging
import time
from typing import Any

from shared.adapters import AdapterRecord, all_adapters, lookup, parse_spec, register
from shared.keys import Keys
from shared.settings import Settings
from worker.engine import LoRARequest

log = logging.getLogger("inflightq.worker")

LOOKUP_TTL_S = 5.0  # how long a name's record is trusted before Redis is asked again (unload, re-register)


class UnknownAdapterError(ValueError):
    pass


class WorkerAdapters:
    def __init__(self, settings: Settings, redis: Any, model: str) -> None:
        self.redis, self.keys, self.model = redis, Keys.for_prefix(settings.key_prefix), model
        self.configured = [parse_spec(spec) for spec in settings.lora_adapters]
        self._cache: dict[str, tuple[float, LoRARequest]] = {}

    def register_configured(self) -> None:
        for name, path in self.configured:
            register(self.redis, self.keys, AdapterRecord(name=name, base=self.model, path=path))
        if self.configured:
            log.info("LoRA adapters registered: %s", ", ".join(name for name, _ in self.configured))

    def of_model(self) -> list[LoRARequest]:
        """The registry's adapters of this worker's model."""
        records = all_adapters(self.redis, self.keys).values()
        return [LoRARequest(r.name, r.path) for r in records if r.base == self.model]

    def request_for(self, name: str) -> LoRARequest:
        """The adapter a request names; raises ``UnknownAdapterError`` for one not registered for this model."""
        now = time.monotonic()
        cached = self._cache.get(name)
        if cached is not None and now - cached[0] < LOOKUP_TTL_S:
            return cached[1]
        record = lookup(self.redis, self.keys, name)
        if record is None or record.base != self.model:
            self._cache.pop(name, None)
            raise UnknownAdapterError(f"adapter {name!r} is not registered for model {self.model!r}")
        request = LoRARequest(record.name, record.path)
        self._cache[name] = (now, request)
        return request


def preload(engine: Any, adapters: list[LoRARequest], limit: int) -> int:
    """Loads up to ``limit`` of ``adapters`` into ``engine`` (unpinned: the LRU may drop them later); a
    broken adapter is logged and skipped. Returns how many loaded."""
    held = getattr(engine, "adapters", None)
    if held is None:
        return 0
    loaded = 0
    for request in adapters[:limit]:
        try:
            held.release(held.acquire(request))
            loaded += 1
        except (OSError, ValueError) as error:
            log.warning("LoRA adapter %s not loaded: %s", request.name, error)
    return loaded
