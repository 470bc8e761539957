"""A stored response in Redis (``keys.response``): JSON with a TTL (response_ttl_s).

What it holds is what later calls need without the request: its parameters (echoed in every
object), its input items (input_items.list), the conversation it continued (previous_response_id)
and, once someone saw it final, its output (so it outlives the request hash). Its state while
queued or running, and its events, are the request's (same id): hash and replay log."""

from __future__ import annotations

import json
from typing import Any

from shared.keys import Keys


class ResponseStore:
    def __init__(self, redis: Any, keys: Keys, ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s

    async def put(self, record: dict[str, Any]) -> None:
        await self.redis.set(self.keys.response(record["id"]), json.dumps(record), ex=self.ttl_s)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        if len(response_id) > 128:
            return None
        raw = await self.redis.get(self.keys.response(response_id))
        return json.loads(raw) if raw else None

    async def update(self, record: dict[str, Any]) -> None:
        """Rewrites a record, keeping its remaining TTL (it never lives longer than first promised)."""
        await self.redis.set(self.keys.response(record["id"]), json.dumps(record), xx=True, keepttl=True)

    async def delete(self, response_id: str) -> bool:
        return bool(await self.redis.delete(self.keys.response(response_id)))
