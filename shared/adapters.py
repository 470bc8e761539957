"""The deployment's LoRA adapters: name -> (base model, path), one Redis hash every process reads.

Workers write the adapters their settings name at start, the admin routes add and remove them at
run time; the API reads it to route a request naming an adapter to its base model's queue (and to
list adapters in /v1/models), a worker to find the files of the adapter a request names. A name
is unique in the deployment and never a served model's name, so an OpenAI ``model`` field names
one or the other."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, Field

from shared.keys import Keys

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}$"


class AdapterRecord(BaseModel):
    name: str = Field(pattern=NAME_PATTERN)
    base: str = Field(min_length=1, description="The served model the adapter was trained on.")
    path: str = Field(min_length=1, description="A directory in PEFT's format, readable by the base's workers.")

    @property
    def key(self) -> str:
        """The engine's ``LoRARequest.key`` of this adapter: it roots the adapter's prefix-cache chain."""
        return f"{self.name}@{self.path}"


def parse_spec(spec: str) -> tuple[str, str]:
    """``name=path`` (a setting's item) -> (name, path)."""
    name, sep, path = spec.partition("=")
    if not sep or not re.match(NAME_PATTERN, name.strip()) or not path.strip():
        raise ValueError(f"adapter {spec!r}: expected name=path")
    return name.strip(), path.strip()


def _decode(raw: dict[Any, Any]) -> dict[str, AdapterRecord]:
    out = {}
    for name, value in raw.items():
        record = AdapterRecord.model_validate_json(value)
        out[name.decode() if isinstance(name, bytes) else name] = record
    return out


def register(redis: Any, keys: Keys, record: AdapterRecord) -> None:
    redis.hset(keys.adapters(), record.name, record.model_dump_json())


def unregister(redis: Any, keys: Keys, name: str) -> bool:
    return bool(redis.hdel(keys.adapters(), name))


def lookup(redis: Any, keys: Keys, name: str) -> AdapterRecord | None:
    raw = redis.hget(keys.adapters(), name)
    return AdapterRecord.model_validate_json(raw) if raw is not None else None


def all_adapters(redis: Any, keys: Keys) -> dict[str, AdapterRecord]:
    return _decode(redis.hgetall(keys.adapters()))


async def register_async(redis: Any, keys: Keys, record: AdapterRecord) -> None:
    await redis.hset(keys.adapters(), record.name, record.model_dump_json())


async def unregister_async(redis: Any, keys: Keys, name: str) -> bool:
    return bool(await redis.hdel(keys.adapters(), name))


async def lookup_async(redis: Any, keys: Keys, name: str) -> AdapterRecord | None:
    raw = await redis.hget(keys.adapters(), name)
    return AdapterRecord.model_validate_json(raw) if raw is not None else None


async def all_adapters_async(redis: Any, keys: Keys) -> dict[str, AdapterRecord]:
    return _decode(await redis.hgetall(keys.adapters()))
