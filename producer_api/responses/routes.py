"""/v1/responses: create (plain, streamed, background), retrieve (or stream it again from any
sequence number), cancel, delete, input_items.

Background responses are durable: the response's record lives in Redis (``store.py``), its state is
its request's hash and its events are its request's replay log, so any API replica serves them, an
API restart loses nothing and a worker crash is taken over like any queued request."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import anyio
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from producer_api.api_keys import ApiKey
from producer_api.auth import authenticate
from producer_api.idempotency import HEADER, IdempotencyKey, once
from producer_api.models_common import OPENAI_ERRORS
from producer_api.openai.structured import template_messages
from producer_api.ownership import owner_of, visible
from producer_api.relay import stream_response
from producer_api.responses import objects
from producer_api.responses.formatting import ResponseStream
from producer_api.responses.models import (
    ResponsesRequest,
    input_messages,
    items_to_messages,
    parse,
    text_format,
    tier_of,
    tier_priority,
    tools_of,
)
from producer_api.responses.store import ResponseStore
from producer_api.routing import OpenAIRoute
from producer_api.state import AppState, arrival, state_of
from producer_api.streaming import unless_disconnected
from producer_api.tokenization import enforce_limits
from producer_api.validation import check_stops, resolve_model, resolve_priority
from shared.errors import NotFoundError, ValidationError
from shared.event_delivery import parse_log_entry
from shared.request_builder import new_request, sampling_spec
from shared.schemas import ErrorEvent, TokenEvent

router = APIRouter(prefix="/v1/responses", tags=["Responses"], route_class=OpenAIRoute)
_CANCEL_WAIT_S = 5.0


def store_of(st: AppState) -> ResponseStore:
    return ResponseStore(st.dispatcher.client.redis, st.dispatcher.client.keys, st.settings.response_ttl_s)


async def load(st: AppState, response_id: str, owner: str | None, field: str = "id") -> dict[str, Any]:
    """The stored record, when ``owner`` (``ownership.owner_of``) may see it; anyone else gets not-found."""
    record = await store_of(st).get(response_id)
    if record is None or not visible(record.get("owner"), owner):
        raise NotFoundError(f"no response {response_id!r} (unknown, not stored, deleted or expired)", field=field)
    return record


async def current(st: AppState, record: dict[str, Any]) -> dict[str, Any]:
    """The response object as it stands now; a final one's output is kept in its record."""
    if record.get("final") is not None:
        return dict(record["final"])
    info = await st.dispatcher.client.status(record["id"])
    if info is None:  # the request hash expired before anyone read the result
        return objects.response_object(
            record,
            "failed",
            text="",
            output_tokens=0,
            error=ErrorEvent(request_id=record["id"], error_type="expired", message="the response's result expired"),
        )
    status = objects.status_of(info.status, info.result)
    if status == "in_progress":  # the output so far, as OpenAI shows it while a response runs
        text, _ = await partial_text(st, record["id"])
        return objects.response_object(record, status, text=text)
    if not info.status.is_final:
        return objects.response_object(record, status)
    if info.result is not None:
        text, tokens = info.result.text, info.result.usage.completion_tokens
        record["completed_at"] = info.finished_at
    else:
        text, tokens = await partial_text(st, record["id"])
    final = objects.response_object(record, status, text=text, output_tokens=tokens, error=info.error)
    if record["params"]["store"]:
        record["final"] = final
        await store_of(st).update(record)
    return final


async def partial_text(st: AppState, request_id: str) -> tuple[str, int]:
    """Text of the tokens a running, cancelled or failed request produced, from its replay log."""
    client = st.dispatcher.client
    entries = await client.redis.xrange(client.keys.replay_log(request_id))
    texts: dict[int, str] = {}
    for _, fields in entries:
        event = parse_log_entry(
            {
                (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in fields.items()
            }
        )
        if isinstance(event, TokenEvent):
            texts.setdefault(event.index, event.text)
    return "".join(texts[i] for i in sorted(texts)), len(texts)


async def conversation(st: AppState, body: ResponsesRequest, owner: str | None) -> list[dict[str, Any]]:
    """The messages before this request's input: the previous response's context, input and output."""
    if body.previous_response_id is None:
        return []
    prev = await load(st, body.previous_response_id, owner, field="previous_response_id")
    final = await current(st, prev)
    if final["status"] not in ("completed", "incomplete"):
        raise ValidationError(
            f"previous response {prev['id']!r} is {final['status']}, not completed", field="previous_response_id"
        )
    # Its output items (text, function calls) are shaped as input items are.
    output = items_to_messages(final["output"], "previous_response_id") if final["output"] else []
    return [*prev["context"], *prev["messages"], *output]


def input_items(response_id: str, body: ResponsesRequest) -> list[dict[str, Any]]:
    """The input as input_items.list shows it (already checked by ``input_messages``)."""
    raw = body.input if isinstance(body.input, list) else [{"role": "user", "content": body.input}]
    suffix = response_id.removeprefix("resp_")
    items = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message")
        if kind == "function_call":
            fields = {k: item[k] for k in ("call_id", "name", "arguments")}
            items.append({"id": item.get("id") or f"fc_{suffix}_in{i}", "type": kind, **fields, "status": "completed"})
            continue
        if kind == "function_call_output":
            fields = {k: item[k] for k in ("call_id", "output")}
            items.append({"id": item.get("id") or f"fco_{suffix}_{i}", "type": kind, **fields, "status": "completed"})
            continue
        role = item.get("role", "user")
        content = item["content"]
        text = content if isinstance(content, str) else "".join(part["text"] for part in content)
        kind = "output_text" if role == "assistant" else "input_text"
        part: dict[str, Any] = {"type": kind, "text": text}
        if kind == "output_text":
            part["annotations"] = []
        items.append(
            {"id": f"msg_{suffix}_{i}", "type": "message", "role": role, "status": "completed", "content": [part]}
        )
    return items


def tools_echo(body: ResponsesRequest) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "name": t["name"],
            "description": t.get("description"),
            "parameters": t.get("parameters") or {"type": "object", "properties": {}},
            "strict": t.get("strict"),
        }
        for t in body.tools or []
    ]


def tool_choice_echo(body: ResponsesRequest) -> Any:
    if isinstance(body.tool_choice, dict):
        return {"type": "function", "name": body.tool_choice.get("name")}
    return body.tool_choice or "auto"


@router.post("", responses=OPENAI_ERRORS, summary="Create a response (OpenAI Responses API)")
async def create_response(
    request: Request, key: ApiKey | None = Depends(authenticate), idempotency_key: str | None = IdempotencyKey
) -> Response:
    try:
        raw = await request.json()
    except ValueError:
        raise ValidationError("the body is not valid JSON", field="body") from None
    body = parse(raw)
    if idempotency_key is not None and body.stream:
        raise ValidationError(f"{HEADER} applies to answers of one object, not to stream=true", field=HEADER)
    st = state_of(request)
    return await once(st, owner_of(key), idempotency_key, ("/v1/responses", raw), lambda: start(request, body, key))


async def start(request: Request, body: ResponsesRequest, key: ApiKey | None) -> Response:
    """Creates the response (stored when body.store) and its request; answers as body asks."""
    st = state_of(request)
    settings = st.settings
    model = resolve_model(settings, body.model or settings.model)
    st.tokenizers.get(model)
    messages = input_messages(body)
    fmt, constraint = text_format(body)
    tools = tools_of(body, constraint)
    calling = tools is not None and tools.constraint is not None
    owner = owner_of(key)
    context = await conversation(st, body, owner)
    chat = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + context + messages
    # As the chat route: templates that know tools get them, the others get them in the system message.
    template = st.tokenizers.chat_template(model)
    chat = template_messages(chat, tools, template)
    template_tools = tools.tools if tools is not None and "tools" in template else None
    ids = await anyio.to_thread.run_sync(st.tokenizers.apply_chat_template, model, chat, template_tools)
    ids, max_new = enforce_limits(
        settings, ids, body.max_output_tokens, prompt_field="input", max_new_tokens_field="max_output_tokens"
    )
    levels, default = settings.priority_levels, settings.default_priority
    wanted = body.priority if body.priority is not None else tier_priority(body.service_tier, levels, default)
    priority = resolve_priority(settings, wanted, key)
    spec = sampling_spec(
        max_new_tokens=max_new,
        temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default is 1
        top_p=body.top_p,
        seed=body.seed,
        stop=check_stops(settings, [body.stop] if isinstance(body.stop, str) else list(body.stop or [])),
        ignore_eos=body.ignore_eos,
        constraint=tools.constraint if calling and tools is not None else constraint,
    )
    response_id = "resp_" + uuid.uuid4().hex
    tenant = st.tenants.resolve(request, key, body.user)
    record: dict[str, Any] = {
        "id": response_id,
        "owner": owner,
        "tenant": tenant,
        "created_at": int(time.time()),
        "model": model,
        "priority": priority,
        "service_tier": tier_of(priority, levels, default),
        "prompt_tokens": len(ids),
        "context": context,
        "messages": messages,
        "input_items": input_items(response_id, body),
        "calling": calling,  # its text may hold function calls (objects.EventLog)
        "final": None,
        "params": {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "metadata": body.metadata or {},
            "background": body.background,
            "store": body.store,
            "previous_response_id": body.previous_response_id,
            "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
            "tool_choice": tool_choice_echo(body),
            "tools": tools_echo(body),
            "text": {
                "format": fmt,
                **({"verbosity": body.text["verbosity"]} if body.text and "verbosity" in body.text else {}),
            },
            "truncation": body.truncation or "disabled",
            "user": body.user,
            "safety_identifier": body.safety_identifier,
            "prompt_cache_key": body.prompt_cache_key,
        },
    }
    if body.store:
        await store_of(st).put(record)
    queued = new_request(model, ids, spec, priority=priority, tenant=tenant, request_id=response_id)
    try:
        await st.dispatcher.submit(queued, need_worker=not body.background, key=key)
    except BaseException:
        if body.store:
            await store_of(st).delete(response_id)
        raise
    headers = {"x-request-id": response_id}
    if body.stream:
        first = "queued" if body.background else "in_progress"
        return event_stream(
            st, request, record, -1, first, route="/v1/responses", cancel_if_unfinished=not body.background
        )
    if body.background:
        return JSONResponse(objects.response_object(record, "queued"), headers=headers)

    async def until_final() -> None:
        follow = st.dispatcher.events(
            response_id, route="/v1/responses", model=model, started=arrival(request), cancel_if_unfinished=True
        )
        async with contextlib.aclosing(follow):
            async for _event in follow:
                pass

    await unless_disconnected(request, until_final())  # a client that leaves cancels its response
    return JSONResponse(await current(st, record), headers=headers)


def event_stream(
    st: AppState,
    request: Request,
    record: dict[str, Any],
    after: int,
    first_status: str,
    *,
    route: str,
    cancel_if_unfinished: bool,
) -> Response:
    """The SSE response of the response's numbered events after sequence number ``after``."""
    formatter = ResponseStream(record, after, first_status, lambda: current(st, record))
    events = st.dispatcher.events(
        record["id"],
        route="/v1/responses",
        model=record["model"],
        started=arrival(request),
        from_index=formatter.resume_index,
        cancel_if_unfinished=cancel_if_unfinished,
    )
    return stream_response(
        [events],
        formatter,
        route=route,
        settings=st.settings,
        headers={"x-request-id": record["id"]},
    )


@router.get("/{response_id}", responses=OPENAI_ERRORS, summary="Retrieve a response, or stream its events again")
async def retrieve_response(
    request: Request,
    response_id: str,
    stream: bool = Query(False, description="Stream the response's events (from the start, or after starting_after)."),
    starting_after: int | None = Query(None, ge=-1, description="Sequence number of the last event already seen."),
    include: list[str] | None = Query(None, alias="include[]"),
    owner: str | None = Depends(owner_of),
) -> Response:
    st = state_of(request)
    record = await load(st, response_id, owner)
    if not stream:
        return JSONResponse(await current(st, record))
    first = "queued" if record["params"]["background"] else "in_progress"
    after = -1 if starting_after is None else starting_after
    return event_stream(st, request, record, after, first, route="/v1/responses/{id}", cancel_if_unfinished=False)


@router.post("/{response_id}/cancel", responses=OPENAI_ERRORS, summary="Cancel a background response")
async def cancel_response(request: Request, response_id: str, owner: str | None = Depends(owner_of)) -> Response:
    st = state_of(request)
    record = await load(st, response_id, owner)
    if not record["params"]["background"]:
        raise ValidationError("only background responses can be cancelled", field="response_id")
    try:
        await st.dispatcher.client.cancel(response_id)
    except NotFoundError:
        pass
    give_up = time.monotonic() + _CANCEL_WAIT_S
    while True:  # a running request stops at its worker's next step
        info = await st.dispatcher.client.status(response_id)
        if info is None or info.status.is_final or time.monotonic() > give_up:
            break
        await asyncio.sleep(0.05)
    return JSONResponse(await current(st, record))


@router.delete("/{response_id}", responses=OPENAI_ERRORS, summary="Delete a stored response")
async def delete_response(request: Request, response_id: str, owner: str | None = Depends(owner_of)) -> Response:
    st = state_of(request)
    await load(st, response_id, owner)
    info = await st.dispatcher.client.status(response_id)
    if info is not None and not info.status.is_final:
        await st.dispatcher.cancel_quietly(response_id)
    await store_of(st).delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/{response_id}/input_items", responses=OPENAI_ERRORS, summary="A response's input items")
async def list_input_items(
    request: Request,
    response_id: str,
    limit: int = Query(20, ge=1, le=100),
    order: str = Query("desc", pattern="^(asc|desc)$"),
    after: str | None = Query(None),
    include: list[str] | None = Query(None, alias="include[]"),
    owner: str | None = Depends(owner_of),
) -> Response:
    st = state_of(request)
    record = await load(st, response_id, owner)
    items = list(record["input_items"])
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )
