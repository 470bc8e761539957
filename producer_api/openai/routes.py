"""OpenAI's routes: /v1/completions, /v1/chat/completions (stream or not, n choices), /v1/models[/{model}].

Each request becomes n queued requests per prompt (n choices, each with its own derived seed)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from producer_api.adapters import adapters_of, resolve_model_or_adapter
from producer_api.api_keys import ApiKey
from producer_api.auth import authenticate
from producer_api.models_common import OPENAI_ERRORS, OpenAIErrorBody
from producer_api.openai.formatting import (
    ChatStream,
    CompletionStream,
    Reply,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    system_fingerprint,
    usage,
)
from producer_api.openai.models import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingFields,
)
from producer_api.openai.structured import (
    parse_tool_calls,
    response_format_constraint,
    template_messages,
    tool_plan,
)
from producer_api.relay import Formatter, stream_response
from producer_api.routing import OpenAIRoute
from producer_api.state import AppState, arrival, state_of
from producer_api.streaming import unless_disconnected
from producer_api.tokenization import enforce_limits
from producer_api.validation import check_stops, resolve_deadline, resolve_priority
from shared.errors import ModelNotFoundError, UnsupportedParameterError, ValidationError
from shared.request_builder import derived, new_request, sampling_spec
from shared.schemas import Constraint, QueuedRequest

router = APIRouter(prefix="/v1", tags=["OpenAI"], route_class=OpenAIRoute)


def _stream_doc(chunk_name: str) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "description": f"JSON, or with `stream: true` server-sent events of {chunk_name} objects ending with "
            "`data: [DONE]` (a usage chunk first when `stream_options.include_usage`).",
        },
        **OPENAI_ERRORS,
    }


@dataclass
class Plan:
    model: str
    prompts: list[list[int]]  # one per prompt; each becomes n submissions
    submissions: list[QueuedRequest]  # prompt-major: choice index = prompt * n + j
    n: int


def build_plan(
    st: AppState,
    body: SamplingFields,
    key: ApiKey | None,
    tenant: str | None,
    prompts: list[list[int]],
    *,
    prompt_field: str,
    max_tokens: int | None,
    max_tokens_field: str,
    logprobs: int | None,
    constraint: Constraint | None = None,
    adapter: str | None = None,
) -> Plan:
    settings = st.settings
    stops = check_stops(settings, body.stop_list)
    priority = resolve_priority(settings, body.priority, key)
    deadline = resolve_deadline(body)
    limited: list[list[int]] = []
    max_new: int = 1
    for ids in prompts:
        ids, max_new = enforce_limits(
            settings, ids, max_tokens, prompt_field=prompt_field, max_new_tokens_field=max_tokens_field
        )
        limited.append(ids)
    spec = sampling_spec(
        max_new_tokens=max_new,
        temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default is 1
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        seed=body.seed,
        stop=stops,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        constraint=constraint,
        speculate=body.speculate,
    )
    subs = [
        new_request(body.model, ids, derived(spec, j), priority=priority, deadline=deadline, tenant=tenant)
        for ids in limited
        for j in range(body.n)
    ]
    for sub in subs:
        sub.adapter = adapter
    return Plan(body.model, limited, subs, body.n)


def reject_unsupported(**fields: Any) -> None:
    for name, value in fields.items():
        if value:
            raise UnsupportedParameterError(f"{name} is not supported by this server", field=name)


# Completions ------------------------------------------------------------------------------------


async def completion_prompts(st: AppState, body: CompletionRequest) -> list[list[int]]:
    prompt = body.prompt
    vocab = len(st.tokenizers.get(body.model))
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ValidationError("prompt must not be empty", field="prompt")
    out: list[list[int]] = []
    for item in prompt:
        if isinstance(item, str):
            out.append(await anyio.to_thread.run_sync(st.tokenizers.encode, body.model, item))
        else:
            ids = [item] if isinstance(item, int) else list(item)
            if any(not 0 <= t < vocab for t in ids):
                raise ValidationError(f"prompt holds token ids outside the vocabulary (0..{vocab - 1})", field="prompt")
            out.append(ids)
    if len(out) * body.n > 64:
        raise ValidationError("prompts x n must be at most 64", field="n")
    return out


@router.post(
    "/completions",
    response_model=Completion,
    responses=_stream_doc("text_completion"),
    summary="Completions (OpenAI)",
)
async def completions(
    request: Request, body: CompletionRequest, key: ApiKey | None = Depends(authenticate)
) -> Response:
    st = state_of(request)
    body.model, adapter = await resolve_model_or_adapter(st, body.model)
    st.tokenizers.get(body.model)  # unknown model -> 422 before any work
    reject_unsupported(suffix=body.suffix, logit_bias=body.logit_bias)
    constraint = response_format_constraint(body.response_format)
    if body.best_of is not None and body.best_of != body.n:
        raise UnsupportedParameterError("best_of must equal n (no server-side ranking)", field="best_of")
    prompts = await completion_prompts(st, body)
    plan = build_plan(
        st,
        body,
        key,
        st.tenants.resolve(request, key, body.user),
        prompts,
        prompt_field="prompt",
        max_tokens=body.max_tokens,
        max_tokens_field="max_tokens",
        logprobs=body.logprobs,
        constraint=constraint,
        adapter=adapter,
    )
    ids = await st.dispatcher.submit_all(plan.submissions, key=key)
    echoes = [st.tokenizers.decode(body.model, p) if body.echo else "" for p in plan.prompts]
    reply = reply_for(body, plan, "text_completion", f"cmpl-{ids[0]}")
    follow = follow_kwargs(request, plan, "/v1/completions")
    if body.stream:
        formatter = CompletionStream(reply, choices=len(ids), echoes=echoes, logprobs=body.logprobs)
        return relay_choices(st, ids, follow, formatter)
    gens = await unless_disconnected(request, st.dispatcher.collect_all(ids, **follow))
    choices = []
    for i, gen in enumerate(gens):
        assert gen.result is not None  # collect() raises unless the request finished with a result
        echo = echoes[i // plan.n]
        shown = None if body.logprobs is None else completion_logprobs(gen.tokens, len(echo), body.logprobs)
        choices.append(
            {"index": i, "text": echo + gen.result.text, "logprobs": shown, "finish_reason": finish_reason(gen.result)}
        )
    payload = {
        "id": reply.id,
        "object": "text_completion",
        "created": reply.created,
        "model": body.model,
        "choices": choices,
        "usage": usage(plan.prompts, [g.result for g in gens if g.result is not None]),
        "system_fingerprint": system_fingerprint(body.model),
    }
    return JSONResponse(payload, headers={"x-request-id": ids[0]})


def reply_for(body: SamplingFields, plan: Plan, kind: str, response_id: str) -> Reply:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Reply(response_id, kind, int(time.time()), body.model, plan.prompts, plan.n, include_usage)


def follow_kwargs(request: Request, plan: Plan, route: str) -> dict[str, Any]:
    deadline = plan.submissions[0].deadline
    return {"route": route, "model": plan.model, "started": arrival(request), "deadline": deadline}


def relay_choices(st: AppState, request_ids: list[str], follow: dict[str, Any], formatter: Formatter) -> Response:
    """The SSE response of n choices; choices left unfinished (client gone, error mid-way) are cancelled."""
    return stream_response(
        [st.dispatcher.events(request_id, **follow) for request_id in request_ids],
        formatter,
        route=follow["route"],
        settings=st.settings,
        headers={"x-request-id": request_ids[0]},
    )


# Chat -------------------------------------------------------------------------------------------


@router.post(
    "/chat/completions",
    response_model=ChatCompletion,
    responses=_stream_doc("chat.completion.chunk"),
    summary="Chat completions (OpenAI; the model's chat template)",
)
async def chat_completions(
    request: Request, body: ChatCompletionRequest, key: ApiKey | None = Depends(authenticate)
) -> Response:
    st = state_of(request)
    body.model, adapter = await resolve_model_or_adapter(st, body.model)
    st.tokenizers.get(body.model)
    reject_unsupported(logit_bias=body.logit_bias)
    if body.top_logprobs is not None and not body.logprobs:
        raise ValidationError("top_logprobs needs logprobs: true", field="top_logprobs")
    constraint = response_format_constraint(body.response_format)
    # With tools a response_format is the answer the model gives when it calls none (tool_choice auto).
    tools = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, constraint)
    calling = tools is not None and tools.constraint is not None
    template = st.tokenizers.chat_template(body.model)
    messages = template_messages([chat_message(m) for m in body.messages], tools, template)
    template_tools = tools.tools if tools is not None and "tools" in template else None
    prompt = await anyio.to_thread.run_sync(st.tokenizers.apply_chat_template, body.model, messages, template_tools)
    max_tokens_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    plan = build_plan(
        st,
        body,
        key,
        st.tenants.resolve(request, key, body.user),
        [prompt],
        prompt_field="messages",
        max_tokens=body.max_completion_tokens or body.max_tokens,
        max_tokens_field=max_tokens_field,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        constraint=tools.constraint if calling and tools is not None else constraint,
        adapter=adapter,
    )
    ids = await st.dispatcher.submit_all(plan.submissions, key=key)
    reply = reply_for(body, plan, "chat.completion.chunk", f"chatcmpl-{ids[0]}")
    follow = follow_kwargs(request, plan, "/v1/chat/completions")
    if body.stream:
        return relay_choices(st, ids, follow, ChatStream(reply, ids, logprobs=body.logprobs, tools=calling))
    gens = await unless_disconnected(request, st.dispatcher.collect_all(ids, **follow))
    choices = []
    for i, gen in enumerate(gens):
        assert gen.result is not None
        message: dict[str, Any] = {"role": "assistant", "content": gen.result.text}
        finish = finish_reason(gen.result)
        if calling:
            content, calls = parse_tool_calls(gen.result.text, gen.request_id)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls" if finish != "length" else finish
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(gen.tokens) if body.logprobs else None,
                "finish_reason": finish,
            }
        )
    payload = {
        "id": reply.id,
        "object": "chat.completion",
        "created": reply.created,
        "model": body.model,
        "choices": choices,
        "usage": usage(plan.prompts, [g.result for g in gens if g.result is not None]),
        "system_fingerprint": system_fingerprint(body.model),
    }
    return JSONResponse(payload, headers={"x-request-id": ids[0]})


def chat_message(message: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.tool_calls:
        out["tool_calls"] = message.tool_calls
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


# Models -----------------------------------------------------------------------------------------


async def live_models(st: AppState) -> dict[str, ModelCard]:
    """The served models that have a live worker, each dated by the start of one of them, and their LoRA
    adapters (``parent``: the base model)."""
    served = set(st.settings.served_models)
    cards: dict[str, ModelCard] = {}
    for heartbeat in await st.dispatcher.live_workers():
        if heartbeat.model in served and heartbeat.model not in cards:
            cards[heartbeat.model] = ModelCard(id=heartbeat.model, created=int(heartbeat.started_at))
    for name, record in (await adapters_of(st)).items():  # a LoRA adapter is listed while its base is
        base = cards.get(record.base)
        if base is not None and name not in cards:
            cards[name] = ModelCard(id=name, created=base.created, parent=record.base)
    return cards


@router.get("/models", response_model=ModelList, responses=OPENAI_ERRORS, summary="Models with live workers")
async def list_models(request: Request, key: ApiKey | None = Depends(authenticate)) -> ModelList:
    return ModelList(data=list((await live_models(state_of(request))).values()))


_MODEL_NOT_FOUND = {"model": OpenAIErrorBody, "description": "model_not_found: not served here, or no live worker now"}


@router.get(
    "/models/{model:path}",
    response_model=ModelCard,
    responses={**OPENAI_ERRORS, 404: _MODEL_NOT_FOUND},
    summary="One model with live workers",
)
async def retrieve_model(model: str, request: Request, key: ApiKey | None = Depends(authenticate)) -> ModelCard:
    """The model as ``/v1/models`` lists it; OpenAI's 404 ``model_not_found`` for one it does not list."""
    st = state_of(request)
    card = (await live_models(st)).get(model)
    if card is not None:
        return card
    if model in st.settings.served_models:
        raise ModelNotFoundError(f"model {model!r} is served here but has no live worker now", field="model")
    served = ", ".join(st.settings.served_models)
    raise ModelNotFoundError(f"model {model!r} is not served here; served: {served}", field="model")
