"""How long requests wait, per priority level: observed once per request by the engine loop,
exported by the worker's metrics endpoint."""

from __future__ import annotations

from prometheus_client import Histogram

# From an idle stack's tens of milliseconds to a saturated queue's minutes.
LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2.5, 5, 10, 20, 40, 80, 160, 320)


class PriorityLatency:
    """Per priority level: how long requests waited in Redis, and how long until their first token
    (both from submission). Requests resumed after a takeover are left out: their clock restarted."""

    def __init__(self, worker: str, model: str) -> None:
        self.labels = {"worker": worker, "model": model}
        names = ["worker", "model", "priority"]
        self.time_in_queue = Histogram(
            "inflightq_worker_time_in_queue_seconds",
            "From submission until this worker started the request, by priority.",
            names,
            registry=None,
            buckets=LATENCY_BUCKETS,
        )
        self.time_to_first_token = Histogram(
            "inflightq_worker_time_to_first_token_seconds",
            "From submission until the first token, by priority.",
            names,
            registry=None,
            buckets=LATENCY_BUCKETS,
        )

    def started(self, priority: int, waited_s: float) -> None:
        self.time_in_queue.labels(**self.labels, priority=str(priority)).observe(max(0.0, waited_s))

    def first_token(self, priority: int, after_s: float) -> None:
        self.time_to_first_token.labels(**self.labels, priority=str(priority)).observe(max(0.0, after_s))
