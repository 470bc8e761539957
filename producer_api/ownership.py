"""Whose an object is: with API keys, every object a key creates (jobs, Responses, batches,
files) belongs to that key's tenant, and any other tenant's key is told it does not exist (404), as
OpenAI does. With auth off, every object is everyone's.

The owner is the key's tenant (``ApiKey.tenant``: its key id unless its spec names a tenant), stored
on the object's record; ``visible`` is the one check every store and route applies."""

from __future__ import annotations

from fastapi import Depends

from producer_api.api_keys import ApiKey
from producer_api.auth import authenticate


def owner_of(key: ApiKey | None = Depends(authenticate)) -> str | None:
    """The caller as an owner: its key's tenant (``ApiKey.tenant``: the key id unless its spec names
    a tenant, whose keys then share what they create), or None with auth off.
    (FastAPI runs ``authenticate`` once per request, however many dependencies name it.)"""
    return key.tenant if key else None


def visible(record_owner: str | None, caller: str | None) -> bool:
    """Whether ``caller`` (``owner_of``) may see an object whose record names ``record_owner``."""
    return caller is None or record_owner == caller
