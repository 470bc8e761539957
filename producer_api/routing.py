"""What every route of the API does around its own handler: it refuses a body that holds text no
tokenizer can take (``shared.valid_text``), naming the field, and it answers every failure,
unexpected ones included, in the dialect its router declares (``errors.py``). The server never
sees an exception, so each request gets its answer and the keep-alive connection stays usable."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from producer_api.errors import OPENAI, TGI, Dialect, error_response
from shared.valid_text import check_text


class DialectRoute(APIRoute):
    dialect: ClassVar[Dialect] = TGI

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        dialect = self.dialect

        async def answer(request: Request) -> Response:
            try:
                await check_body_text(request)
                return await handler(request)
            except Exception as exc:
                return error_response(dialect, exc, request.scope)

        return answer


class TgiRoute(DialectRoute):
    dialect = TGI


class OpenAIRoute(DialectRoute):
    dialect = OPENAI


async def check_body_text(request: Request) -> None:
    """A JSON body's every string (keys too) must be valid Unicode. The body is parsed once: the
    route reads the same parsed JSON (``Request.json`` keeps it)."""
    if request.method not in ("POST", "PUT", "PATCH") or request.headers.get("content-type", "").startswith(
        "multipart/"
    ):
        return
    try:
        body = await request.json()
    except (ValueError, RecursionError):
        return  # not JSON: the route's own parsing answers that
    check_text(body)
