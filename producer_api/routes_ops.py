"""Operations: /health (Redis reachable, live workers per model), /queue (what waits, as JSON, for an
autoscaler such as KEDA's metrics-api trigger) and /metrics (Prometheus)."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from producer_api import metrics
from producer_api.queue_metrics import queue_registry
from producer_api.routing import TgiRoute
from producer_api.state import state_of
from producer_api.tgi.models import Health, QueueView
from shared.errors import ValidationError

router = APIRouter(tags=["Operations"], route_class=TgiRoute)


@router.get(
    "/health",
    response_model=Health,
    responses={503: {"model": Health, "description": "Redis is unreachable"}},
    summary="Liveness and readiness",
    description="200 while Redis answers. Workers may scale to zero, so none live is reported, not an error.",
)
async def health(request: Request) -> JSONResponse:
    st = state_of(request)
    workers: dict[str, int] = {}
    try:
        ok = bool(await st.redis.ping())
        live = await st.dispatcher.live_workers()
        for model in st.settings.served_models:
            workers[model] = sum(1 for w in live if w.model == model)
    except Exception:
        ok = False
    body = Health(status="ok" if ok else "unavailable", redis=ok, workers=workers)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
    summary="Prometheus metrics (inflightq_api_*, and the queue's inflightq_queue_* read from Redis)",
)
async def metrics_route(request: Request) -> Response:
    # The queue's gauges are read from Redis at scrape time (blocking, short timeouts): in a thread.
    queue = await anyio.to_thread.run_sync(generate_latest, queue_registry(state_of(request).settings))
    return Response(generate_latest(metrics.REGISTRY) + queue, media_type=CONTENT_TYPE_LATEST)


@router.get(
    "/queue",
    response_model=QueueView,
    summary="What waits for a worker, per priority (for autoscalers)",
    description="Requests no worker has taken yet, per priority, over every tenant's lane and offer stream: "
    "KEDA's metrics-api trigger scales workers on it (deploy/k8s/keda-scaledobject.yaml). A redis-streams "
    "trigger reads one stream and would miss the requests of named tenants, which wait in their own lanes.",
)
async def queue(request: Request, model: str | None = None) -> QueueView:
    st = state_of(request)
    served = st.settings.served_models
    name = model if model is not None else served[0] if len(served) == 1 else None
    if name is None or name not in served:
        raise ValidationError(f"model must be one of the served models {served}", field="model")
    depth = await st.dispatcher.client.queue_depth(name)
    return QueueView(
        model=name,
        waiting={f"p{priority}": count for priority, count in sorted(depth.items())},
        waiting_total=sum(depth.values()),
        oldest_waiting_age_s=await st.dispatcher.client.oldest_waiting_age_s(name),
    )
