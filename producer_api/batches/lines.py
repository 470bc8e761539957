"""Batch input lines and the output and error lines they become, in OpenAI's batch file shapes.

Input: ``{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body": {...}}`` per line.
Output: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}``;
a line that never became a request has ``"response": null`` and ``"error": {"code", "message"}``."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from producer_api.errors import OPENAI
from shared.errors import InflightqError


@dataclass
class InputLine:
    line_no: int  # 1-based, as an editor shows it
    raw: str
    custom_id: str | None = None
    body: dict[str, Any] | None = None
    error: str | None = None


def parse_lines(content: bytes, endpoint: str) -> list[InputLine]:
    """Every non-blank line with its envelope checked; a bad line carries its error, not an exception."""
    text = content.decode("utf-8")
    lines: list[InputLine] = []
    seen: set[str] = set()
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        line = InputLine(line_no=n, raw=raw)
        lines.append(line)
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as exc:
            line.error = f"line {n} is not valid JSON: {exc.msg}"
            continue
        if not isinstance(doc, dict):
            line.error = f"line {n} must be a JSON object"
            continue
        custom_id = doc.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            line.error = f"line {n}: custom_id must be a non-empty string"
            continue
        line.custom_id = custom_id
        if custom_id in seen:
            line.error = f"line {n}: custom_id {custom_id!r} is used by an earlier line"
            continue
        seen.add(custom_id)
        if doc.get("method", "POST") != "POST":
            line.error = f"line {n}: method must be POST"
        elif doc.get("url") != endpoint:
            line.error = f"line {n}: url must be the batch's endpoint {endpoint}, not {doc.get('url')!r}"
        elif not isinstance(doc.get("body"), dict):
            line.error = f"line {n}: body must be a JSON object"
        else:
            line.body = doc["body"]
    return lines


def endpoint_of(content: bytes) -> str | None:
    """The url the file's first readable line names (what a batch of it should be created for)."""
    for raw in content.decode("utf-8", errors="replace").splitlines():
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("url"), str):
            return str(doc["url"])
    return None


def _line_id() -> str:
    return "batch_req_" + uuid.uuid4().hex


def output_line(custom_id: str, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def failed_response_line(custom_id: str | None, request_id: str | None, err: InflightqError) -> dict[str, Any]:
    """A request the API would have refused or that failed: the HTTP answer its OpenAI route would have given."""
    return {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": {"status_code": OPENAI.status(err), "request_id": request_id, "body": OPENAI.body(err)},
        "error": None,
    }


def batch_error_line(custom_id: str | None, code: str, message: str, line_no: int | None = None) -> dict[str, Any]:
    """A line that never became a request (unparseable), or one the batch stopped (cancel, expiry)."""
    error: dict[str, Any] = {"code": code, "message": message}
    if line_no is not None:
        error["line"] = line_no
    return {"id": _line_id(), "custom_id": custom_id, "response": None, "error": error}
