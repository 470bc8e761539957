"""What the app holds for its lifetime, in one object on ``app.state``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request

from shared.settings import Settings

if TYPE_CHECKING:
    from producer_api.api_keys import ApiKey, RateLimiter
    from producer_api.dispatch import Dispatcher
    from producer_api.tenants import Tenants
    from producer_api.tokenization import Tokenizers


@dataclass
class AppState:
    settings: Settings
    tokenizers: Tokenizers
    dispatcher: Dispatcher
    api_keys: list[ApiKey]
    rate_limiter: RateLimiter
    redis: Any  # redis.asyncio.Redis for the rate limiter and health checks
    tenants: Tenants


def api_client_name(settings: Settings) -> str:
    """The name (CLIENT SETNAME) of an API's Redis connections: ``CLIENT LIST`` on a node tells
    how many one deployment's API replicas hold there. Redis refuses a name with spaces or other
    characters outside ``!``..``~`` (and with it every connection), so those become ``_``."""
    return "".join(c if "!" <= c <= "~" else "_" for c in f"{settings.key_prefix}:api")


def state_of(request: Request) -> AppState:
    return request.app.state.inflightq  # type: ignore[no-any-return]


def arrival(request: Request) -> float:
    """perf_counter() when the request arrived (set by the outermost middleware)."""
    return float(request.scope.get("state", {}).get("arrived", time.perf_counter()))
