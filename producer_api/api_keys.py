"""Optional API keys: who may call, how urgent their requests may be, and how often.

Keys come from ``settings.api_keys`` and ``settings.api_keys_file`` as ``key[:max_priority[:rpm]]``;
``auth.py`` checks a request's key against them.
A key is compared in constant time against every configured key and never logged; Redis and
metrics only ever see a short hash of it. The rate limit counts per minute in Redis so that
every API replica shares one budget per key."""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from pathlib import Path

from shared.errors import RateLimitedError
from shared.keys import Keys
from shared.settings import Settings


@dataclass(frozen=True)
class ApiKey:
    secret: str
    max_priority: int | None  # most urgent priority allowed (0 = most urgent); None = any
    requests_per_minute: int | None  # None = unlimited

    @property
    def key_id(self) -> str:
        """What logs, Redis keys and tenants see instead of the secret."""
        return hashlib.sha256(self.secret.encode()).hexdigest()[:16]


def parse_key(spec: str) -> ApiKey:
    secret, _, rest = spec.strip().partition(":")
    priority_part, _, rpm_part = rest.partition(":")
    if not secret:
        raise ValueError("an API key entry has an empty key")
    try:
        max_priority = int(priority_part) if priority_part.strip() else None
        rpm = int(rpm_part) if rpm_part.strip() else None
    except ValueError:
        # The message must not echo the entry: it holds the secret.
        raise ValueError("an API key entry has a non-integer priority or rate limit") from None
    return ApiKey(secret, max_priority, rpm if rpm and rpm > 0 else None)


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


# Counts a hit and keeps the window's key alive past its minute, atomically, in one call. A script
# rather than MULTI: the key is alone in its call, so this runs the same on a Redis Cluster, where
# redis.asyncio's Cluster transaction pipeline failed under the API's event loop ("Future attached
# to a different loop").
_HIT = """
local count = redis.call('INCR', KEYS[1])
if count == 1 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return count
"""


class RateLimiter:
    """Fixed one-minute windows counted with INCR in Redis, shared by all replicas."""

    def __init__(self, redis_client: object, keys: Keys) -> None:
        self._redis = redis_client
        self._keys = keys
        self._hit = redis_client.register_script(_HIT)  # type: ignore[attr-defined]

    async def hit(self, key: ApiKey) -> None:
        if key.requests_per_minute is None:
            return
        now = time.time()
        window = int(now // 60)
        name = self._keys.rate_limit(key.key_id, window)
        count = int(await self._hit(keys=[name], args=[120]))
        if count > key.requests_per_minute:
            error = RateLimitedError(f"rate limit of {key.requests_per_minute} requests per minute exceeded")
            error.retry_after = max(1, int(60 - now % 60))  # type: ignore[attr-defined]
            raise error
