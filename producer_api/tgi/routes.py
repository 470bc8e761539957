"""TGI's routes: POST / (compat), /generate, /generate_stream, /tokenize, /info."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from producer_api.adapters import resolve_adapter_id
from producer_api.api_keys import ApiKey
from producer_api.auth import authenticate
from producer_api.dispatch import Dispatcher
from producer_api.models_common import TGI_ERRORS, inline_schema
from producer_api.relay import stream_response
from producer_api.routing import TgiRoute
from producer_api.state import arrival, state_of
from producer_api.streaming import unless_disconnected
from producer_api.strict_schema import strict_schema
from producer_api.tgi import formatting
from producer_api.tgi.models import GenerateRequest, GenerateResponse, Grammar, Info, SimpleToken, StreamResponse
from producer_api.timing import tgi_headers
from producer_api.tokenization import enforce_limits
from producer_api.validation import (
    check_stops,
    constraint_of,
    resolve_deadline,
    resolve_priority,
)
from shared.errors import ValidationError
from shared.request_builder import derived, new_request, sampling_spec
from shared.schemas import Constraint, QueuedRequest

router = APIRouter(tags=["TGI"], route_class=TgiRoute)

_STREAM_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Server-sent events, one `data:` line per token (a StreamResponse); the last event "
        "carries `generated_text` and `details`. Errors after the stream began arrive as "
        '`data: {"error": ..., "error_type": ...}`.',
        "content": {"text/event-stream": {"schema": inline_schema(StreamResponse)}},
    },
    **TGI_ERRORS,
}


@dataclass
class TgiPlan:
    submission: QueuedRequest
    body: GenerateRequest
    validated: float
    submissions: list[QueuedRequest]  # best_of of them (derived seeds); submission is the first


async def plan(request: Request, body: GenerateRequest, key: ApiKey | None, *, stream: bool = False) -> TgiPlan:
    st = state_of(request)
    settings = st.settings
    p = body.parameters
    best_of = p.best_of or 1
    check_stops(settings, p.stop, "parameters.stop")
    priority = resolve_priority(settings, p.priority, key)
    deadline = resolve_deadline(p)
    model = settings.model
    adapter = await resolve_adapter_id(st, model, p.adapter_id, "parameters.adapter_id") if p.adapter_id else None
    ids = await anyio.to_thread.run_sync(st.tokenizers.encode, model, body.inputs)
    ids, max_new_tokens = enforce_limits(
        settings,
        ids,
        p.max_new_tokens,
        prompt_field="inputs",
        max_new_tokens_field="parameters.max_new_tokens",
        truncate=p.truncate,
    )
    # As TGI: any warper (temperature, top-k/p, typical-p) turns sampling on, not only do_sample.
    sample = p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p, p.min_p))
    if best_of > 1:  # TGI's rules, in TGI's words
        if not sample:
            raise ValidationError("you must use sampling when `best_of` is > 1", field="parameters.best_of")
        if p.seed is not None:
            raise ValidationError("`seed` must not be set when `best_of` > 1", field="parameters.seed")
        if stream:
            message = "`best_of` != 1 is not supported when streaming tokens"
            raise ValidationError(message, field="parameters.best_of")
    spec = sampling_spec(
        max_new_tokens=max_new_tokens,
        temperature=(p.temperature or 1.0) if sample else 0.0,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        typical_p=p.typical_p,
        repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        seed=p.seed,
        stop=p.stop,
        ignore_eos=p.ignore_eos,
        # TGI always reports each token's logprob, so always ask for it (top-n only when asked).
        logprobs=p.top_n_tokens or 0,
        constraint=grammar_constraint(p.grammar),
        watermark=p.watermark or None,
        speculate=p.speculate,
    )
    tenant = st.tenants.resolve(request, key)
    submissions = [
        new_request(model, ids, derived(spec, i), priority=priority, deadline=deadline, tenant=tenant)
        for i in range(best_of)
    ]
    for submission in submissions:
        submission.adapter = adapter
    return TgiPlan(submissions[0], body, time.perf_counter(), submissions)


def grammar_constraint(grammar: Grammar | None) -> Constraint | None:
    """TGI's grammar as the wire constraint: json (a schema, as an object or JSON text; strict, as
    TGI's outlines reads it: ``producer_api.strict_schema``) or regex."""
    if grammar is None:
        return None
    value = grammar.value
    if grammar.type == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            message = "parameters.grammar.value must be a JSON schema"
            raise ValidationError(message, field="parameters.grammar") from None
    kind = {"json": "json_schema", "regex": "regex", "json_object": "json_object"}[grammar.type]
    return constraint_of({"type": kind, "value": strict_schema(value)}, "parameters.grammar")


async def generate(request: Request, body: GenerateRequest, key: ApiKey | None, route: str) -> tuple[dict, dict]:
    st = state_of(request)
    tgi = await plan(request, body, key)
    dispatcher: Dispatcher = st.dispatcher
    sub = tgi.submission
    request_ids = await dispatcher.submit_all(tgi.submissions, key=key)
    follow = {"route": route, "model": sub.model, "started": arrival(request), "deadline": sub.deadline}
    generations = await unless_disconnected(request, dispatcher.collect_all(request_ids, **follow))
    # best_of: the sequence of highest cumulative logprob wins (TGI's choice); the rest follow it.
    order = sorted(range(len(generations)), key=lambda i: -sum(t.logprob or 0.0 for t in generations[i].tokens))
    best = order[0]
    generation = generations[best]
    result = generation.result
    assert result is not None  # collect() raises unless the request finished with a result
    p = body.parameters
    prefix = body.inputs if p.return_full_text else ""
    payload: dict[str, Any] = {"generated_text": prefix + result.text}
    if p.details:
        special = st.tokenizers.special_ids(sub.model)
        prompt = prefill(request, sub) if p.decoder_input_details else []

        def details(i: int) -> dict[str, Any]:
            gen = generations[i]
            assert gen.result is not None
            return {
                "finish_reason": gen.result.finish_reason,
                "generated_tokens": gen.result.usage.completion_tokens,
                "seed": tgi.submissions[i].sampling.seed,
                "prefill": prompt,
                "tokens": [formatting.token(t) for t in gen.tokens],
                "top_tokens": [formatting.top_tokens(t, special) or [] for t in gen.tokens] if p.top_n_tokens else None,
            }

        others = [{"generated_text": prefix + generations[i].result.text, **details(i)} for i in order[1:]]  # type: ignore[union-attr]
        payload["details"] = {**details(best), "best_of_sequences": others or None}
    headers = tgi_headers(
        arrived=arrival(request),
        validated=tgi.validated,
        finished=time.perf_counter(),
        result=result,
        device=dispatcher.device_of(sub.model, result.worker),
        prompt_chars=len(body.inputs),
    )
    return payload, headers


def prefill(request: Request, sub: QueuedRequest) -> list[dict[str, Any]]:
    # Prompt logprobs are not computed by the engine; TGI also leaves the first one null.
    tokenizer = state_of(request).tokenizers.get(sub.model)
    texts = tokenizer.convert_ids_to_tokens(sub.prompt_token_ids)
    return [{"id": i, "text": t, "logprob": None} for i, t in zip(sub.prompt_token_ids, texts, strict=True)]


async def generate_stream(request: Request, body: GenerateRequest, key: ApiKey | None, route: str) -> Response:
    st = state_of(request)
    tgi = await plan(request, body, key, stream=True)
    sub = tgi.submission
    request_id = await st.dispatcher.submit(sub, key=key)
    events = st.dispatcher.events(
        request_id, route=route, model=sub.model, started=arrival(request), deadline=sub.deadline
    )
    formatter = formatting.TgiStream(
        seed=sub.sampling.seed,
        special_ids=st.tokenizers.special_ids(sub.model),
        prefix=body.inputs if body.parameters.return_full_text else "",
    )
    return stream_response(
        [events],
        formatter,
        route=route,
        settings=st.settings,
        headers={"x-request-id": request_id},
    )


@router.post(
    "/generate",
    response_model=GenerateResponse,
    responses=TGI_ERRORS,
    summary="Generate text (TGI)",
    description="Answers when generation ends, with TGI's timing headers (x-queue-time, x-inference-time, ...).",
)
async def generate_route(
    request: Request, body: GenerateRequest, key: ApiKey | None = Depends(authenticate)
) -> JSONResponse:
    payload, headers = await generate(request, body, key, "/generate")
    return JSONResponse(payload, headers=headers)


@router.post(
    "/generate_stream",
    response_class=Response,
    responses=_STREAM_DOC,
    summary="Generate text as a token stream (TGI, SSE)",
)
async def generate_stream_route(
    request: Request, body: GenerateRequest, key: ApiKey | None = Depends(authenticate)
) -> Response:
    return await generate_stream(request, body, key, "/generate_stream")


@router.post(
    "/",
    response_model=list[GenerateResponse],
    responses={**_STREAM_DOC, 200: {"description": "A one-element list (stream false) or SSE (stream true)."}},
    summary="TGI's compat route: /generate or /generate_stream by the body's `stream`",
)
async def compat_route(request: Request, body: GenerateRequest, key: ApiKey | None = Depends(authenticate)) -> Response:
    if body.stream:
        return await generate_stream(request, body, key, "/")
    payload, headers = await generate(request, body, key, "/")
    return JSONResponse([payload], headers=headers)


@router.post("/tokenize", response_model=list[SimpleToken], responses=TGI_ERRORS, summary="Tokenize inputs (TGI)")
async def tokenize_route(
    request: Request, body: GenerateRequest, key: ApiKey | None = Depends(authenticate)
) -> list[SimpleToken]:
    st = state_of(request)
    tokens = await anyio.to_thread.run_sync(st.tokenizers.tokenize, st.settings.model, body.inputs)
    return [SimpleToken(id=t.id, text=t.text, start=t.start, stop=t.stop) for t in tokens]


@router.get("/info", response_model=Info, summary="Model and limits (TGI)")
async def info_route(request: Request) -> Info:
    from importlib.metadata import version

    settings = state_of(request).settings
    return Info(
        model_id=settings.model,
        models=settings.served_models,
        max_stop_sequences=settings.max_stop_sequences,
        max_input_tokens=settings.max_input_tokens,
        max_total_tokens=settings.max_total_tokens,
        max_new_tokens=settings.max_new_tokens,
        max_queue_depth=settings.max_queue_depth,
        priority_levels=settings.priority_levels,
        default_priority=settings.default_priority,
        version=version("inflightq"),
    )
