"""Files of the Batch API: uploaded inputs and generated outputs, with OpenAI's ``File`` shape.

A file lives in Redis with a TTL; when ``settings.batch_file_dir`` is set, a large one lives in
that directory instead, while its metadata (and expiry) stays in Redis."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import redis
from pydantic import BaseModel

from producer_api.ownership import visible
from shared.errors import NotFoundError, PayloadTooLargeError, ValidationError
from shared.keys import Keys
from shared.settings import Settings

# OpenAI's own limit on a batch input file.
MAX_FILE_BYTES = 200 * 1024 * 1024
# Without a file directory, Redis holds whole files; past this it would hurt Redis itself.
MAX_REDIS_FILE_BYTES = 64 * 1024 * 1024
# With a file directory, files larger than this go to disk instead of Redis.
INLINE_FILE_BYTES = 1024 * 1024
# How much longer than result_ttl_s a file may be kept (a batch's input outlives its 24 h window).
MAX_KEEP_EXTRA_S = 24 * 3600


def max_file_bytes(settings: Settings) -> int:
    return MAX_FILE_BYTES if settings.batch_file_dir else MAX_REDIS_FILE_BYTES


class FileObject(BaseModel):
    """OpenAI's ``File`` object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


def unix_now() -> int:
    return int(time.time())


class FilePage(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileStore:
    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self.redis = client
        self.keys = Keys.for_prefix(settings.key_prefix)
        self.ttl_s = settings.result_ttl_s

    def max_bytes(self) -> int:
        return max_file_bytes(self.settings)

    def put(
        self, content: bytes, *, filename: str, purpose: str, file_id: str | None = None, owner: str | None = None
    ) -> FileObject:
        """Store a file; a given ``file_id`` overwrites, which keeps a job's re-run idempotent.

        ``owner`` (an API key's id) makes the file visible to that key only."""
        if purpose not in ("batch", "batch_output"):
            raise ValidationError(f"purpose must be 'batch', not {purpose!r}", field="purpose")
        if len(content) > self.max_bytes():
            raise PayloadTooLargeError(f"file is {len(content)} bytes; the limit is {self.max_bytes()}")
        file_id = file_id or "file-" + uuid.uuid4().hex
        created = unix_now()
        meta: dict[str, Any] = {
            "id": file_id,
            "bytes": len(content),
            "created_at": created,
            "filename": filename,
            "purpose": purpose,
            "expires_at": created + self.ttl_s,
        }
        if owner:
            meta["owner"] = owner
        with self.redis.pipeline() as pipe:
            if self.settings.batch_file_dir and len(content) > INLINE_FILE_BYTES:
                meta["path"] = self._write_to_disk(file_id, content)
                pipe.delete(self.keys.file_content(file_id))
            else:
                pipe.set(self.keys.file_content(file_id), content, ex=self.ttl_s)
            pipe.delete(self.keys.file(file_id))
            pipe.hset(self.keys.file(file_id), mapping={k: str(v) for k, v in meta.items()})
            pipe.expire(self.keys.file(file_id), self.ttl_s)
            pipe.zadd(self.keys.files(), {file_id: time.time()})
            # The index outlives its longest-lived entry (a batch keeps its input file a window longer).
            pipe.expire(self.keys.files(), self.ttl_s + MAX_KEEP_EXTRA_S)
            pipe.execute()
        return self._object(meta)

    def _write_to_disk(self, file_id: str, content: bytes) -> str:
        directory = Path(self.settings.batch_file_dir or ".")
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / file_id
        # Write then rename: a reader never sees half a file, even if this process dies midway.
        tmp = path.with_suffix(f".tmp-{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(content)
        os.replace(tmp, path)
        return str(path)

    def _meta(self, file_id: str) -> dict[str, str]:
        meta: dict[str, str] = self.redis.hgetall(self.keys.file(file_id))  # type: ignore[assignment]
        if not meta:
            raise NotFoundError(f"no file {file_id!r}")
        return {as_text(k): as_text(v) for k, v in meta.items()}

    @staticmethod
    def _object(meta: dict[str, Any]) -> FileObject:
        return FileObject(
            id=str(meta["id"]),
            bytes=int(meta["bytes"]),
            created_at=int(meta["created_at"]),
            filename=str(meta["filename"]),
            purpose=meta["purpose"],
            expires_at=int(meta["expires_at"]) if meta.get("expires_at") else None,
        )

    def get(self, file_id: str, *, owner: str | None = None) -> FileObject:
        """The file; with ``owner``, only when that key owns it (anyone else gets not-found)."""
        return self._object(self._visible(file_id, owner))

    def _visible(self, file_id: str, owner: str | None) -> dict[str, str]:
        meta = self._meta(file_id)
        if not visible(meta.get("owner"), owner):
            raise NotFoundError(f"no file {file_id!r}")
        return meta

    def content(self, file_id: str, *, owner: str | None = None) -> bytes:
        meta = self._visible(file_id, owner)
        if "path" in meta:
            try:
                return Path(meta["path"]).read_bytes()
            except FileNotFoundError as exc:
                raise NotFoundError(f"the content of file {file_id!r} is gone") from exc
        data = self.redis.get(self.keys.file_content(file_id))
        if data is None:
            raise NotFoundError(f"the content of file {file_id!r} has expired")
        return data if isinstance(data, bytes) else str(data).encode()

    def list(
        self, *, purpose: str | None = None, limit: int = 100, after: str | None = None, owner: str | None = None
    ) -> FilePage:
        """Newest first; ``after`` is the last id of the previous page. Expired files drop out here."""
        limit = max(1, min(limit, 10_000))
        start = 0
        if after:
            rank = self.redis.zrevrank(self.keys.files(), after)
            if rank is None:
                raise NotFoundError(f"no file {after!r}")
            start = int(rank) + 1  # type: ignore[arg-type]
        found: list[FileObject] = []
        has_more = False
        while not has_more:
            ids = [as_text(i) for i in self.redis.zrevrange(self.keys.files(), start, start + limit)]  # type: ignore[union-attr]
            if not ids:
                break
            start += len(ids)
            for file_id in ids:
                try:
                    meta = self._meta(file_id)
                except NotFoundError:
                    self.redis.zrem(self.keys.files(), file_id)
                    start -= 1
                    continue
                item = self._object(meta)
                if (purpose is None or item.purpose == purpose) and visible(meta.get("owner"), owner):
                    if len(found) == limit:
                        has_more = True
                        break
                    found.append(item)
        return FilePage(
            data=found,
            first_id=found[0].id if found else None,
            last_id=found[-1].id if found else None,
            has_more=has_more,
        )

    def keep(self, file_id: str, ttl_s: int) -> None:  # ttl_s <= result_ttl_s + MAX_KEEP_EXTRA_S
        """Make a file live at least ``ttl_s`` more seconds (a batch's input must outlive its window)."""
        until = unix_now() + ttl_s
        if int(self._meta(file_id).get("expires_at") or 0) >= until:
            return
        with self.redis.pipeline() as pipe:
            pipe.expire(self.keys.file(file_id), ttl_s)
            pipe.expire(self.keys.file_content(file_id), ttl_s)  # a no-op for a file kept on disk
            pipe.hset(self.keys.file(file_id), "expires_at", str(until))
            pipe.execute()

    def sweep_disk(self) -> list[str]:
        """Delete files in the file directory whose record expired (Redis forgets; the disk must too)."""
        if not self.settings.batch_file_dir or not Path(self.settings.batch_file_dir).is_dir():
            return []
        removed = []
        for path in Path(self.settings.batch_file_dir).glob("file-*"):
            # Half-written temp files of a live upload are left alone for an hour.
            if ".tmp-" in path.name and time.time() - path.stat().st_mtime < 3600:
                continue
            if not self.redis.exists(self.keys.file(path.name.split(".tmp-")[0])):
                path.unlink(missing_ok=True)
                removed.append(path.name)
        return removed

    def delete(self, file_id: str, *, owner: str | None = None) -> None:
        meta = self._visible(file_id, owner)
        if "path" in meta:
            Path(meta["path"]).unlink(missing_ok=True)
        self.redis.delete(self.keys.file(file_id), self.keys.file_content(file_id))
        self.redis.zrem(self.keys.files(), file_id)


def as_text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
