"""Response objects and stream events in the shapes the openai SDK's types expect.

Stream events are numbered so that any API replica can rebuild the same stream from the request's
replay log: 0 response.created, 1 response.in_progress, 2 output_item.added, 3 content_part.added,
4 + i the delta of generated token i, then (N tokens) 4+N output_text.done, 5+N content_part.done,
6+N output_item.done, 7+N the terminal event. ``starting_after=n`` therefore resumes at token n - 3:
no gap, no duplicate, whoever serves the stream and whichever worker generated it (takeover)."""

from __future__ import annotations

from typing import Any

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
    p = record["params"]
    final = status in ("completed", "incomplete", "failed", "cancelled")
    output = []
    if text is not None:
        item_status = {"completed": "completed", "in_progress": "in_progress"}.get(status, "incomplete")
        output = [output_message(record["id"], text, item_status)]
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
        "tools": [],
        "truncation": p["truncation"],
        "usage": usage,
        "user": p["user"],
        "safety_identifier": p["safety_identifier"],
        "prompt_cache_key": p["prompt_cache_key"],
        "reasoning": None,
        "top_logprobs": 0,
        "max_tool_calls": None,
    }


def opening_events(record: dict[str, Any], first_status: str) -> list[dict[str, Any]]:
    """Events 0..3 (status: the response's when its stream began)."""
    rid, mid = record["id"], message_id(record["id"])
    return [
        {"type": "response.created", "sequence_number": 0, "response": response_object(record, first_status)},
        {"type": "response.in_progress", "sequence_number": 1, "response": response_object(record, "in_progress")},
        {
            "type": "response.output_item.added",
            "sequence_number": 2,
            "output_index": 0,
            "item": {**output_message(rid, "", "in_progress"), "content": []},
        },
        {
            "type": "response.content_part.added",
            "sequence_number": 3,
            "item_id": mid,
            "output_index": 0,
            "content_index": 0,
            "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
        },
    ]


def delta_event(record: dict[str, Any], index: int, text: str) -> dict[str, Any]:
    return {
        "type": "response.output_text.delta",
        "sequence_number": FIRST_TOKEN_SEQ + index,
        "item_id": message_id(record["id"]),
        "output_index": 0,
        "content_index": 0,
        "delta": text,
        "logprobs": [],
    }


def closing_events(record: dict[str, Any], n_tokens: int, final: dict[str, Any]) -> list[dict[str, Any]]:
    """The events after the last delta; ``final`` is the finished response object."""
    mid = message_id(record["id"])
    text = final["output"][0]["content"][0]["text"] if final["output"] else ""
    item = output_message(record["id"], text, final["output"][0]["status"] if final["output"] else "incomplete")
    seq = FIRST_TOKEN_SEQ + n_tokens
    terminal = {"completed": "response.completed", "failed": "response.failed"}.get(
        final["status"],
        "response.incomplete",  # incomplete, and cancelled (the spec has no cancelled event)
    )
    return [
        {
            "type": "response.output_text.done",
            "sequence_number": seq,
            "item_id": mid,
            "output_index": 0,
            "content_index": 0,
            "text": text,
            "logprobs": [],
        },
        {
            "type": "response.content_part.done",
            "sequence_number": seq + 1,
            "item_id": mid,
            "output_index": 0,
            "content_index": 0,
            "part": item["content"][0],
        },
        {"type": "response.output_item.done", "sequence_number": seq + 2, "output_index": 0, "item": item},
        {"type": terminal, "sequence_number": seq + 3, "response": final},
    ]
