"""The worker's Prometheus endpoint (``--metrics-port``): service counters and engine stats, read
at scrape time so the engine loop does no metrics work, and the latency histograms per priority
level (``worker/priority_latency.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from worker.service import WorkerService

COUNTERS = {
    "generated_tokens": "Tokens generated and published.",
    "completed": "Requests finished with a result.",
    "cancelled": "Requests cancelled (queued or running).",
    "expired": "Requests past their deadline (queued or running).",
    "taken_over": "Requests resumed from a dead or draining worker.",
    "dead_lettered": "Entries sent to the dead-letter stream.",
    "handed_back": "Requests handed back to the queue (drain, engine failure).",
}


class WorkerCollector:
    def __init__(self, service: WorkerService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        labels = {"worker": self.service.name, "model": self.service.model}
        names, values = list(labels), list(labels.values())
        for name, doc in COUNTERS.items():
            family = CounterMetricFamily(f"inflightq_worker_{name}", doc, labels=names)
            family.add_metric(values, self.service.counters[name])
            yield family
        engine = self.service.engine
        stats = engine.stats
        gauges = {
            "running_requests": ("Sequences running in the engine.", stats.num_running),
            "waiting_requests": ("Sequences in the engine but not yet admitted to the batch.", stats.num_waiting),
            "engine_batch_tokens": ("Tokens in the last engine step's forward.", stats.batch_tokens),
            "engine_batch_sequences": ("Sequences in the last engine step's forward.", stats.batch_seqs),
            "free_kv_blocks": ("Free KV cache blocks.", engine.num_free_blocks),
            "kv_blocks": ("KV cache blocks in total.", engine.num_total_blocks),
            "engine_warmup_seconds": (
                "Seconds the engine spent at start compiling its forward or capturing its decode CUDA graphs.",
                stats.warmup_s,
            ),
            "draining": ("1 while the worker drains after SIGTERM.", int(self.service.draining.is_set())),
        }
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(f"inflightq_worker_{name}", doc, labels=names)
            gauge.add_metric(values, value)
            yield gauge
        engine_counters = {
            "engine_steps": ("Engine steps.", stats.steps),
            "engine_preemptions": ("Sequences preempted (for KV blocks or for more urgent work).", stats.preemptions),
            "engine_recomputed_tokens": ("Tokens whose KV a preemption discarded.", stats.recomputed_tokens),
            "engine_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            "engine_prefix_cache_hits": ("Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            "engine_forward_seconds": ("Time in model forwards.", stats.forward_time_s),
            "engine_step_seconds": ("Time in engine steps.", stats.step_time_s),
            "engine_interrupted_steps": (
                "Steps stopped between layers for an urgent arrival (their work computed again).",
                stats.interrupted_steps,
            ),
            "engine_interrupted_seconds": ("Forward time the stopped steps had spent.", stats.interrupted_time_s),
            "engine_generated_tokens": (
                "Tokens the engine generated (several per sequence in a step that kept a draft).",
                stats.generated_tokens,
            ),
            "engine_token_steps": (
                "Sequence-steps that generated tokens (engine_generated_tokens over it: tokens per sequence-step).",
                stats.token_steps,
            ),
            "engine_draft_tokens": ("Tokens proposed by n-gram speculation and checked by a step.", stats.draft_tokens),
            "engine_draft_accepted_tokens": (
                "Of the proposed tokens, those the step kept.",
                stats.draft_accepted_tokens,
            ),
        }
        for name, (doc, value) in engine_counters.items():
            family = CounterMetricFamily(f"inflightq_worker_{name}", doc, labels=names)
            family.add_metric(values, value)
            yield family
        by_reason = CounterMetricFamily(
            "inflightq_worker_engine_preemptions_by_reason",
            "Sequences preempted: kv_blocks (the cache ran short), urgency (more urgent work displaced them) or "
            "fair_share (a tenant under its share displaced them).",
            labels=[*names, "reason"],
        )
        for reason, count in stats.preemptions_by_reason.items():
            by_reason.add_metric([*values, reason], count)
        yield by_reason
        yield from self._affinity(names, values)

    def _affinity(self, names: list[str], values: list[str]) -> Iterator[Metric]:
        """Prefix reuse and where pulls came from (``offer_stats``): the affinity panel's counters."""
        stats, offers = self.service.engine.stats, self.service.intake.offer_stats
        singles = {
            "prefill_tokens": (
                "Prompt tokens computed: looked up in the prefix cache and not found (the rest were reused).",
                stats.prefix_cache_queries - stats.prefix_cache_hits,
            ),
            "affinity_offers_taken": (
                "Requests offered to this worker (it held their prefix) and pulled by it.",
                offers.offers_taken,
            ),
            "affinity_offers_timed_out": (
                "Requests offered to another live, busy worker that this worker took once the offer had waited "
                "affinity_steal_after_ms.",
                offers.steals["timed_out"],
            ),
        }
        for name, (doc, value) in singles.items():
            family = CounterMetricFamily(f"inflightq_worker_{name}", doc, labels=names)
            family.add_metric(values, value)
            yield family
        steals = CounterMetricFamily(
            "inflightq_worker_affinity_steals",
            "Requests offered to another worker that this one took: idle (this worker ran nothing), timed_out (the "
            "offer waited affinity_steal_after_ms) or worker_gone (its worker died or drains).",
            labels=[*names, "reason"],
        )
        for reason, count in offers.steals.items():
            steals.add_metric([*values, reason], count)
        yield steals


def serve_metrics(service: WorkerService, port: int) -> None:
    registry = CollectorRegistry()
    registry.register(WorkerCollector(service))  # type: ignore[arg-type]
    registry.register(service.latency.time_in_queue)
    registry.register(service.latency.time_to_first_token)
    registry.register(service.tenant_usage.time_to_first_token)
    registry.register(service.tenant_usage)  # type: ignore[arg-type]
    registry.register(service.adapters)  # type: ignore[arg-type]
    start_http_server(port, registry=registry)
