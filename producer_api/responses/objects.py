"""Response objects and stream events in the shapes the openai SDK's types expect.

Stream events are numbered so that any API replica can rebuild the same stream from the request's
replay log (``EventLog``), whoever serves the stream and whichever worker generated it (takeover).
A plain text response: 0 response.created, 1 response.in_progress, 2 output_item.added, 3
content_part.added, 4 + i the delta of generated token i, then (N tokens) 4+N output_text.done, 5+N
content_part.done, 6+N output_item.done, 7+N the terminal event; ``starting_after=n`` resumes at
token n - 3. A response that may call functions decides its items only as its text reveals them
(text held back until it is clearly text, a call emitted once it is whole, as the chat route's
``ToolCallStream``), so its numbers depend on the text so far: a resumed stream replays its tokens
from the first and skips the events already seen. Either way: no gap, no duplicate.

The response's output is computed from its text by the same ``EventLog``, so the items in the final
object are exactly the ones the stream announced."""

from __future__ import annotations

from typing import Any

from producer_api.openai.structured import ToolCallStream
from shared.request_lifecycle import RequestStatus
from shared.schemas import ErrorEvent, FinalResult

FIRST_TOKEN_SEQ = 4


def message_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("resp_")


def status_of(info_status: RequestStatus | None, result: FinalResult | None) -> str:
    if info_status is None or info_status == RequestStatus.QUEUED:
        return "queued"
    if info_status == RequestStatus.RUNNING:
        return "in_progress"
    if info_status == RequestStatus.DONE:
        return "incomplete" if result is not None and result.finish_reason == "length" else "completed"
    if info_status == RequestStatus.CANCELLED:
        return "cancelled"
    return "failed"


def output_message(response_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": message_id(response_id),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def response_object(
    record: dict[str, Any],
    status: str,
    *,
    text: str | None = None,
    output_tokens: int | None = None,
    error: ErrorEvent | None = None,
) -> dict[str, Any]:
    """The response object; ``text`` (None while queued): the text generated so far, or all of it."""
    p = record["params"]
    final = status in ("completed", "incomplete", "failed", "cancelled")
    output = [] if text is None else output_items(record, text, status)
    usage = None
    if output_tokens is not None and final:
        usage = {
            "input_tokens": record["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": record["prompt_tokens"] + output_tokens,
        }
    err = None
    if status == "failed":
        err = {"code": "server_error", "message": error.message if error else "the response failed"}
    return {
        "id": record["id"],
        "object": "response",
        "created_at": record["created_at"],
        "completed_at": record.get("completed_at") if status == "completed" else None,
        "status": status,
        "background": p["background"],
        "error": err,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": p["instructions"],
        "max_output_tokens": p["max_output_tokens"],
        "metadata": p["metadata"],
        "model": record["model"],
        "output": output,
        "parallel_tool_calls": p["parallel_tool_calls"],
        "previous_response_id": p["previous_response_id"],
        "service_tier": record["service_tier"],
        "store": p["store"],
        "temperature": p["temperature"],
        "top_p": p["top_p"],
        "text": p["text"],
        "tool_choice": p["tool_choice"],
        "tools": p.get("tools", []),
        "truncation": p["truncation"],
        "usage": usage,
        "user": p["user"],
        "safety_identifier": p["safety_identifier"],
        "prompt_cache_key": p["prompt_cache_key"],
        "reasoning": None,
        "top_logprobs": 0,
        "max_tool_calls": None,
        # Beside OpenAI's fields, when the response runs as a tenant (README: Tenants, weights and limits).
        **({"tenant": record["tenant"]} if record.get("tenant") else {}),
    }


def item_status_of(status: str) -> str:
    return {"completed": "completed", "in_progress": "in_progress"}.get(status, "incomplete")


def output_items(record: dict[str, Any], text: str, status: str) -> list[dict[str, Any]]:
    """The output items of ``text`` when the response is ``status`` (in_progress: text may still
    become a call, so it is held back as the stream holds it back)."""
    if not record.get("calling"):
        return [output_message(record["id"], text, item_status_of(status))]
    log = EventLog(record)
    log.token(0, text)
    if status != "in_progress":
        log.split(log.splitter.finish() if log.splitter else [])
    return log.items(status)


def function_call_item(response_id: str, index: int, call: dict[str, Any], status: str) -> dict[str, Any]:
    """A parsed call (the chat route's tool_call shape) as a function_call output item."""
    fn = call["function"]
    return {
        "id": f"fc_{response_id.removeprefix('resp_')}_{index}",
        "type": "function_call",
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if status == "completed" else "",
        "status": status,
    }


class EventLog:
    """A response's numbered events, rebuilt from its tokens in order: ``opening``, ``token`` for
    each generated token (from token ``resume_index(after)`` on), ``closing``."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record
        self.rid = record["id"]
        self.calling = bool(record.get("calling"))
        self.splitter = ToolCallStream(self.rid) if self.calling else None
        self.seq = 0
        self.text = ""  # the message's text so far (plain responses: from the first token replayed)
        self.message_at: int | None = None  # the message's output index, once it began
        self.calls: list[dict[str, Any]] = []  # whole calls, in output order

    def resume_index(self, after: int) -> int:
        """The first token whose events a stream resumed after sequence number ``after`` needs."""
        return 0 if self.calling else max(0, after - FIRST_TOKEN_SEQ + 1)

    def opening(self, first_status: str) -> list[dict[str, Any]]:
        events = [
            self._numbered({"type": "response.created", "response": response_object(self.record, first_status)}),
            self._numbered({"type": "response.in_progress", "response": response_object(self.record, "in_progress")}),
        ]
        if not self.calling:  # plain text: its message begins at once, so token i is event 4 + i
            events += self._open_message()
        return events

    def token(self, index: int, text: str) -> list[dict[str, Any]]:
        if self.splitter is not None:
            return self.split(self.splitter.feed(text))
        self.seq = FIRST_TOKEN_SEQ + index
        return [self._delta(text)]

    def closing(self, n_tokens: int, final: dict[str, Any]) -> list[dict[str, Any]]:
        """The events after the last token's; ``final`` is the finished response object."""
        events: list[dict[str, Any]] = []
        if self.splitter is not None:
            events += self.split(self.splitter.finish())
        else:
            self.seq = FIRST_TOKEN_SEQ + n_tokens
        if self.message_at is not None:
            item = next((i for i in final["output"] if i["type"] == "message"), None)
            item = item or output_message(self.rid, self.text, item_status_of(final["status"]))
            events += self._close_message(item)
        terminal = {"completed": "response.completed", "failed": "response.failed"}.get(
            final["status"],
            "response.incomplete",  # incomplete, and cancelled (the spec has no cancelled event)
        )
        events.append(self._numbered({"type": terminal, "response": final}))
        return events

    def items(self, status: str) -> list[dict[str, Any]]:
        out = [function_call_item(self.rid, i, c, "completed") for i, c in enumerate(self.calls)]
        if self.message_at is not None:
            out.insert(self.message_at, output_message(self.rid, self.text, item_status_of(status)))
        return out

    def split(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Events for the chat-shaped deltas of a ``ToolCallStream``: text, or whole calls."""
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.get("content"):
                if self.message_at is None:
                    events += self._open_message()
                events.append(self._delta(delta["content"]))
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
        return events

    def _numbered(self, event: dict[str, Any]) -> dict[str, Any]:
        numbered = {"type": event["type"], "sequence_number": self.seq, **event}
        self.seq += 1
        return numbered

    def _open_message(self) -> list[dict[str, Any]]:
        self.message_at = len(self.calls)
        at, mid = self.message_at, message_id(self.rid)
        return [
            self._numbered(
                {
                    "type": "response.output_item.added",
                    "output_index": at,
                    "item": {**output_message(self.rid, "", "in_progress"), "content": []},
                }
            ),
            self._numbered(
                {
                    "type": "response.content_part.added",
                    "item_id": mid,
                    "output_index": at,
                    "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                }
            ),
        ]

    def _delta(self, text: str) -> dict[str, Any]:
        self.text += text
        return self._numbered(
            {
                "type": "response.output_text.delta",
                "item_id": message_id(self.rid),
                "output_index": self.message_at or 0,
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            }
        )

    def _close_message(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        at, mid = self.message_at or 0, message_id(self.rid)
        where = {"item_id": mid, "output_index": at, "content_index": 0}
        text = item["content"][0]["text"]
        return [
            self._numbered({"type": "response.output_text.done", **where, "text": text, "logprobs": []}),
            self._numbered({"type": "response.content_part.done", **where, "part": item["content"][0]}),
            self._numbered({"type": "response.output_item.done", "output_index": at, "item": item}),
        ]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A whole call: its item, its arguments in one delta (they are known at once), its end."""
        index = len(self.calls) + (self.message_at is not None)
        self.calls.append(call)
        done = function_call_item(self.rid, len(self.calls) - 1, call, "completed")
        where = {"item_id": done["id"], "output_index": index}
        return [
            self._numbered(
                {
                    "type": "response.output_item.added",
                    "output_index": index,
                    "item": function_call_item(self.rid, len(self.calls) - 1, call, "in_progress"),
                }
            ),
            self._numbered({"type": "response.function_call_arguments.delta", **where, "delta": done["arguments"]}),
            self._numbered({"type": "response.function_call_arguments.done", **where, "arguments": done["arguments"]}),
            self._numbered({"type": "response.output_item.done", "output_index": index, "item": done}),
        ]
