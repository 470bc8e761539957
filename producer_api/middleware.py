"""Pure ASGI middleware: request metrics (outermost, so it times everything) and the body-size
limit (before any route reads a byte). Pure ASGI, not BaseHTTPMiddleware, so streams pass through
unbuffered and a client's disconnect still reaches the route."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer_api import metrics
from producer_api.errors import dialect_of, error_response
from shared.errors import HeadersTooLargeError, PayloadTooLargeError

# Request headers beyond these get 431: as nginx's default buffers (4 x 8 KB) hold, so a client
# cannot make every request parse megabytes of headers.
MAX_HEADERS = 100
MAX_HEADER_BYTES = 32 * 1024


def route_template(scope: Scope) -> str:
    """The matched route's path template (the router records it in the scope), so metric labels stay
    few: no job ids in them. Requests refused before routing (404, 413) count as "unmatched"."""
    route = scope.get("route")
    return str(getattr(route, "path", "unmatched"))


class MetricsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["arrived"] = time.perf_counter()
        status = {"code": 500}

        async def send_and_record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        metrics.REQUESTS_IN_FLIGHT.inc()
        try:
            await self.app(scope, receive, send_and_record)
        finally:
            metrics.REQUESTS_IN_FLIGHT.dec()
            error_type = state.get("error_type", "") if status["code"] >= 400 else ""
            route = route_template(scope)
            metrics.REQUESTS.labels(route, str(status["code"]), error_type).inc()
            metrics.REQUEST_DURATION.labels(route).observe(time.perf_counter() - state["arrived"])


class BodyLimitMiddleware:
    """431 past MAX_HEADERS or MAX_HEADER_BYTES of request headers; 413 past ``max_bytes``, by
    Content-Length or, when that is absent or lies, by counting the body.

    The body is read here in full (at most max_bytes) and replayed to the app; later receive()
    calls go to the server so the app still hears a disconnect."""

    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # Routes whose bodies are legitimately larger (batch input files) get their own cap.
        self.path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            size = sum(len(name) + len(value) + 4 for name, value in headers)
            if len(headers) > MAX_HEADERS or size > MAX_HEADER_BYTES:
                error = HeadersTooLargeError(
                    f"request headers too large: {len(headers)} headers, {size} bytes "
                    f"(at most {MAX_HEADERS} and {MAX_HEADER_BYTES})"
                )
                await self._send_error(scope, send, error)
                return
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        max_bytes = self.path_limits.get(scope.get("path", ""), self.max_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
            await self._reject(scope, send, max_bytes)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # disconnected while sending the body: nothing to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > max_bytes:
                await self._reject(scope, send, max_bytes)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, send: Send, max_bytes: int) -> None:
        await self._send_error(scope, send, PayloadTooLargeError(f"request body is larger than {max_bytes} bytes"))

    @staticmethod
    async def _send_error(scope: Scope, send: Send, error: Exception) -> None:
        response = error_response(dialect_of(scope), error, scope)
        response.headers["connection"] = "close"  # the unread rest of the body must not be parsed as a request
        await response(scope, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.disconnect"}
