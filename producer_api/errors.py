"""The ONE mapping from failures to HTTP responses, in the dialect of the route that failed.

A router declares its routes' dialect by its route class (``routing.py``): ``TgiRoute`` answers TGI's
``{"error", "error_type"}`` (huggingface_hub turns ``error_type`` into its exception classes),
``OpenAIRoute`` OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with OpenAI's status
codes where they differ from TGI's: a request it cannot take is a 400 (the openai package raises
``BadRequestError``), an unknown model a 404 ``model_not_found``, where TGI answers 422 for both.
A request no route matches (an unknown path) is answered in TGI's shape.

Anything unexpected becomes a 500 without a traceback in the body."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.exceptions
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import Scope

from shared.errors import (
    InflightqError,
    LimitError,
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
    if isinstance(exc, redis.exceptions.SlotNotCoveredError) or (
        type(exc) is redis.exceptions.RedisClusterException and "connect" in str(exc)
    ):
        # The client's view of the Cluster while it finds a promoted master (no node of a slot, or none of
        # the nodes it knew answering); not a RedisError, so without this it would read as our bug (500).
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
        error.http_status = error.openai_status = exc.status_code
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


def openai_body(error: InflightqError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": _OPENAI_TYPES.get(error.error_type, "server_error"),
            "param": error.field,
            "code": error.code,
        }
    }


@dataclass(frozen=True)
class Dialect:
    """How one API family spells a failure: its error body and its status code."""

    name: str
    body: Callable[[InflightqError], dict[str, Any]]
    status: Callable[[InflightqError], int]


TGI = Dialect("tgi", lambda error: error.to_dict(), lambda error: error.http_status)
OPENAI = Dialect("openai", openai_body, lambda error: error.openai_status or error.http_status)


def error_response(dialect: Dialect, exc: BaseException, scope: Scope) -> JSONResponse:
    error = normalize(exc)
    if isinstance(error, ServerError) and exc is not error:
        # Logged with the traceback for operators; the client sees only "internal server error".
        log.error("unhandled error on %s", scope.get("path"), exc_info=exc)
    scope.setdefault("state", {})["error_type"] = error.code  # the metrics' label: its most specific name
    headers = {"retry-after": _RETRY_AFTER[error.error_type]} if error.error_type in _RETRY_AFTER else None
    if error.error_type == "rate_limited":
        headers = {"retry-after": "60"}
    body = dialect.body(error)
    if isinstance(error, LimitError):
        if error.retry_after is not None:
            headers = {"retry-after": str(error.retry_after)}
        if error.limit is not None:
            # Beside each dialect's own fields: which limit refused the request, and its size.
            limit = {"name": error.limit, "value": error.value}
            (body["error"] if isinstance(body.get("error"), dict) else body)["limit"] = limit
    return JSONResponse(body, status_code=dialect.status(error), headers=headers)


def dialect_of(scope: Scope) -> Dialect:
    """The dialect of the route a request is for: the one routing chose, or (before routing: the
    body-size limit) the one that matches it; TGI's for a request no route matches."""
    route = scope.get("route")
    if route is None:
        routes: list[BaseRoute] = getattr(getattr(scope.get("app"), "state", None), "dialect_routes", [])
        route = next((r for r in routes if r.matches(scope)[0] != Match.NONE), None)
    return getattr(route, "dialect", TGI)


def install(app: FastAPI, routers: list[APIRouter]) -> None:
    """Handlers for what fails outside a route's own handler: routing (404, 405) and middleware;
    ``routers``: the app's routers, whose routes say which dialect a request not yet routed gets."""
    app.state.dialect_routes = [route for router in routers for route in router.routes]

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return error_response(dialect_of(request.scope), exc, request.scope)

    for exc_type in (
        InflightqError,
        RequestValidationError,
        StarletteHTTPException,
        redis.exceptions.RedisError,
        ConnectionError,
        Exception,  # the catch-all: never a traceback to the client
    ):
        app.add_exception_handler(exc_type, handle)
