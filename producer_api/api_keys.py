"""Optional API keys: who may call, which tenant they are, how urgent their requests may be, and how often.

Keys come from ``settings.api_keys`` and ``settings.api_keys_file`` as
``secret[:max_priority[:rpm]][:name=value]...``: the two positional parts, then named options in any
order (``tenant``, ``weight``, ``rpm``, ``tpm``, ``max_queued``, ``max_priority``); ``auth.py`` checks a
request's key against them.
A key is compared in constant time against every configured key and never logged; Redis and
metrics only ever see a short hash of it (or the tenant name its spec gives). The request and token
rates are counted in Redis by the ``limits`` library (``RateLimiter``), so every API replica shares
one budget per key."""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from limits import RateLimitItemPerMinute
from limits.aio.storage import RedisClusterStorage, RedisStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from shared.errors import RateLimitedError
from shared.keys import Keys
from shared.settings import Settings

_POSITIONAL = ("max_priority", "rpm")
_OPTIONS = ("tenant", "weight", "rpm", "tpm", "max_queued", "max_priority")
_MAX_TENANT_LENGTH = 128


@dataclass(frozen=True)
class ApiKey:
    secret: str
    max_priority: int | None  # most urgent priority allowed (0 = most urgent); None = any
    requests_per_minute: int | None  # None = unlimited
    tokens_per_minute: int | None = None  # prompt + max_new_tokens of what it queues; None = unlimited
    tenant_name: str | None = None  # the tenant its spec names; None = its own (key_id)
    weight: float = 1.0  # its tenant's fair share relative to other tenants
    max_queued: int | None = None  # its tenant's queued requests per model; None = settings.tenant_max_queued

    @property
    def key_id(self) -> str:
        """What logs, Redis keys and tenants see instead of the secret."""
        return hashlib.sha256(self.secret.encode()).hexdigest()[:16]

    @property
    def tenant(self) -> str:
        """The tenant the key's requests run as, and who owns what it creates."""
        return self.tenant_name or self.key_id


def _positive_int(name: str, text: str) -> int | None:
    # The message must not echo the entry: it holds the secret.
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"an API key entry has a non-integer {name}") from None
    if name == "max_priority":
        if value < 0:
            raise ValueError("an API key entry has a negative max_priority")
        return value
    return value if value > 0 else None


def parse_key(spec: str) -> ApiKey:
    secret, *parts = spec.strip().split(":")
    if not secret:
        raise ValueError("an API key entry has an empty key")
    values: dict[str, Any] = {}
    positional = 0
    for part in parts:
        name, eq, text = part.partition("=")
        if not eq:
            if positional >= len(_POSITIONAL):
                raise ValueError("an API key entry has more than two unnamed parts (max_priority, rpm)")
            name, text = _POSITIONAL[positional], part
            positional += 1
            if not text.strip():
                continue
        name, text = name.strip(), text.strip()
        if name not in _OPTIONS:
            raise ValueError(f"an API key entry has an unknown option {name!r} (known: {', '.join(_OPTIONS)})")
        if name == "tenant":
            if not text or len(text) > _MAX_TENANT_LENGTH or not text.isprintable():
                raise ValueError(f"an API key entry's tenant must be 1 to {_MAX_TENANT_LENGTH} printable characters")
            values[name] = text
        elif name == "weight":
            try:
                weight = float(text)
            except ValueError:
                raise ValueError("an API key entry has a non-numeric weight") from None
            if not (weight > 0 and math.isfinite(weight)):
                raise ValueError("an API key entry's weight must be a positive number")
            values[name] = weight
        else:
            values[name] = _positive_int(name, text)
    return ApiKey(
        secret,
        max_priority=values.get("max_priority"),
        requests_per_minute=values.get("rpm"),
        tokens_per_minute=values.get("tpm"),
        tenant_name=values.get("tenant"),
        weight=values.get("weight", 1.0),
        max_queued=values.get("max_queued"),
    )


def load_keys(settings: Settings) -> list[ApiKey]:
    specs = list(settings.api_keys)
    if settings.api_keys_file:
        for line in Path(settings.api_keys_file).read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                specs.append(line)
    return [parse_key(spec) for spec in specs]


def find_key(keys: list[ApiKey], presented: str) -> ApiKey | None:
    # Compare against every key, without an early exit, so timing says nothing about which matched.
    found = None
    for key in keys:
        if hmac.compare_digest(key.secret.encode(), presented.encode()):
            found = key
    return found


def limits_storage(settings: Settings, redis_client: Any) -> RedisStorage:
    """The ``limits`` library's storage on the deployment's Redis: on a standalone server it shares
    the API's bounded connection pool; on a Cluster it is a Cluster client of its own (``limits``
    builds it from the node's address). Its keys live under ``Keys.rate_limits``, in the
    deployment-wide slot, so the two keys of a sliding window are always on one node."""
    prefix = Keys.for_prefix(settings.key_prefix).rate_limits()
    if settings.redis_cluster:
        node = settings.redis_url.split("://", 1)[-1].split("/", 1)[0]
        return RedisClusterStorage(f"async+redis+cluster://{node}", implementation="redispy", key_prefix=prefix)
    return RedisStorage(
        "async+redis://", implementation="redispy", key_prefix=prefix, connection_pool=redis_client.connection_pool
    )


class RateLimiter:
    """Requests and tokens per minute per key, a sliding window counter (``limits``) in Redis shared
    by all replicas: unlike a fixed window it never lets through twice the budget across a
    minute's boundary."""

    def __init__(self, storage: RedisStorage) -> None:
        self._storage = storage
        self._window = SlidingWindowCounterRateLimiter(storage)

    async def hit(self, key: ApiKey) -> None:
        """Counts one request of ``key``; RateLimitedError past its requests per minute."""
        if key.requests_per_minute is not None:
            await self._take(key, "rpm", key.requests_per_minute, 1, "requests")

    async def charge_tokens(self, key: ApiKey | None, tokens: int) -> None:
        """Counts ``tokens`` (prompt + max_new_tokens) of ``key``; RateLimitedError past its tokens per minute."""
        if key is not None and key.tokens_per_minute is not None and tokens > 0:
            await self._take(key, "tpm", key.tokens_per_minute, tokens, "tokens")

    async def _take(self, key: ApiKey, kind: str, per_minute: int, cost: int, unit: str) -> None:
        item = RateLimitItemPerMinute(per_minute, namespace=kind)
        if await self._window.hit(item, key.key_id, cost=cost):
            return
        if cost > per_minute:
            message = f"this request's {cost} {unit} exceed the key's limit of {per_minute} {unit} per minute"
            wait = 60
        else:
            message = f"rate limit of {per_minute} {unit} per minute exceeded"
            window = await self._storage.get_sliding_window(item.key_for(key.key_id), item.get_expiry())
            wait = seconds_until_room(*window, limit=per_minute, cost=cost, expiry=item.get_expiry())
        raise RateLimitedError(message, limit=f"{unit}_per_minute", value=per_minute, retry_after=wait)


def seconds_until_room(
    previous: int, previous_ttl: float, current: int, current_ttl: float, *, limit: int, cost: int, expiry: int
) -> int:
    """Whole seconds until a sliding window counter (``limits``' weighted count: the previous
    window's count times the share of it still inside the window, plus the current window's) has
    room for ``cost``, if nothing else is counted meanwhile; the answer's Retry-After. The
    library's own reset time is when one unit frees, which tells a client with a large request to
    come back too early."""
    current_ends = max(0.0, current_ttl - expiry) if current else 0.0
    for wait in range(1, 2 * expiry + 1):
        if wait < current_ends:
            weighted = previous * max(0.0, previous_ttl - wait) / expiry + current
        else:  # the current window has become the previous one
            weighted = current * max(0.0, current_ttl - wait) / expiry
        if math.floor(weighted) + cost <= limit:
            return wait
    return 2 * expiry
