"""The /v1/responses request body: what we accept, and a 400 naming every parameter we do not support.

Input items become chat messages ({"role", "content"}) for the model's chat template. ``text.format``
other than text, function ``tools`` and function-call items are refused until the structured-output
constraint (llguidance) reaches this branch; they plug in at ``constraint_of`` below."""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from shared.errors import ValidationError


class BadRequest(ValidationError):
    """OpenAI answers 400 (never 422) for a request it cannot take; the param names the field."""

    openai_status = 400


# service_tier -> where it lands among the priority levels (0 = most urgent).
SERVICE_TIERS = ("auto", "default", "flex", "priority")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = Field(None, max_length=128)
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    # Accepted with their neutral values only (anything else is refused below).
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    # Identifiers we accept and echo (they change nothing here).
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, max_length=256)
    # Extensions (extra_body), as on the other routes: the queue's own priority (overrides service_tier),
    # seed, stop strings, ignore_eos.
    priority: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    ignore_eos: bool = False


def parse(raw: Any) -> ResponsesRequest:
    if not isinstance(raw, dict):
        raise BadRequest("the body must be a JSON object", field="body")
    try:
        body = ResponsesRequest.model_validate(raw)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        if err["type"] == "extra_forbidden":
            raise BadRequest(f"unsupported parameter: {field}", field=field) from None
        raise BadRequest(f"{field}: {err['msg']}", field=field) from None
    refuse_unsupported(body)
    return body


def refuse_unsupported(body: ResponsesRequest) -> None:
    def no(field: str, why: str = "is not supported by this server") -> None:
        raise BadRequest(f"unsupported parameter: {field} {why}", field=field)

    for name in ("reasoning", "prompt", "conversation", "max_tool_calls", "include", "stream_options"):
        if getattr(body, name):
            no(name)
    if body.top_logprobs:
        no("top_logprobs")
    for i, tool in enumerate(body.tools or []):
        kind = tool.get("type")
        if kind != "function":
            no(f"tools[{i}].type", f"({kind!r}: hosted tools are not supported)")
        no("tools", "(function tools arrive with structured output)")
    if body.tool_choice not in (None, "none", "auto"):
        no("tool_choice")
    fmt = (body.text or {}).get("format")
    if fmt is not None and fmt.get("type") != "text":
        no("text.format", f"({fmt.get('type')!r}: structured output arrives with the structured-output merge)")
    if body.text and set(body.text) - {"format", "verbosity"}:
        no("text." + sorted(set(body.text) - {"format", "verbosity"})[0])
    if body.background and not body.store:
        raise BadRequest("background requires store=true", field="store")


_ROLES = ("user", "system", "developer", "assistant")


def input_messages(body: ResponsesRequest) -> list[dict[str, str]]:
    """The request's input as chat messages; a 400 names the malformed or unsupported item."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    if not body.input:
        raise BadRequest("input must not be empty", field="input")
    out = []
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind != "message":
            raise BadRequest(f"unsupported input item type {kind!r}", field=f"{where}.type")
        role = item.get("role")
        if role not in _ROLES:
            raise BadRequest(f"{where}.role must be one of {', '.join(_ROLES)}", field=f"{where}.role")
        content = item.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list) and content:
            parts = []
            for j, part in enumerate(content):
                ptype = part.get("type") if isinstance(part, dict) else None
                if ptype not in ("input_text", "output_text", "text"):
                    raise BadRequest(
                        f"unsupported content part type {ptype!r} (text only: no images, files or audio)",
                        field=f"{where}.content[{j}].type",
                    )
                if not isinstance(part.get("text"), str):
                    raise BadRequest("a text part needs a string text", field=f"{where}.content[{j}].text")
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise BadRequest(f"{where}.content must be a string or a non-empty list of parts", field=f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": text})
    return out


def tier_priority(tier: str | None, levels: int, default: int) -> int:
    if tier == "priority":
        return 0
    if tier == "flex":
        return levels - 1
    return default


def tier_of(priority: int, levels: int, default: int) -> str:
    """The tier a priority level is reported as (the echo of what the request ran at)."""
    if priority == default:
        return "default"
    if priority < default:
        return "priority"
    return "flex"
