"""Safe retries over HTTP: the ``Idempotency-Key`` header on the POST routes that create work.

A client whose POST got a reset or a timeout sends it again with the same key: within
``settings.idempotency_window_s`` the same key, from the same API key, answers what its first
request answered and never creates a second object. The same key with a different request is a
409 naming the header, and so is a retry that arrives while the first is still being created
(retry later), as Stripe and OpenAI do. A first request that fails frees its key for a retry.

One Redis string per (owner, key), claimed with ``SET NX EX``: atomic on one Redis or a Cluster
(a single key, whose slot a digest of the key picks, under the deployment's prefix)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Header
from fastapi.responses import JSONResponse, Response

from producer_api.state import AppState
from shared.errors import ConflictError, ValidationError

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255  # Stripe's limit
# Headers of the first answer that a replay repeats.
_REPLAYED_HEADERS = ("location", "x-request-id")

R = TypeVar("R", bound=Response)

IdempotencyKey: Any = Header(
    None,
    alias=HEADER,
    max_length=MAX_KEY_LENGTH,
    description="Retry safely: the same key (per API key) within idempotency_window_s answers with the object "
    "the first request created instead of creating another; the same key with a different body is a 409.",
)


def digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


async def once(
    st: AppState,
    owner: str | None,
    key: str | None,
    request: object,
    create: Callable[[], Awaitable[R]],
) -> R | JSONResponse:
    """``create()``'s answer, or, for a key already used with the same ``request`` (the route and
    its body, as JSON), the answer its first use got."""
    if key is None:
        return await create()
    if not key.strip():
        raise ValidationError(f"{HEADER} must not be empty", field=HEADER)
    redis = st.dispatcher.client.redis
    name = st.dispatcher.client.keys.idempotency_key(owner or "-", digest(key)[:32])
    fingerprint = digest(request)
    claimed = await redis.set(name, json.dumps({"request": fingerprint}), nx=True, ex=st.settings.idempotency_window_s)
    if not claimed:
        raw = await redis.get(name)
        first = json.loads(raw) if raw else {}  # gone: its first request failed, or its window ended, just now
        if first.get("request", fingerprint) != fingerprint:
            raise ConflictError(f"this {HEADER} was already used with a different request", field=HEADER)
        if "body" not in first:
            raise ConflictError(f"a request with this {HEADER} is still being processed; retry later", field=HEADER)
        headers = {**first["headers"], "idempotent-replayed": "true"}
        return JSONResponse(first["body"], status_code=first["status"], headers=headers)
    try:
        response = await create()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await redis.delete(name)
        raise
    answer = {
        "request": fingerprint,
        "status": response.status_code,
        "body": json.loads(bytes(response.body)),
        "headers": {h: response.headers[h] for h in _REPLAYED_HEADERS if h in response.headers},
    }
    await redis.set(name, json.dumps(answer), xx=True, keepttl=True)
    return response
