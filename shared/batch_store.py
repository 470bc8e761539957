"""Files and batches of the OpenAI Batch API, kept in Redis: the one place their state lives.

A batch moves through OpenAI's statuses:

    validating ──► in_progress ──► finalizing ──► completed
        │               │               │
        ├───────────────┴───────────────┴──► cancelling ──► cancelled
        ├──► failed    (the input file is gone or unreadable)
        └──► expired   (completion_window passed before the batch finished)

Who moves it: ``BatchStore.create`` writes ``validating``; ``BatchStore.cancel`` (API or CLI)
writes ``cancelling``; the RQ job (``worker/batch_job.py``) writes every other state.

Files are small JSONL documents: they live in Redis with a TTL, or, when
``settings.batch_file_dir`` is set and a file is large, as a file in that directory whose
metadata (and expiry) stays in Redis. Every per-line fact is written once (HSETNX), so a job
that runs twice after a crash counts and writes each line once."""

from __future__ import annotations

import json
import os
import time
import uuid
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import redis
from pydantic import BaseModel, Field

from shared.errors import NotFoundError, PayloadTooLargeError, ValidationError
from shared.keys import Keys
from shared.settings import Settings

# OpenAI's own limit on a batch input file.
MAX_FILE_BYTES = 200 * 1024 * 1024
# Without a file directory, Redis holds whole files; past this it would hurt Redis itself.
MAX_REDIS_FILE_BYTES = 64 * 1024 * 1024
# With a file directory, files larger than this go to disk instead of Redis.
INLINE_FILE_BYTES = 1024 * 1024
MAX_BATCH_LINES = 50_000

SUPPORTED_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = {"24h": 24 * 3600}


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_final(self) -> bool:
        return self in (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.CANCELLED, BatchStatus.EXPIRED)


# The Unix-time field each status stamps when entered.
_STATUS_TIMESTAMP = {
    BatchStatus.IN_PROGRESS: "in_progress_at",
    BatchStatus.FINALIZING: "finalizing_at",
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.FAILED: "failed_at",
    BatchStatus.CANCELLING: "cancelling_at",
    BatchStatus.CANCELLED: "cancelled_at",
    BatchStatus.EXPIRED: "expired_at",
}


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


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrorItem(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorItem] = Field(default_factory=list)


class BatchObject(BaseModel):
    """OpenAI's ``Batch`` object; ``model`` (optional there too) names the model every line runs on."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None


class BatchPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


# Moves a batch to a new status only from one of the allowed ones, stamping the time, in one
# step, so a cancel racing the job's own transitions can never be lost or undone.
_TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return false end
for i = 3, #ARGV - 1 do
  if ARGV[i] == current then
    redis.call('HSET', KEYS[1], 'status', ARGV[1])
    if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], ARGV[2], ARGV[#ARGV]) end
    return current
  end
end
return false
"""

# Records a line's outcome once and bumps the matching counter only when it was new.
_RECORD_OUTCOME = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
"""


def _now() -> int:
    return int(time.time())


class FileStore:
    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self.redis = client
        self.keys = Keys.for_prefix(settings.key_prefix)
        self.ttl_s = settings.result_ttl_s

    def max_bytes(self) -> int:
        return MAX_FILE_BYTES if self.settings.batch_file_dir else MAX_REDIS_FILE_BYTES

    def put(self, content: bytes, *, filename: str, purpose: str, file_id: str | None = None) -> FileObject:
        """Store a file; a given ``file_id`` overwrites, which keeps a job's re-run idempotent."""
        if purpose not in ("batch", "batch_output"):
            raise ValidationError(f"purpose must be 'batch', not {purpose!r}", field="purpose")
        if len(content) > self.max_bytes():
            raise PayloadTooLargeError(f"file is {len(content)} bytes; the limit is {self.max_bytes()}")
        file_id = file_id or "file-" + uuid.uuid4().hex
        created = _now()
        meta: dict[str, Any] = {
            "id": file_id,
            "bytes": len(content),
            "created_at": created,
            "filename": filename,
            "purpose": purpose,
            "expires_at": created + self.ttl_s,
        }
        with self.redis.pipeline() as pipe:
            if self.settings.batch_file_dir and len(content) > INLINE_FILE_BYTES:
                meta["path"] = self._write_to_disk(file_id, content)
                pipe.delete(self.keys.file_content(file_id))
            else:
                pipe.set(self.keys.file_content(file_id), content, ex=self.ttl_s)
            pipe.delete(self.keys.file(file_id))
            pipe.hset(self.keys.file(file_id), mapping={k: str(v) for k, v in meta.items()})
            pipe.expire(self.keys.file(file_id), self.ttl_s)
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
        return {_s(k): _s(v) for k, v in meta.items()}

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

    def get(self, file_id: str) -> FileObject:
        return self._object(self._meta(file_id))

    def content(self, file_id: str) -> bytes:
        meta = self._meta(file_id)
        if "path" in meta:
            try:
                return Path(meta["path"]).read_bytes()
            except FileNotFoundError as exc:
                raise NotFoundError(f"the content of file {file_id!r} is gone") from exc
        data = self.redis.get(self.keys.file_content(file_id))
        if data is None:
            raise NotFoundError(f"the content of file {file_id!r} has expired")
        return data if isinstance(data, bytes) else str(data).encode()


def _s(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class BatchStore:
    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self.redis = client
        self.keys = Keys.for_prefix(settings.key_prefix)
        self.files = FileStore(settings, client)
        self._transition = client.register_script(_TRANSITION)
        self._record = client.register_script(_RECORD_OUTCOME)

    # Creation and reading -------------------------------------------------------------
    def create(
        self,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
        model: str | None = None,
    ) -> BatchObject:
        if endpoint not in SUPPORTED_ENDPOINTS:
            raise ValidationError(f"endpoint must be one of {', '.join(SUPPORTED_ENDPOINTS)}", field="endpoint")
        if completion_window not in COMPLETION_WINDOWS:
            raise ValidationError("completion_window must be '24h'", field="completion_window")
        if metadata is not None and (
            len(metadata) > 16 or any(len(k) > 64 or len(str(v)) > 512 for k, v in metadata.items())
        ):
            raise ValidationError("metadata: at most 16 pairs, keys <= 64 and values <= 512 chars", field="metadata")
        input_file = self.files.get(input_file_id)
        if input_file.purpose != "batch":
            raise ValidationError(
                f"file {input_file_id!r} was not uploaded with purpose 'batch'", field="input_file_id"
            )
        created = _now()
        batch = BatchObject(
            id="batch_" + uuid.uuid4().hex,
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            status=BatchStatus.VALIDATING,
            created_at=created,
            expires_at=created + COMPLETION_WINDOWS[completion_window],
            metadata=metadata,
            model=model,
        )
        fields: dict[str, str] = {
            "id": batch.id,
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "status": batch.status.value,
            "created_at": str(created),
            "expires_at": str(batch.expires_at),
            "total": "0",
            "completed": "0",
            "failed": "0",
        }
        if metadata is not None:
            fields["metadata"] = json.dumps(metadata)
        if model:
            fields["model"] = model
        with self.redis.pipeline() as pipe:
            pipe.hset(self.keys.batch(batch.id), mapping=fields)
            pipe.expire(self.keys.batch(batch.id), self._ttl())
            pipe.zadd(self.keys.batches(), {batch.id: time.time()})
            pipe.execute()
        return batch

    def _ttl(self) -> int:
        # A batch record must outlive its completion window, plus the time its results are kept.
        return max(COMPLETION_WINDOWS["24h"], 0) + self.settings.result_ttl_s

    def get(self, batch_id: str) -> BatchObject:
        raw = self.redis.hgetall(self.keys.batch(batch_id))
        if not raw:
            raise NotFoundError(f"no batch {batch_id!r}")
        f = {_s(k): _s(v) for k, v in raw.items()}  # type: ignore[union-attr]

        def opt_int(name: str) -> int | None:
            return int(f[name]) if f.get(name) else None

        errors = BatchErrors.model_validate_json(f["errors"]) if f.get("errors") else None
        return BatchObject(
            id=f["id"],
            endpoint=f["endpoint"],
            errors=errors,
            input_file_id=f["input_file_id"],
            completion_window=f["completion_window"],
            status=BatchStatus(f["status"]),
            output_file_id=f.get("output_file_id") or None,
            error_file_id=f.get("error_file_id") or None,
            created_at=int(f["created_at"]),
            in_progress_at=opt_int("in_progress_at"),
            expires_at=opt_int("expires_at"),
            finalizing_at=opt_int("finalizing_at"),
            completed_at=opt_int("completed_at"),
            failed_at=opt_int("failed_at"),
            expired_at=opt_int("expired_at"),
            cancelling_at=opt_int("cancelling_at"),
            cancelled_at=opt_int("cancelled_at"),
            request_counts=RequestCounts(
                total=int(f.get("total", 0)), completed=int(f.get("completed", 0)), failed=int(f.get("failed", 0))
            ),
            metadata=json.loads(f["metadata"]) if f.get("metadata") else None,
            model=f.get("model") or None,
        )

    def status(self, batch_id: str) -> BatchStatus:
        value = self.redis.hget(self.keys.batch(batch_id), "status")
        if value is None:
            raise NotFoundError(f"no batch {batch_id!r}")
        return BatchStatus(_s(value))

    def list(self, *, limit: int = 20, after: str | None = None) -> BatchPage:
        """Newest first, as OpenAI pages; ``after`` is the last id of the previous page."""
        limit = max(1, min(limit, 100))
        start = 0
        if after:
            rank = self.redis.zrevrank(self.keys.batches(), after)
            if rank is None:
                raise NotFoundError(f"no batch {after!r}")
            start = int(rank) + 1  # type: ignore[arg-type]
        ids = [_s(i) for i in self.redis.zrevrange(self.keys.batches(), start, start + limit)]  # type: ignore[union-attr]
        batches: list[BatchObject] = []
        for batch_id in ids[:limit]:
            try:
                batches.append(self.get(batch_id))
            except NotFoundError:
                # The record expired before its index entry; drop the stale entry.
                self.redis.zrem(self.keys.batches(), batch_id)
        return BatchPage(
            data=batches,
            first_id=batches[0].id if batches else None,
            last_id=batches[-1].id if batches else None,
            has_more=len(ids) > limit,
        )

    # Moves ----------------------------------------------------------------------------
    def move(self, batch_id: str, to: BatchStatus, *, allowed_from: tuple[BatchStatus, ...]) -> BatchStatus | None:
        """Move to ``to`` if the batch is in one of ``allowed_from``; returns the status it left, or None."""
        stamp = _STATUS_TIMESTAMP.get(to, "")
        previous = self._transition(
            keys=[self.keys.batch(batch_id)],
            args=[to.value, stamp, *[s.value for s in allowed_from], str(_now())],
        )
        return BatchStatus(_s(previous)) if previous else None

    def set_fields(self, batch_id: str, **fields: str | int) -> None:
        self.redis.hset(self.keys.batch(batch_id), mapping={k: str(v) for k, v in fields.items()})

    def set_errors(self, batch_id: str, errors: list[BatchErrorItem]) -> None:
        self.set_fields(batch_id, errors=BatchErrors(data=errors).model_dump_json())

    def cancel(self, batch_id: str) -> BatchObject:
        """Ask for cancellation; the job cancels the queued requests and writes ``cancelled``."""
        current = self.get(batch_id)
        if current.status.is_final or current.status == BatchStatus.CANCELLING:
            return current
        self.move(
            batch_id,
            BatchStatus.CANCELLING,
            allowed_from=(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING),
        )
        return self.get(batch_id)

    # Per-line facts, written once ----------------------------------------------------
    def record_outcome(self, batch_id: str, line_no: int, line: dict[str, Any], *, ok: bool) -> bool:
        """Store the output (ok) or error line of input line ``line_no``; False if it was already there."""
        payload = json.dumps({"ok": ok, "line": line}, separators=(",", ":"))
        added = self._record(
            keys=[self.keys.batch_outcomes(batch_id), self.keys.batch(batch_id)],
            args=[str(line_no), payload, "completed" if ok else "failed"],
        )
        if added:
            self.redis.expire(self.keys.batch_outcomes(batch_id), self._ttl())
        return bool(added)

    def recorded_lines(self, batch_id: str) -> set[int]:
        return {int(_s(k)) for k in self.redis.hkeys(self.keys.batch_outcomes(batch_id))}  # type: ignore[union-attr]

    def outcomes(self, batch_id: str) -> list[tuple[int, bool, dict[str, Any]]]:
        """Every recorded outcome in input-line order: (line number, ok, output or error line)."""
        raw = self.redis.hgetall(self.keys.batch_outcomes(batch_id))
        rows = []
        for k, v in raw.items():  # type: ignore[union-attr]
            doc = json.loads(_s(v))
            rows.append((int(_s(k)), bool(doc["ok"]), doc["line"]))
        return sorted(rows, key=lambda row: row[0])

    def claim_request_id(self, batch_id: str, custom_id: str) -> tuple[str, bool]:
        """The queue request id of a line: made once per custom_id (SET NX), so re-runs reuse it.

        Returns (request id, True when this call created it)."""
        fresh = uuid.uuid4().hex
        key = self.keys.idempotency(batch_id, custom_id)
        created = self.redis.set(key, fresh, nx=True, ex=self._ttl())
        request_id = fresh if created else _s(self.redis.get(key))
        self.redis.hset(self.keys.batch_requests(batch_id), custom_id, request_id)
        self.redis.expire(self.keys.batch_requests(batch_id), self._ttl())
        return request_id, bool(created)

    def request_ids(self, batch_id: str) -> dict[str, str]:
        raw = self.redis.hgetall(self.keys.batch_requests(batch_id))
        return {_s(k): _s(v) for k, v in raw.items()}  # type: ignore[union-attr]

    # The one run that owns the batch ---------------------------------------------------
    def acquire_lease(self, batch_id: str, token: str, ttl_s: float) -> bool:
        key = self.keys.batch_lease(batch_id)
        if self.redis.set(key, token, nx=True, px=int(ttl_s * 1000)):
            return True
        return self.renew_lease(batch_id, token, ttl_s)

    def renew_lease(self, batch_id: str, token: str, ttl_s: float) -> bool:
        key = self.keys.batch_lease(batch_id)
        # Compare-and-extend: a run whose lease lapsed and was taken over must notice and stop.
        with self.redis.pipeline() as pipe:
            try:
                pipe.watch(key)
                if _s(pipe.get(key) or b"") != token:
                    pipe.unwatch()
                    return False
                pipe.multi()
                pipe.pexpire(key, int(ttl_s * 1000))
                pipe.execute()
                return True
            except redis.WatchError:
                return False

    def release_lease(self, batch_id: str, token: str) -> None:
        key = self.keys.batch_lease(batch_id)
        if _s(self.redis.get(key) or b"") == token:
            self.redis.delete(key)

    def lease_held(self, batch_id: str) -> bool:
        return bool(self.redis.exists(self.keys.batch_lease(batch_id)))

    def unfinished(self) -> list[str]:
        """Ids of batches not yet in a final status (what a restarted batch worker picks up)."""
        out = []
        for raw_id in self.redis.zrange(self.keys.batches(), 0, -1):  # type: ignore[union-attr]
            batch_id = _s(raw_id)
            status = self.redis.hget(self.keys.batch(batch_id), "status")
            if status is not None and not BatchStatus(_s(status)).is_final:
                out.append(batch_id)
        return out
