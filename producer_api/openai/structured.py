"""OpenAI's structured outputs and tool calls -> one wire constraint, and the model's text back
into ``tool_calls``.

Tool calls use the Hermes format that SmolLM2, Qwen and most open chat models are trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``required`` and a named function constrain the output to such calls (their JSON to the
functions' parameter schemas); ``auto`` lets the model choose free text or calls, through a Lark
grammar whose text branch cannot begin a call, so a call, once begun, is always well formed.
Templates that know ``tools`` get them (``apply_chat_template(tools=...)``); for the others the
tools go into the system message in the same format.

Schemas are strict (``producer_api.strict_schema``): an object admits only the keys it lists."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from producer_api.strict_schema import strict_schema
from producer_api.validation import constraint_of
from shared.errors import ValidationError
from shared.schemas import Constraint

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
# A call's JSON up to its arguments' value: the grammar writes the name first.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:')
# Compact JSON inside %json (the engine's default for plain schemas, repeated for Lark's).
_COMPACT = {"whitespace_flexible": False}

TOOLS_SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
    "about what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags as follows:\n<tool_call>\n{{"name": <function-name>, '
    '"arguments": <args-json-object>}}\n</tool_call>'
)


def response_format_constraint(response_format: dict[str, Any] | None) -> Constraint | None:
    kind = (response_format or {}).get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        if response_format and response_format.get("value") is not None:
            # TGI's convention (huggingface_hub turns a json_schema response_format into it): the value is a schema.
            value = strict_schema(response_format["value"])
            return constraint_of({"type": "json_schema", "value": value}, "response_format")
        return constraint_of({"type": "json_object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema") if response_format else None
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValidationError(
                "response_format.json_schema must be {'name': ..., 'schema': {...}}", field="response_format"
            )
        schema = strict_schema(spec.get("schema") or {})
        return constraint_of({"type": "json_schema", "value": schema}, "response_format")
    # TGI's chat grammar (huggingface_hub's InferenceClient sends it): {"type": "json" | "regex", "value": ...}
    if kind in ("json", "regex") and response_format and "value" in response_format:
        value = response_format["value"]
        if kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValidationError("response_format.value must be a JSON schema", field="response_format") from None
        wire = "json_schema" if kind == "json" else "regex"
        return constraint_of({"type": wire, "value": strict_schema(value)}, "response_format")
    message = "response_format.type must be text, json_object, json_schema (OpenAI) or json, regex (TGI)"
    raise ValidationError(message, field="response_format")


@dataclass
class ToolPlan:
    """What a chat request's tools do: the template's tools, the constraint, whether to parse calls."""

    tools: list[dict[str, Any]]
    constraint: Constraint | None
    names: list[str] = field(default_factory=list)


def function_of(tool: Any, i: int) -> dict[str, Any]:
    if (
        not isinstance(tool, dict)
        or tool.get("type", "function") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise ValidationError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", field="tools")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValidationError(f"tools[{i}].function.name is required", field="tools")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ValidationError(f"tools[{i}].function.parameters must be a JSON schema object", field="tools")
    return {"name": fn["name"], "description": fn.get("description", ""), "parameters": params}


def tool_plan(
    tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None, answer: Constraint | None = None
) -> ToolPlan | None:
    """``answer``: the structured output asked for besides the tools (a JSON constraint): under
    ``auto`` the model answers either with calls or with JSON valid for it, never free text."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValidationError("tool_choice needs tools", field="tool_choice")
        return None
    functions = [function_of(t, i) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    template_tools = [{"type": "function", "function": f} for f in functions]
    choice = tool_choice if tool_choice is not None else "auto"
    if choice == "none":
        return ToolPlan(template_tools, None, [])
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise ValidationError(
                f"tool_choice must name one of the tools ({', '.join(names)}), as {{'type': 'function', "
                "'function': {'name': ...}}",
                field="tool_choice",
            )
        chosen = [f for f in functions if f["name"] == name]
        grammar = calls_grammar(chosen, parallel=False, free_text=False)
    elif choice in ("required", "auto"):
        grammar = calls_grammar(
            functions,
            parallel=parallel_tool_calls is not False,
            free_text=choice == "auto",
            answer=answer_schema(answer) if choice == "auto" else None,
        )
    else:
        raise ValidationError("tool_choice must be none, auto, required or a named function", field="tool_choice")
    return ToolPlan(template_tools, constraint_of({"type": "lark", "value": grammar}, "tools"), names)


def answer_schema(answer: Constraint | None) -> dict[str, Any] | None:
    """The JSON schema of a structured-output constraint that may stand beside tool calls."""
    if answer is None:
        return None
    if answer.type == "json_object":
        return {"type": "object"}
    if answer.type == "json_schema" and isinstance(answer.value, dict):
        return answer.value
    raise ValidationError("only a JSON response_format can be combined with tool calls", field="response_format")


def calls_grammar(
    functions: list[dict[str, Any]], *, parallel: bool, free_text: bool, answer: dict[str, Any] | None = None
) -> str:
    """Lark (llguidance's dialect): one call, or several, each JSON valid for one function; with
    ``free_text`` the model may instead answer in text that does not begin a call, or, given an
    ``answer`` schema, in JSON valid for it (JSON cannot begin a call either)."""
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": strict_schema(f["parameters"])},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = {**(variants[0] if len(variants) == 1 else {"anyOf": variants}), "x-guidance": _COMPACT}
    alternative = "answer" if answer is not None else "TEXT"
    lines = [
        "start: " + (f"{alternative} | calls" if free_text else "calls"),
        "calls: call" + (' ("\\n" call)*' if parallel else ""),
        f'call: "{CALL_OPEN}\\n" %json {json.dumps(schema)} "\\n{CALL_CLOSE}"',
    ]
    if free_text and answer is not None:
        lines.append(f"answer: %json {json.dumps({**answer, 'x-guidance': _COMPACT})}")
    elif free_text:
        lines.append(r"TEXT: /(.|\n)*/ & ~/[ \t\n]*<tool_call>(.|\n)*/")
    return "\n".join(lines)


# The prompt -------------------------------------------------------------------------------------


def template_messages(messages: list[dict[str, Any]], plan: ToolPlan | None, template: str) -> list[dict[str, Any]]:
    """Messages as this chat template can take them: ones that know tools get OpenAI's shapes (tool
    calls with parsed arguments); for the others, calls and results are written out as text and the
    tools described in the system message."""
    knows_tools = "tools" in template
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if m["role"] == "assistant" and calls:
            if knows_tools:
                out.append({**m, "tool_calls": [_template_call(c) for c in calls]})
            else:
                text = "\n".join(format_call(_template_call(c)["function"]) for c in calls)
                out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + text).strip()})
        elif m["role"] == "tool" and not knows_tools:
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    if plan is not None and plan.tools and not knows_tools:
        described = "\n".join(json.dumps(t) for t in plan.tools)
        system = TOOLS_SYSTEM_PROMPT.format(tools=described)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _template_call(call: Any) -> dict[str, Any]:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        except ValueError:
            raise ValidationError("tool_calls[].function.arguments must be a JSON object", field="messages") from None
    return {"type": "function", "function": {"name": fn.get("name", ""), "arguments": arguments}}


def format_call(fn: dict[str, Any]) -> str:
    return f"{CALL_OPEN}\n{json.dumps({'name': fn['name'], 'arguments': fn['arguments']})}\n{CALL_CLOSE}"


# The reply --------------------------------------------------------------------------------------


def call_id(request_id: str, i: int) -> str:
    return "call_" + uuid.uuid5(uuid.NAMESPACE_URL, f"{request_id}/{i}").hex[:24]


def parse_tool_calls(text: str, request_id: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of an assistant's text: complete calls become OpenAI tool calls, their
    arguments the JSON text the model wrote (as a stream sends them); text before the first call is
    the content (None when empty). A cut-off call is dropped."""
    calls = []
    for match in _CALL.finditer(text):
        try:
            doc = json.loads(match.group(1))
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("name"), str):
            calls.append({"name": doc["name"], "arguments": _arguments_text(match.group(1), doc)})
    head = text.split(CALL_OPEN, 1)[0].strip() if calls else text
    tool_calls = [{"id": call_id(request_id, i), "type": "function", "function": c} for i, c in enumerate(calls)]
    return (head or None) if calls else text, tool_calls


def _arguments_text(call: str, doc: dict[str, Any]) -> str:
    """The arguments of a parsed call as written; re-encoded when the name does not come first."""
    head = _HEAD.match(call)
    if head is not None:
        value = call[head.end() :].lstrip()
        scanner = JsonValueScanner()
        end = scanner.feed(value)
        if scanner.ended:
            return value[:end]
    return json.dumps(doc.get("arguments", {}), ensure_ascii=False)


class JsonValueScanner:
    """Finds where one JSON value, fed in pieces, ends (its validity is the grammar's business)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.ended = False

    def feed(self, text: str) -> int:
        """How much of ``text`` belongs to the value (all of it unless it ends inside); the value
        begins with the first piece fed, so leading whitespace is the caller's to strip."""
        self.started = self.started or bool(text)
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.ended = True
                        return i + 1
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif self.depth == 0 and ch in ",}] \t\r\n":  # the end of a number, true, false or null
                self.ended = True
                return i
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.ended = True
                    return i + 1
        return len(text)


class ToolCallStream:
    """One streamed choice's text, cut into ``delta.content`` and ``delta.tool_calls`` chunks. Text
    that may still become a call is held back until it is clearly content or a call's name is known.

    With ``pieces`` (chat, as OpenAI streams) a call's first delta carries its id, type, name and
    empty arguments, the next ones the arguments as the model writes them; without, each call comes
    whole in one delta once its closing tag is written (the Responses API's items)."""

    def __init__(self, request_id: str, *, pieces: bool = False) -> None:
        self.request_id = request_id
        self.pieces = pieces
        self.buffer = ""
        self.mode: str | None = None  # None: undecided; "content"; "calls"
        self.part = "open"  # inside "calls": "open" (before a tag), "head", "arguments", "close"
        self.calls_begun = 0
        self.calls_sent = 0  # calls the client has seen (begun ones with pieces)
        self.scanner = JsonValueScanner()
        self.call: dict[str, Any] = {}  # the call being written

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas to send for this piece of text."""
        if self.mode == "content":
            return [{"content": text}] if text else []
        self.buffer += text
        if self.mode is None:
            head = self.buffer.lstrip()
            if head.startswith(CALL_OPEN):
                self.mode = "calls"
            elif head and not CALL_OPEN.startswith(head):
                self.mode, out, self.buffer = "content", self.buffer, ""
                return [{"content": out}]
            else:
                return []
        return self._calls()

    def finish(self) -> list[dict[str, Any]]:
        if self.mode == "calls":
            return self._calls()
        out, self.buffer = self.buffer, ""
        return [{"content": out}] if out else []

    @property
    def made_calls(self) -> bool:
        return self.calls_sent > 0

    def _calls(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while True:
            if self.part == "open":
                rest = self.buffer.lstrip()
                if not rest.startswith(CALL_OPEN):
                    return deltas
                self.buffer, self.part = rest[len(CALL_OPEN) :], "head"
            elif self.part == "head":
                head = _HEAD.match(self.buffer)
                if head is None:
                    return deltas
                index, self.calls_begun = self.calls_begun, self.calls_begun + 1
                name = json.loads(head.group(1))
                self.call = {"index": index, "id": call_id(self.request_id, index), "type": "function"}
                self.call["function"] = {"name": name, "arguments": ""}
                if self.pieces:
                    deltas.append({"tool_calls": [self.call]})
                    self.calls_sent += 1
                self.buffer, self.part, self.scanner = self.buffer[head.end() :], "arguments", JsonValueScanner()
            elif self.part == "arguments":
                if not self.scanner.started:
                    self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return deltas
                end = self.scanner.feed(self.buffer)
                piece, self.buffer = self.buffer[:end], self.buffer[end:]
                if not self.pieces:
                    self.call["function"]["arguments"] += piece
                elif piece:
                    deltas.append({"tool_calls": [{"index": self.call["index"], "function": {"arguments": piece}}]})
                if not self.scanner.ended:
                    return deltas
                self.part = "close"
            else:
                at = self.buffer.find(CALL_CLOSE)
                if at < 0:
                    return deltas
                self.buffer, self.part = self.buffer[at + len(CALL_CLOSE) :], "open"
                if not self.pieces:
                    deltas.append({"tool_calls": [self.call]})
                    self.calls_sent += 1
