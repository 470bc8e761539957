"""Who is calling: the FastAPI dependency every authenticated route declares.

The keys themselves (parsing, priority ceilings, the shared per-key rate limit) are ``api_keys.py``."""

from __future__ import annotations

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from producer_api import metrics
from producer_api.api_keys import ApiKey, find_key
from producer_api.state import state_of
from shared.errors import AuthenticationError, RateLimitedError

# Declared as security schemes so /docs shows an "Authorize" button for either header.
_bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer <key>")
_x_api_key = APIKeyHeader(name="x-api-key", auto_error=False, description="x-api-key: <key>")


async def authenticate(
    request: Request,
    bearer: HTTPAuthorizationCredentials | None = Depends(_bearer),
    x_api_key: str | None = Depends(_x_api_key),
) -> ApiKey | None:
    """The caller's key (None when auth is off); raises 401, or 429 rate_limited past its budget."""
    state = state_of(request)
    keys = state.api_keys
    if not keys:
        return None
    presented = bearer.credentials if bearer else x_api_key
    key = find_key(keys, presented) if presented else None
    if key is None:
        raise AuthenticationError("a valid API key is required (Authorization: Bearer <key> or x-api-key)")
    try:
        await state.rate_limiter.hit(key)
    except RateLimitedError as error:
        metrics.TENANT_REJECTIONS.labels(state.tenants.labels(key.tenant), error.code).inc()
        raise
    request.scope.setdefault("state", {})["key_id"] = key.key_id
    return key
