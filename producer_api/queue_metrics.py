"""Queue metrics, read from Redis when Prometheus scrapes the API's /metrics.

The queue is shared by every API replica and worker, so nobody owns a counter of it: each
scrape asks Redis (a handful of pipelined reads per model). Every API replica exports the
same values; aggregate them with max(), not sum()."""

from __future__ import annotations

from collections.abc import Iterator

import redis
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from producer_api.state import api_client_name
from shared.client import QueueClient
from shared.redis_connect import connect
from shared.settings import Settings
from shared.tenant_labels import TenantLabels


class QueueCollector(Collector):
    def __init__(self, settings: Settings, *, timeout_s: float = 1.0) -> None:
        self.settings = settings
        # Short timeouts and no retries: a scrape must answer even while Redis is away.
        connection = connect(
            settings,
            decode_responses=True,
            encoding_errors="replace",  # a stream entry that is not UTF-8 must not break the scrape
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            client_name=api_client_name(settings),  # counted with the API's pool (CLIENT LIST)
        )
        self.client = QueueClient(settings, client=connection)
        self.labels = TenantLabels.from_settings(settings)

    def describe(self) -> list[GaugeMetricFamily]:
        return list(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up, depth, oldest, workers, dead, tenant_depth = self._families()
        try:
            models = sorted({*self.settings.served_models, *self.client.models()})
            beats = self.client.live_workers()
            for model in models:
                for priority, waiting in self.client.queue_depth(model).items():
                    depth.add_metric([model, str(priority)], waiting)
                by_tenant = self.labels.top(self.client.tenant_waiting(model), self.settings.tenant_metrics_max)
                for tenant, waiting in by_tenant.items():
                    tenant_depth.add_metric([model, tenant], waiting)
                oldest.add_metric([model], self.client.oldest_waiting_age_s(model))
                workers.add_metric([model], sum(1 for beat in beats if beat.model == model))
                dead.add_metric([model], self.client.redis.xlen(self.client.keys.dead_letters(model)))
        except (redis.RedisError, OSError):
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield from (up, depth, oldest, workers, dead, tenant_depth)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily("inflightq_queue_redis_up", "1 when the API's scrape could read the queue from Redis."),
            GaugeMetricFamily(
                "inflightq_queue_depth",
                "Requests waiting in Redis that no worker has taken yet, by model and priority.",
                labels=["model", "priority"],
            ),
            GaugeMetricFamily(
                "inflightq_queue_oldest_waiting_age_seconds",
                "Age of the oldest request no worker has taken yet (0 when none waits).",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "inflightq_workers_live", "Workers whose heartbeat is fresh, by the model they serve.", labels=["model"]
            ),
            GaugeMetricFamily(
                "inflightq_queue_dead_letters",
                "Entries in a model's dead-letter stream (requests given up after too many deliveries).",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "inflightq_queue_tenant_depth",
                "Requests waiting in Redis per model and tenant, every priority together: the tenant_metrics by name, "
                "then the tenant_metrics_max deepest others, the rest as 'other' (none: requests without a tenant).",
                labels=["model", "tenant"],
            ),
        )


def register_queue_metrics(registry: CollectorRegistry, settings: Settings) -> QueueCollector:
    collector = QueueCollector(settings)
    registry.register(collector)
    return collector


_registries: dict[tuple[str, str, tuple[str, ...]], CollectorRegistry] = {}


def queue_registry(settings: Settings) -> CollectorRegistry:
    """One registry per queue (Redis, prefix, models), made on first use; several apps in one
    process (tests) each see their own queue. Its collect() blocks on Redis: call it in a thread."""
    key = (settings.redis_url, settings.key_prefix, tuple(settings.served_models))
    if key not in _registries:
        registry = CollectorRegistry(auto_describe=True)
        register_queue_metrics(registry, settings)
        _registries[key] = registry
    return _registries[key]
