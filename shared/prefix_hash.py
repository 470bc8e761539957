"""The one block-hash chain of the prefix cache, shared by the engine and the API.

A full block of ``block_size`` tokens is named by the hash of the block before it and its own
tokens; the first block chains from a root that names the tenant (and, where one is used, the
adapter), so caches of different tenants never meet. The engine's ``BlockManager`` registers its
blocks under these hashes, workers advertise them in Redis, and the API computes the same chain
for a request to find the worker that holds its longest prefix: so the hash is blake2b (8-byte
digests) over the token ids' bytes, the same in every process (Python's ``hash()`` of a str is
salted per process)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_PERSON = b"inflightq-prefix"  # blake2b's personalisation: these digests name prefix-cache blocks only


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=_PERSON).digest(), "little")


def root_hash(tenant: str | None = None, adapter: str | None = None) -> int:
    """Where a chain starts: no tenant and the empty tenant are the same (a deployment without tenants)."""
    return _digest(b"root\0" + (tenant or "").encode("utf-8", "surrogatepass") + b"\0" + (adapter or "").encode())


def block_hash(previous: int, tokens: Sequence[int]) -> int:
    """The hash of a block holding ``tokens`` that follows the block hashed ``previous``."""
    return _digest(previous.to_bytes(8, "little") + array("q", tokens).tobytes())


def chain(
    token_ids: Sequence[int],
    block_size: int,
    *,
    tenant: str | None = None,
    adapter: str | None = None,
    start: Sequence[int] = (),
) -> list[int]:
    """Hashes of every full block of ``token_ids``; ``start``: hashes of its first blocks already known
    (they are kept, and the chain continues from the last)."""
    hashes = list(start)
    previous = hashes[-1] if hashes else root_hash(tenant, adapter)
    for i in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        previous = block_hash(previous, token_ids[i : i + block_size])
        hashes.append(previous)
    return hashes


def to_hex(block: int) -> str:
    """How a block hash is written in Redis (a worker's held set, the API's lookup)."""
    return f"{block:016x}"
