"""What each tenant got from this worker: tokens served (prompt and generated) and time to first
token, under bounded tenant labels (``shared.tenant_labels``). The engine loop only adds to plain
counters; the metrics endpoint reads them at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from shared.tenant_labels import TenantLabels
from worker.priority_latency import LATENCY_BUCKETS


class TenantUsage:
    def __init__(self, worker: str, model: str, labels: TenantLabels) -> None:
        self.worker, self.model = worker, model
        self.labels = labels
        self.tokens: dict[tuple[str, str], int] = {}  # (tenant label, prompt|generated) -> tokens
        self.time_to_first_token = Histogram(
            "inflightq_worker_tenant_time_to_first_token_seconds",
            "From submission until the first token, by tenant (bounded: tenant_metrics, tenant_metrics_max, "
            "the rest 'other').",
            ["worker", "model", "tenant"],
            registry=None,
            buckets=LATENCY_BUCKETS,
        )

    def started(self, tenant: str | None, prompt_tokens: int) -> None:
        self._add(tenant, "prompt", prompt_tokens)

    def generated(self, tenant: str | None) -> None:
        self._add(tenant, "generated", 1)

    def first_token(self, tenant: str | None, after_s: float) -> None:
        label = self.labels(tenant)
        self.time_to_first_token.labels(self.worker, self.model, label).observe(max(0.0, after_s))

    def _add(self, tenant: str | None, kind: str, count: int) -> None:
        key = (self.labels(tenant), kind)
        self.tokens[key] = self.tokens.get(key, 0) + count

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "inflightq_worker_tenant_tokens",
            "Tokens this worker served, by tenant (bounded labels) and kind: prompt (of requests it started) or "
            "generated.",
            labels=["worker", "model", "tenant", "kind"],
        )
        for (tenant, kind), count in list(self.tokens.items()):
            family.add_metric([self.worker, self.model, tenant, kind], count)
        yield family
