"""Files and batches of the OpenAI Batch API, kept in Redis: the one place their state lives.

A batch moves through OpenAI's statuses:

    validating ──► in_progress ──► finalizing ──► completed
        │               │               │
        ├───────────────┴───────────────┴──► cancelling ──► cancelled
        ├──► failed    (the input file is gone or unreadable)
        └──► expired   (completion_window passed before the batch finished)

Who moves it: ``BatchStore.create`` writes ``validating``; ``BatchStore.cancel`` (API or CLI)
writes ``cancelling``; the RQ job (``producer_api/batches/job.py``) writes every other state.

Files are in ``producer_api/batches/files.py``. Every per-line fact is written once (HSETNX), so a job
that runs twice after a crash counts and writes each line once."""

from __future__ import annotations

import json
import time
import uuid
from enum import StrEnum
from typing import Any, Literal

import redis
from pydantic import BaseModel, Field

from producer_api.batches.files import FileStore, as_text, unix_now
from producer_api.ownership import visible
from shared.errors import NotFoundError, ValidationError
from shared.keys import Keys
from shared.settings import Settings

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


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    """Tokens of the batch's successful requests, summed when it ends."""

    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


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
    usage: BatchUsage | None = None
    tenant: str | None = Field(None, description="The tenant its lines run as (its creator's), with its weight.")


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

# Compare-and-extend / compare-and-delete of a batch's lease: one key, so one slot on a Cluster,
# where redis-py's Cluster client has no WATCH (and a GET then DEL could drop a lease another run
# took in between).
_RENEW_LEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
_RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


class BatchStore:
    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self.redis = client
        self.keys = Keys.for_prefix(settings.key_prefix)
        self.files = FileStore(settings, client)
        self._transition = client.register_script(_TRANSITION)
        self._record = client.register_script(_RECORD_OUTCOME)
        self._renew_lease = client.register_script(_RENEW_LEASE)
        self._release_lease = client.register_script(_RELEASE_LEASE)

    # Creation and reading -------------------------------------------------------------
    def create(
        self,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
        model: str | None = None,
        owner: str | None = None,
        tenant: str | None = None,
    ) -> BatchObject:
        if endpoint not in SUPPORTED_ENDPOINTS:
            raise ValidationError(f"endpoint must be one of {', '.join(SUPPORTED_ENDPOINTS)}", field="endpoint")
        if completion_window not in COMPLETION_WINDOWS:
            raise ValidationError("completion_window must be '24h'", field="completion_window")
        if metadata is not None and (
            len(metadata) > 16 or any(len(k) > 64 or len(str(v)) > 512 for k, v in metadata.items())
        ):
            raise ValidationError("metadata: at most 16 pairs, keys <= 64 and values <= 512 chars", field="metadata")
        input_file = self.files.get(input_file_id, owner=owner)
        if input_file.purpose != "batch":
            raise ValidationError(
                f"file {input_file_id!r} was not uploaded with purpose 'batch'", field="input_file_id"
            )
        created = unix_now()
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
            tenant=tenant,
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
        if owner:
            fields["owner"] = owner
        if tenant:
            fields["tenant"] = tenant
        self.files.keep(input_file_id, self._ttl())
        with self.redis.pipeline() as pipe:
            pipe.hset(self.keys.batch(batch.id), mapping=fields)
            pipe.expire(self.keys.batch(batch.id), self._ttl())
            pipe.zadd(self.keys.batches(), {batch.id: time.time()})
            pipe.expire(self.keys.batches(), self._ttl())  # no entry outlives it; an idle deployment's index goes
            pipe.execute()
        return batch

    def _ttl(self) -> int:
        # A batch record must outlive its completion window, plus the time its results are kept.
        return max(COMPLETION_WINDOWS["24h"], 0) + self.settings.result_ttl_s

    def _fields(self, batch_id: str, owner: str | None = None) -> dict[str, str]:
        raw = self.redis.hgetall(self.keys.batch(batch_id))
        f = {as_text(k): as_text(v) for k, v in raw.items()}  # type: ignore[union-attr]
        # Another key's batch does not exist, as far as this key can tell.
        if not f or not visible(f.get("owner"), owner):
            raise NotFoundError(f"no batch {batch_id!r}")
        return f

    def owner(self, batch_id: str) -> str | None:
        """The id of the API key that created the batch (None when auth is off)."""
        return self._fields(batch_id).get("owner") or None

    def get(self, batch_id: str, *, owner: str | None = None) -> BatchObject:
        """The batch; with ``owner``, only when that key created it."""
        f = self._fields(batch_id, owner)
        return self._object(f)

    @staticmethod
    def _object(f: dict[str, str]) -> BatchObject:

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
            usage=BatchUsage.model_validate_json(f["usage"]) if f.get("usage") else None,
            tenant=f.get("tenant") or None,
        )

    def status(self, batch_id: str) -> BatchStatus:
        value = self.redis.hget(self.keys.batch(batch_id), "status")
        if value is None:
            raise NotFoundError(f"no batch {batch_id!r}")
        return BatchStatus(as_text(value))

    def list(self, *, limit: int = 20, after: str | None = None, owner: str | None = None) -> BatchPage:
        """Newest first, as OpenAI pages; ``after`` is the last id of the previous page."""
        limit = max(1, min(limit, 100))
        start = 0
        if after:
            rank = self.redis.zrevrank(self.keys.batches(), after)
            if rank is None:
                raise NotFoundError(f"no batch {after!r}")
            start = int(rank) + 1  # type: ignore[arg-type]
        found: list[BatchObject] = []
        has_more = False
        while not has_more:
            ids = [as_text(i) for i in self.redis.zrevrange(self.keys.batches(), start, start + limit)]  # type: ignore[union-attr]
            if not ids:
                break
            start += len(ids)
            for batch_id in ids:
                try:
                    f = self._fields(batch_id)
                except NotFoundError:
                    # The record expired before its index entry; drop the stale entry.
                    self.redis.zrem(self.keys.batches(), batch_id)
                    start -= 1
                    continue
                if not visible(f.get("owner"), owner):
                    continue
                if len(found) == limit:
                    has_more = True
                    break
                found.append(self._object(f))
        return BatchPage(
            data=found,
            first_id=found[0].id if found else None,
            last_id=found[-1].id if found else None,
            has_more=has_more,
        )

    # Moves ----------------------------------------------------------------------------
    def move(self, batch_id: str, to: BatchStatus, *, allowed_from: tuple[BatchStatus, ...]) -> BatchStatus | None:
        """Move to ``to`` if the batch is in one of ``allowed_from``; returns the status it left, or None."""
        stamp = _STATUS_TIMESTAMP.get(to, "")
        previous = self._transition(
            keys=[self.keys.batch(batch_id)],
            args=[to.value, stamp, *[s.value for s in allowed_from], str(unix_now())],
        )
        return BatchStatus(as_text(previous)) if previous else None

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
        return {int(as_text(k)) for k in self.redis.hkeys(self.keys.batch_outcomes(batch_id))}  # type: ignore[union-attr]

    def outcomes(self, batch_id: str) -> list[tuple[int, bool, dict[str, Any]]]:
        """Every recorded outcome in input-line order: (line number, ok, output or error line)."""
        raw = self.redis.hgetall(self.keys.batch_outcomes(batch_id))
        rows = []
        for k, v in raw.items():  # type: ignore[union-attr]
            doc = json.loads(as_text(v))
            rows.append((int(as_text(k)), bool(doc["ok"]), doc["line"]))
        return sorted(rows, key=lambda row: row[0])

    def claim_request_id(self, batch_id: str, custom_id: str) -> tuple[str, bool]:
        """The queue request id of a line: made once per custom_id (SET NX), so re-runs reuse it.

        Returns (request id, True when this call created it)."""
        fresh = uuid.uuid4().hex
        key = self.keys.idempotency(batch_id, custom_id)
        created = self.redis.set(key, fresh, nx=True, ex=self._ttl())
        request_id = fresh if created else as_text(self.redis.get(key))
        self.redis.hset(self.keys.batch_requests(batch_id), custom_id, request_id)
        self.redis.expire(self.keys.batch_requests(batch_id), self._ttl())
        return request_id, bool(created)

    def request_ids(self, batch_id: str) -> dict[str, str]:
        raw = self.redis.hgetall(self.keys.batch_requests(batch_id))
        return {as_text(k): as_text(v) for k, v in raw.items()}  # type: ignore[union-attr]

    # The one run that owns the batch ---------------------------------------------------
    def acquire_lease(self, batch_id: str, token: str, ttl_s: float) -> bool:
        key = self.keys.batch_lease(batch_id)
        if self.redis.set(key, token, nx=True, px=int(ttl_s * 1000)):
            return True
        return self.renew_lease(batch_id, token, ttl_s)

    def renew_lease(self, batch_id: str, token: str, ttl_s: float) -> bool:
        # Compare-and-extend: a run whose lease lapsed and was taken over must notice and stop.
        key = self.keys.batch_lease(batch_id)
        return bool(self._renew_lease(keys=[key], args=[token, int(ttl_s * 1000)]))

    def release_lease(self, batch_id: str, token: str) -> None:
        self._release_lease(keys=[self.keys.batch_lease(batch_id)], args=[token])

    def lease_held(self, batch_id: str) -> bool:
        return bool(self.redis.exists(self.keys.batch_lease(batch_id)))

    def unfinished(self) -> list[str]:
        """Ids of batches not yet in a final status (what a restarted batch worker picks up)."""
        out = []
        for raw_id in self.redis.zrange(self.keys.batches(), 0, -1):  # type: ignore[union-attr]
            batch_id = as_text(raw_id)
            status = self.redis.hget(self.keys.batch(batch_id), "status")
            if status is not None and not BatchStatus(as_text(status)).is_final:
                out.append(batch_id)
        return out
