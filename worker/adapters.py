"""The worker's side of the deployment's LoRA adapters (``shared.adapters``): registers the ones its
settings name, finds the files of the one a request names, and has its engine load the registry's
adapters of its model at start, so a restarted worker holds them again before work arrives."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shared.adapters import AdapterRecord, all_adapters, lookup, parse_spec, register
from shared.keys import Keys
from shared.settings import Settings
from shared.tenant_labels import TenantLabels
from worker.engine import LoRARequest

log = logging.getLogger("inflightq.worker")

LOOKUP_TTL_S = 5.0  # how long a name's record is trusted before Redis is asked again (unload, re-register)
LABELS_MAX = 32  # adapters labelled by name in the metrics beyond the configured ones; later ones count as "other"


class UnknownAdapterError(ValueError):
    pass


class WorkerAdapters:
    def __init__(self, settings: Settings, redis: Any, model: str, *, worker: str = "", engine: Any = None) -> None:
        self.redis, self.keys, self.model = redis, Keys.for_prefix(settings.key_prefix), model
        self.configured = [parse_spec(spec) for spec in settings.lora_adapters]
        self._cache: dict[str, tuple[float, LoRARequest]] = {}
        self.worker, self.engine = worker, engine
        self.labels = TenantLabels([name for name, _ in self.configured], LABELS_MAX)
        self.requests: dict[str, int] = {}  # label -> requests started with the adapter
        self.tokens: dict[tuple[str, str], int] = {}  # (label, prompt | generated) -> tokens

    def prefetch(self, name: str) -> None:
        """Loads the adapter ``name`` into the engine if it does not hold it: called where a request is accepted
        (an I/O thread), so the engine loop rarely waits on a disk read when it starts the request. A name it
        cannot load is left for the start to report."""
        held = getattr(self.engine, "adapters", None)
        if held is None:
            return
        try:
            request = self.request_for(name)
            if held.get(request.key) is None:
                held.release(held.acquire(request))
        except (OSError, ValueError) as error:
            log.info("LoRA adapter %s not prefetched: %s", name, error)

    def started(self, adapter: str, prompt_tokens: int) -> None:
        label = self.labels(adapter)
        self.requests[label] = self.requests.get(label, 0) + 1
        self.tokens[label, "prompt"] = self.tokens.get((label, "prompt"), 0) + prompt_tokens

    def generated(self, adapter: str) -> None:
        key = (self.labels(adapter), "generated")
        self.tokens[key] = self.tokens.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        """Requests and tokens per adapter (bounded labels); the engine's loads, evictions and load time."""
        base = [self.worker, self.model]
        requests = CounterMetricFamily(
            "inflightq_worker_adapter_requests",
            "Requests this worker started with a LoRA adapter, by adapter (bounded labels).",
            labels=["worker", "model", "adapter"],
        )
        for label, count in list(self.requests.items()):
            requests.add_metric([*base, label], count)
        yield requests
        tokens = CounterMetricFamily(
            "inflightq_worker_adapter_tokens",
            "Tokens of requests with a LoRA adapter, by adapter (bounded labels) and kind: prompt or generated.",
            labels=["worker", "model", "adapter", "kind"],
        )
        for (label, kind), count in list(self.tokens.items()):
            tokens.add_metric([*base, label, kind], count)
        yield tokens
        held = getattr(self.engine, "adapters", None)
        if held is None:
            return
        for name, doc, value in (
            ("adapter_loads", "LoRA adapters loaded from disk.", held.loads),
            ("adapter_evictions", "LoRA adapters dropped to stay within max_loras.", held.evictions),
            ("adapter_load_seconds", "Time spent loading LoRA adapters from disk.", held.load_time_s),
        ):
            family = CounterMetricFamily(f"inflightq_worker_{name}", doc, labels=["worker", "model"])
            family.add_metric(base, value)
            yield family
        gauge = GaugeMetricFamily(
            "inflightq_worker_adapters_loaded", "LoRA adapters held now.", labels=["worker", "model"]
        )
        gauge.add_metric(base, len(held))
        yield gauge

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
