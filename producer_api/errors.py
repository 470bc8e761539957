"""The ONE mapping from failures to HTTP responses.

TGI's routes and the jobs API answer TGI's ``{"error", "error_type"}`` (huggingface_hub turns
``error_type`` into its exception classes); ``/v1/*`` OpenAI routes answer OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (the openai package reads ``message``) with OpenAI's
status codes where they differ from TGI's: an unknown model is a 404 ``model_not_found`` and a body that
is not JSON a 400 there, where TGI's routes answer 422 for both.
Anything unexpected becomes a generic 500 without a traceback in the body."""

from __future__ import annotations

import json
import logging
from typing import Any

import redis.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.errors import (
    InflightqError,
    MalformedBodyError,
    NotFoundError,
    PayloadTooLargeError,
    UnavailableError,
    ValidationError,
)

log = logging.getLogger(__name__)

# OpenAI's error "type" for each of our error types; the code field keeps ours.
_OPENAI_TYPES = {
    "validation": "invalid_request_error",
    "payload_too_large": "invalid_request_error",
    "not_found": "invalid_request_error",
    "conflict": "invalid_request_error",
    "authentication": "authentication_error",
    "overloaded": "rate_limit_error",
    "rate_limited": "rate_limit_error",
    "unavailable": "service_unavailable",
}
_RETRY_AFTER = {"overloaded": "1", "unavailable": "5"}


class ServerError(InflightqError):
    """A bug on our side; the message never carries its details."""

    error_type = "internal"
    http_status = 500


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/") and not path.startswith("/v1/jobs")


def normalize(exc: BaseException) -> InflightqError:
    """Any exception -> the one client-visible error it stands for."""
    if isinstance(exc, InflightqError):
        return exc
    if isinstance(exc, RequestValidationError):
        return _from_validation_errors(exc.errors())
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError | ConnectionError):
        return UnavailableError("the queue (Redis) is unreachable")
    if isinstance(exc, redis.exceptions.ClusterDownError | redis.exceptions.TryAgainError):
        # A Cluster between a master's failure and its replica's promotion: retry shortly.
        return UnavailableError("the queue (Redis Cluster) is failing over")
    if isinstance(exc, StarletteHTTPException):
        if exc.status_code == 404:
            return NotFoundError("no such route")
        if exc.status_code == 413:
            return PayloadTooLargeError(str(exc.detail))
        if exc.status_code == 400:
            # FastAPI's "error parsing the body" (e.g. JSON nested too deep): a malformed request.
            return MalformedBodyError(f"malformed body: {exc.detail}", field="body")
        error = ValidationError(str(exc.detail))
        error.http_status = exc.status_code
        return error
    return ServerError("internal server error")


def _from_validation_errors(errors: Any) -> ValidationError:
    """Pydantic's error list -> one message naming the first bad field (all problems in the message)."""
    parts: list[str] = []
    first_field: str | None = None
    malformed = False
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc)
        if err.get("type") == "json_invalid":
            msg = f"malformed JSON body: {err.get('ctx', {}).get('error', 'invalid JSON')}"
            field = "body"
            malformed = True
        elif err.get("type") == "missing" and not field:
            msg = "a JSON body is required"
            field = "body"
            malformed = True
        else:
            msg = f"{field or 'body'}: {err.get('msg', 'invalid value')}"
        first_field = first_field or field or "body"
        parts.append(msg)
    error_class = MalformedBodyError if malformed else ValidationError
    return error_class("; ".join(parts) or "invalid request", field=first_field)


def tgi_body(error: InflightqError) -> dict[str, Any]:
    return error.to_dict()


def openai_body(error: InflightqError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": _OPENAI_TYPES.get(error.error_type, "server_error"),
            "param": error.field,
            "code": getattr(error, "openai_code", error.error_type),
        }
    }


def openai_status(error: InflightqError) -> int:
    """OpenAI's status for ``error`` (404 for an unknown model, 400 for a body that is not JSON)."""
    return int(getattr(error, "openai_status", error.http_status))


def body_for(path: str, error: InflightqError) -> dict[str, Any]:
    return openai_body(error) if is_openai_path(path) else tgi_body(error)


def status_for(path: str, error: InflightqError) -> int:
    return openai_status(error) if is_openai_path(path) else error.http_status


def error_response(path: str, exc: BaseException, state: dict[str, Any] | None = None) -> JSONResponse:
    error = normalize(exc)
    if isinstance(error, ServerError) and exc is not error:
        # Logged with the traceback for operators; the client sees only "internal server error".
        log.error("unhandled error on %s", path, exc_info=exc)
    if state is not None:
        state["error_type"] = error.error_type  # read by the metrics middleware
    headers = {"retry-after": _RETRY_AFTER[error.error_type]} if error.error_type in _RETRY_AFTER else None
    if error.error_type == "rate_limited":
        headers = {"retry-after": str(getattr(error, "retry_after", 60))}
    return JSONResponse(body_for(path, error), status_code=status_for(path, error), headers=headers)


def sse_error_payload(path: str, exc: BaseException) -> str:
    """An error that happens after a stream started can only travel as an SSE event."""
    return json.dumps(body_for(path, normalize(exc)))


def install(app: FastAPI) -> None:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return error_response(request.url.path, exc, request.scope.setdefault("state", {}))

    for exc_type in (
        InflightqError,
        RequestValidationError,
        StarletteHTTPException,
        redis.exceptions.RedisError,
        ConnectionError,
        Exception,  # the catch-all: never a traceback to the client
    ):
        app.add_exception_handler(exc_type, handle)
