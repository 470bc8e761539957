"""The /v1/responses request body: what we accept, and a 400 naming every parameter we do not support.

Input items become chat messages for the model's chat template: message items {"role", "content"},
function_call items an assistant's ``tool_calls``, function_call_output items role "tool" messages,
the shapes the chat route takes. ``text.format`` and function ``tools`` are translated into the chat
route's shapes and go through its structured-output machinery (``producer_api.openai.structured``),
so both routes build the same constraint and parse the same calls."""

from __future__ import annotations

import json
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from producer_api.openai.structured import ToolPlan, response_format_constraint, tool_plan
from shared.errors import ValidationError
from shared.schemas import Constraint, Seed

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
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Accepted with their neutral values only (anything else is refused below).
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
    seed: Seed | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False


def parse(raw: Any) -> ResponsesRequest:
    if not isinstance(raw, dict):
        raise ValidationError("the body must be a JSON object", field="body")
    try:
        body = ResponsesRequest.model_validate(raw)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        if err["type"] == "extra_forbidden":
            raise ValidationError(f"unsupported parameter: {field}", field=field) from None
        raise ValidationError(f"{field}: {err['msg']}", field=field) from None
    refuse_unsupported(body)
    return body


def refuse_unsupported(body: ResponsesRequest) -> None:
    def no(field: str, why: str = "is not supported by this server") -> None:
        raise ValidationError(f"unsupported parameter: {field} {why}", field=field)

    for name in ("reasoning", "prompt", "conversation", "max_tool_calls", "include", "stream_options"):
        if getattr(body, name):
            no(name)
    if body.top_logprobs:
        no("top_logprobs")
    for i, tool in enumerate(body.tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            no(f"tools[{i}].type", f"({kind!r}: hosted tools are not supported, function tools are)")
    if isinstance(body.tool_choice, dict) and body.tool_choice.get("type") != "function":
        no("tool_choice", f"({body.tool_choice.get('type')!r}: only none, auto, required or a function)")
    if body.text and set(body.text) - {"format", "verbosity"}:
        no("text." + sorted(set(body.text) - {"format", "verbosity"})[0])
    if body.background and not body.store:
        raise ValidationError("background requires store=true", field="store")


def text_format(body: ResponsesRequest) -> tuple[dict[str, Any], Constraint | None]:
    """``text.format`` as the response echoes it, and the constraint it puts on the output (the chat
    route's ``response_format``, whose json_schema nests what Responses gives flat)."""
    fmt = (body.text or {}).get("format")
    if fmt is None:
        return {"type": "text"}, None
    if not isinstance(fmt, dict):
        raise ValidationError("text.format must be an object with a type", field="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return {"type": "text"}, None
    if kind == "json_object":
        return {"type": "json_object"}, _in_responses_terms(response_format_constraint, {"type": "json_object"})
    if kind != "json_schema":
        raise ValidationError("text.format.type must be text, json_object or json_schema", field="text.format.type")
    name, schema = fmt.get("name"), fmt.get("schema")
    if not isinstance(name, str) or not name:
        raise ValidationError("text.format.name is required for json_schema", field="text.format.name")
    if not isinstance(schema, dict):
        raise ValidationError("text.format.schema must be a JSON schema object", field="text.format.schema")
    unknown = set(fmt) - {"type", "name", "schema", "strict", "description"}
    if unknown:
        raise ValidationError(f"unsupported parameter: text.format.{sorted(unknown)[0]}", field="text.format")
    constraint = _in_responses_terms(
        response_format_constraint, {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    )
    echo = {"type": "json_schema", "name": name, "schema": schema, "strict": fmt.get("strict")}
    if fmt.get("description") is not None:
        echo["description"] = fmt["description"]
    return echo, constraint


def tools_of(body: ResponsesRequest, answer: Constraint | None) -> ToolPlan | None:
    """The chat route's tool plan for Responses' flat function tools ({"type", "name", "parameters",
    ...}) and tool_choice ({"type": "function", "name"}): the same grammar, template and parsing.
    ``answer``: text.format's constraint, the answer when the model calls nothing."""
    chat_tools = []
    for i, tool in enumerate(body.tools or []):
        unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            raise ValidationError(f"unsupported parameter: tools[{i}].{sorted(unknown)[0]}", field=f"tools[{i}]")
        chat_tools.append(
            {
                "type": "function",
                "function": {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None},
            }
        )
    choice: Any = body.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return _in_responses_terms(tool_plan, chat_tools or None, choice, body.parallel_tool_calls, answer)


def _in_responses_terms(build: Any, *args: Any) -> Any:
    """The chat route's error for a bad constraint or tool, naming the Responses API's field (text.format)."""
    try:
        return build(*args)
    except ValidationError as exc:
        field = {"response_format": "text.format"}.get(exc.field or "", exc.field)
        raise ValidationError(exc.message.replace("response_format", "text.format"), field=field) from None


_ROLES = ("user", "system", "developer", "assistant")


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages; a 400 names the malformed or unsupported item."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    if not body.input:
        raise ValidationError("input must not be empty", field="input")
    return items_to_messages(body.input, "input")


def items_to_messages(items: list[Any], field: str) -> list[dict[str, Any]]:
    """Input items (or an earlier response's output items, which have the same shapes) as chat
    messages: consecutive function calls join one assistant turn, as the model would have made them."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise ValidationError(f"{where} must be an object", field=where)
        kind = item.get("type", "message")
        if kind == "function_call":
            call = function_call_of(item, where)
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", []), call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            continue
        if kind == "function_call_output":
            out.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": _call_output(item, where)}
            )
            continue
        if kind != "message":
            raise ValidationError(f"unsupported input item type {kind!r}", field=f"{where}.type")
        role = item.get("role")
        if role not in _ROLES:
            raise ValidationError(f"{where}.role must be one of {', '.join(_ROLES)}", field=f"{where}.role")
        content = item.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list) and content:
            parts = []
            for j, part in enumerate(content):
                ptype = part.get("type") if isinstance(part, dict) else None
                if ptype not in ("input_text", "output_text", "text"):
                    raise ValidationError(
                        f"unsupported content part type {ptype!r} (text only: no images, files or audio)",
                        field=f"{where}.content[{j}].type",
                    )
                if not isinstance(part.get("text"), str):
                    raise ValidationError("a text part needs a string text", field=f"{where}.content[{j}].text")
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise ValidationError(
                f"{where}.content must be a string or a non-empty list of parts", field=f"{where}.content"
            )
        out.append({"role": "system" if role == "developer" else role, "content": text})
    return out


def function_call_of(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A function_call item as a chat tool call; its arguments must be a JSON object (the template
    renders them as one)."""
    arguments = _string(item, "arguments", where)
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValidationError(f"{where}.arguments must be a JSON object (as text)", field=f"{where}.arguments")
    return {
        "id": _string(item, "call_id", where),
        "type": "function",
        "function": {"name": _string(item, "name", where), "arguments": arguments},
    }


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and key != "arguments"):
        raise ValidationError(f"{where}.{key} must be a non-empty string", field=f"{where}.{key}")
    return value


def _call_output(item: dict[str, Any], where: str) -> str:
    output = item.get("output")
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(
        isinstance(p, dict) and p.get("type") == "input_text" and isinstance(p.get("text"), str) for p in output
    ):
        return "".join(p["text"] for p in output)
    raise ValidationError(f"{where}.output must be a string or input_text parts", field=f"{where}.output")


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
