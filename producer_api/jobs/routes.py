"""Async jobs: submit now (202), poll, stream with Last-Event-ID resume, cancel.

Jobs do not wait for a live worker: a queued job is what scales a worker pool up from zero
(KEDA on stream lag). Leaving a job's stream does not cancel the job; DELETE does."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Depends, Header, Path, Query, Request
from fastapi.responses import JSONResponse, Response

from producer_api import sse
from producer_api.api_keys import ApiKey
from producer_api.auth import authenticate
from producer_api.idempotency import IdempotencyKey, once
from producer_api.jobs.models import Job, JobCancelled, JobCreated, JobError, JobRequest, JobResult, JobUsage
from producer_api.models_common import TGI_ERRORS, ErrorBody, inline_schema
from producer_api.ownership import owner_of, visible
from producer_api.relay import stream_response
from producer_api.routing import TgiRoute
from producer_api.state import AppState, arrival, state_of
from producer_api.tgi.formatting import TgiStream
from producer_api.tgi.models import StreamResponse
from producer_api.tokenization import enforce_limits
from producer_api.validation import check_stops, resolve_deadline, resolve_model, resolve_priority
from shared.errors import NotFoundError, ValidationError
from shared.request_builder import new_request, sampling_spec
from shared.request_lifecycle import RequestStatus
from shared.schemas import RequestInfo

router = APIRouter(prefix="/v1/jobs", tags=["Jobs"], route_class=TgiRoute)

_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorBody, "description": "no such job"}}
JobId = Path(description="The id POST /v1/jobs returned.")
_MAX_ID_LENGTH = 128  # QueuedRequest's limit: a longer id cannot exist


async def prompt_ids(st: AppState, model: str, body: JobRequest) -> tuple[list[int], str]:
    if body.messages is not None:
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        return await anyio.to_thread.run_sync(st.tokenizers.apply_chat_template, model, messages), "messages"
    if isinstance(body.prompt, str):
        return await anyio.to_thread.run_sync(st.tokenizers.encode, model, body.prompt), "prompt"
    vocab = len(st.tokenizers.get(model))
    ids = list(body.prompt or [])
    if any(not 0 <= t < vocab for t in ids):
        raise ValidationError(f"prompt holds token ids outside the vocabulary (0..{vocab - 1})", field="prompt")
    return ids, "prompt"


@router.post(
    "",
    status_code=202,
    response_model=JobCreated,
    responses=TGI_ERRORS,
    summary="Submit a job; answers at once with its id",
)
async def create_job(
    request: Request,
    body: JobRequest,
    key: ApiKey | None = Depends(authenticate),
    idempotency_key: str | None = IdempotencyKey,
) -> JSONResponse:
    st, fingerprint = state_of(request), ("/v1/jobs", body.model_dump(mode="json"))
    return await once(st, owner_of(key), idempotency_key, fingerprint, lambda: submit(request, body, key))


async def submit(request: Request, body: JobRequest, key: ApiKey | None) -> JSONResponse:
    st = state_of(request)
    settings = st.settings
    model = resolve_model(settings, body.model or settings.model)
    st.tokenizers.get(model)
    check_stops(settings, body.stop)
    priority = resolve_priority(settings, body.priority, key)
    deadline = resolve_deadline(body)
    vocab = len(st.tokenizers.get(model))
    if any(not 0 <= t < vocab for t in body.stop_token_ids):
        raise ValidationError(f"stop_token_ids must be token ids (0..{vocab - 1})", field="stop_token_ids")
    ids, field = await prompt_ids(st, model, body)
    ids, max_new_tokens = enforce_limits(
        settings, ids, body.max_new_tokens, prompt_field=field, max_new_tokens_field="max_new_tokens"
    )
    spec = sampling_spec(
        max_new_tokens=max_new_tokens,
        **body.model_dump(
            include={
                "temperature",
                "top_k",
                "top_p",
                "min_p",
                "typical_p",
                "repetition_penalty",
                "frequency_penalty",
                "presence_penalty",
                "seed",
                "stop",
                "stop_token_ids",
                "ignore_eos",
                "logprobs",
                "constraint",
                "speculate",
            }
        ),
    )
    tenant = st.tenants.resolve(request, key, body.tenant, field="tenant")
    queued = new_request(model, ids, spec, priority=priority, deadline=deadline, tenant=tenant)
    request_id = await st.dispatcher.submit(queued, need_worker=False, key=key)
    created = JobCreated(
        id=request_id,
        status=RequestStatus.QUEUED,
        model=model,
        priority=priority,
        prompt_tokens=len(ids),
        max_new_tokens=max_new_tokens,
        tenant=tenant,
    )
    return JSONResponse(
        created.model_dump(mode="json"), status_code=202, headers={"location": f"/v1/jobs/{request_id}"}
    )


def job_of(info: RequestInfo) -> Job:
    result = None
    if info.result is not None:
        r = info.result
        result = JobResult(
            generated_text=r.text,
            token_ids=r.token_ids,
            finish_reason=r.finish_reason,
            usage=JobUsage(**r.usage.model_dump()),
            queue_time_s=r.timings.queue_time_s,
            inference_time_s=r.timings.inference_time_s,
        )
    error = JobError(error=info.error.message, error_type=info.error.error_type) if info.error else None
    return Job(
        id=info.id,
        status=info.status,
        model=info.model or None,
        priority=info.priority,
        submitted_at=info.submitted_at,
        started_at=info.started_at,
        finished_at=info.finished_at,
        worker=info.worker,
        attempt=info.attempt,
        tenant=info.tenant,
        result=result,
        error=error,
    )


async def find(st: AppState, job_id: str, owner: str | None) -> RequestInfo:
    """The job, when ``owner`` (``ownership.owner_of``) may see it; anyone else gets not-found."""
    info = await st.dispatcher.client.status(job_id) if len(job_id) <= _MAX_ID_LENGTH else None
    if info is None or not visible(info.tenant, owner):
        raise NotFoundError(f"no job {job_id!r} (unknown, or its result expired)", field="id")
    return info


@router.get(
    "/{job_id}", response_model=Job, responses={**TGI_ERRORS, **_NOT_FOUND}, summary="A job's status and result"
)
async def get_job(request: Request, job_id: str = JobId, owner: str | None = Depends(owner_of)) -> Job:
    return job_of(await find(state_of(request), job_id, owner))


@router.get(
    "/{job_id}/stream",
    response_class=Response,
    responses={
        200: {
            "description": "Server-sent events in /generate_stream's shape, each with `id: <token index>`; send "
            "`Last-Event-ID` (or `?last_event_id=`) to resume after that token. Ends after the job's last event, "
            "or with an `unavailable` error event when no worker has served the model for no_worker_wait_s (the "
            "job itself stays queued: reconnect later). Leaving the stream does not cancel the job.",
            "content": {"text/event-stream": {"schema": inline_schema(StreamResponse)}},
        },
        **TGI_ERRORS,
        **_NOT_FOUND,
    },
    summary="Stream a job's tokens (resumable)",
)
async def stream_job(
    request: Request,
    job_id: str = JobId,
    last_event_id: str | None = Header(None, description="Resume after this token index."),
    last_event_id_query: str | None = Query(
        None, alias="last_event_id", description="Same, for EventSource-less clients."
    ),
    owner: str | None = Depends(owner_of),
) -> Response:
    st = state_of(request)
    info = await find(st, job_id, owner)
    resume_after = sse.parse_last_event_id(last_event_id if last_event_id is not None else last_event_id_query)
    events = st.dispatcher.events(
        job_id,
        route="/v1/jobs/{job_id}/stream",
        model=info.model,
        started=arrival(request),
        from_index=0 if resume_after is None else resume_after + 1,
        cancel_if_unfinished=False,
    )
    special = st.tokenizers.special_ids(info.model) if info.model in st.settings.served_models else frozenset()
    return stream_response(
        [events],
        TgiStream(seed=None, special_ids=special, with_ids=True),
        route="/v1/jobs/{job_id}/stream",
        settings=st.settings,
        headers={"x-request-id": job_id},
    )


@router.delete("/{job_id}", response_model=JobCancelled, responses={**TGI_ERRORS, **_NOT_FOUND}, summary="Cancel a job")
async def cancel_job(request: Request, job_id: str = JobId, owner: str | None = Depends(owner_of)) -> JobCancelled:
    st = state_of(request)
    await find(st, job_id, owner)
    try:
        cancelled = await st.dispatcher.client.cancel(job_id)
    except NotFoundError:
        raise NotFoundError(f"no job {job_id!r} (unknown, or its result expired)", field="id") from None
    return JobCancelled(id=job_id, cancelled=bool(cancelled))
