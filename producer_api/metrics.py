"""Every Prometheus metric of the API, on a registry of its own so the API's /metrics shows only these."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

# Latency buckets span a cached answer (milliseconds) up to a long CPU generation (minutes).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

REQUESTS = Counter(
    "inflightq_api_requests_total",
    "HTTP requests answered, by route template, status code and error type ('' on success).",
    ["route", "status", "error_type"],
    registry=REGISTRY,
)
REQUEST_DURATION = Histogram(
    "inflightq_api_request_duration_seconds",
    "Time from a request's arrival to the end of its response (a whole stream, for SSE).",
    ["route"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "inflightq_api_time_to_first_token_seconds",
    "Time from a request's arrival to its first generated token reaching the API.",
    ["route"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
INTER_TOKEN_LATENCY = Histogram(
    "inflightq_api_inter_token_latency_seconds",
    "Time between two consecutive tokens of one request, as the API sees them.",
    ["route"],
    buckets=_TOKEN_BUCKETS,
    registry=REGISTRY,
)
QUEUE_TIME = Histogram(
    "inflightq_api_queue_time_seconds",
    "Time a finished request waited in Redis before a worker started it.",
    ["model"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
E2E_LATENCY = Histogram(
    "inflightq_api_e2e_latency_seconds",
    "Time from a request's submission to the queue to its final result (queue wait + generation).",
    ["model"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "inflightq_api_prompt_tokens_total", "Prompt tokens of submitted requests.", ["model"], registry=REGISTRY
)
GENERATED_TOKENS = Counter(
    "inflightq_api_generated_tokens_total", "Tokens relayed to clients.", ["model"], registry=REGISTRY
)
SUBMITTED = Counter(
    "inflightq_api_submitted_total",
    "Requests enqueued into Redis, by model and priority.",
    ["model", "priority"],
    registry=REGISTRY,
)
TENANT_REJECTIONS = Counter(
    "inflightq_api_tenant_rejections_total",
    "Requests refused with 429, by tenant (bounded: tenant_metrics, tenant_metrics_max, the rest 'other') and "
    "limit: tenant_overloaded (its max_queued), overloaded (the model's max_queue_depth), requests_per_minute, "
    "tokens_per_minute.",
    ["tenant", "limit"],
    registry=REGISTRY,
)
# The names TENANT_REJECTIONS' limit label takes.
REJECTION_LIMITS = ("tenant_overloaded", "overloaded", "requests_per_minute", "tokens_per_minute")
CANCELLED_ON_DISCONNECT = Counter(
    "inflightq_api_cancelled_on_disconnect_total",
    "Requests cancelled because their client went away before the end.",
    registry=REGISTRY,
)
STREAMS_IN_FLIGHT = Gauge(
    "inflightq_api_streams_in_flight", "SSE streams open right now, by route.", ["route"], registry=REGISTRY
)
REQUESTS_IN_FLIGHT = Gauge(
    "inflightq_api_requests_in_flight", "HTTP requests being answered right now.", registry=REGISTRY
)
AFFINITY_LOOKUPS = Counter(
    "inflightq_api_affinity_lookups_total",
    "Prefix-affinity lookups at dispatch, by model and outcome: offered (to the live worker holding the longest "
    "prefix) or none (no worker holds its first block, or every worker holds as much).",
    ["model", "outcome"],
    registry=REGISTRY,
)
AFFINITY_OFFERED_TOKENS = Counter(
    "inflightq_api_affinity_offered_tokens_total",
    "Prompt tokens of offered requests that the worker they were offered to held cached when they were offered.",
    ["model"],
    registry=REGISTRY,
)
