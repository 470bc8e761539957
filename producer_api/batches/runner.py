"""One run of a batch: input lines -> lowest-priority queue requests -> output and error files.

A run is safe to repeat at any point (RQ retry, a crashed batch worker, two workers racing):

- one run at a time holds the batch's lease; a second one waits for a dead holder's lease to
  lapse, or leaves when the holder is alive;
- a line's queue request id is made once per custom_id (SET NX), and a request already in
  Redis is never submitted again, so a re-run picks up where the last one stopped;
- a line's outcome is written once (HSETNX) and counted only then;
- output and error files have ids derived from the batch id, so rewriting them is harmless.

The runner knows nothing of the OpenAI body formats: ``LineHandler`` turns a line's body into
a queue request and a result into a response body (``producer_api/batches/job.py`` supplies the one
the API routes use)."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from producer_api.api_keys import load_keys
from producer_api.batches.lines import InputLine, batch_error_line, failed_response_line, output_line, parse_lines
from producer_api.batches.store import MAX_BATCH_LINES, BatchErrorItem, BatchObject, BatchStatus, BatchStore, BatchUsage
from producer_api.tenants import Tenants
from shared.client import QueueClient
from shared.errors import InflightqError, NotFoundError, error_from_type
from shared.request_builder import build_request
from shared.schemas import FinalResult, SamplingSpec

log = logging.getLogger("inflightq.batch")

LEASE_TTL_S = 10.0
POLL_S = 0.2
# How long a cancelled batch waits for its running requests to stop before writing its files.
CANCEL_GRACE_S = 10.0


@dataclass(frozen=True)
class PreparedRequest:
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    adapter: str | None = None  # a LoRA adapter of ``model`` the line names as its model


class LineHandler(Protocol):
    def prepare(self, endpoint: str, body: dict[str, Any], model: str | None) -> PreparedRequest:
        """Validate a line's body and build its queue request; raise InflightqError when invalid."""
        ...

    def response_body(self, endpoint: str, request_id: str, result: FinalResult) -> dict[str, Any]:
        """The body the endpoint would have answered (chat.completion or text_completion)."""
        ...


@dataclass
class Pending:
    line: InputLine
    request_id: str


@dataclass
class _Progress:
    pending: dict[str, Pending] = field(default_factory=dict)
    progressed: bool = False


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        client: QueueClient,
        handler: LineHandler,
        batch_id: str,
        *,
        window: int | None = None,
        lease_ttl_s: float = LEASE_TTL_S,
        poll_s: float = POLL_S,
    ) -> None:
        self.store = store
        self.client = client
        self.handler = handler
        self.batch_id = batch_id
        settings = store.settings
        # Requests of this batch in the queue at once: enough to keep workers full, few enough that
        # interactive requests never meet a full queue (429) because of a batch.
        self.window = window or max(1, min(256, settings.max_queue_depth // 4))
        self.priority = settings.priority_levels - 1
        self.lease_ttl_s = lease_ttl_s
        self.poll_s = poll_s
        self.token = uuid.uuid4().hex
        self.lease_lost = False
        self.endpoint = ""
        self.owner: str | None = None
        self.tenant: str | None = None
        self.tenant_weight = 1.0

    # Entry -----------------------------------------------------------------------------
    def run(self) -> BatchStatus:
        if not self._take_lease():
            log.info("batch %s is being run by another live job; leaving it", self.batch_id)
            return self.store.status(self.batch_id)
        # Renewed from a thread: a slow step (loading a tokenizer on a busy machine) must not let
        # the lease lapse and invite a second run.
        stop = threading.Event()
        keeper = threading.Thread(target=self._renew_until, args=(stop,), name="batch-lease", daemon=True)
        keeper.start()
        try:
            return self._run_leased()
        finally:
            stop.set()
            keeper.join()
            self.store.release_lease(self.batch_id, self.token)

    def _take_lease(self) -> bool:
        # A crashed run's lease lapses within its TTL; a live one keeps renewing it.
        deadline = time.monotonic() + self.lease_ttl_s * 1.5
        while not self.store.acquire_lease(self.batch_id, self.token, self.lease_ttl_s):
            if time.monotonic() > deadline:
                return False
            time.sleep(self.poll_s)
        return True

    def _renew_until(self, stop: threading.Event) -> None:
        while not stop.wait(self.lease_ttl_s / 4):
            try:
                if not self.store.renew_lease(self.batch_id, self.token, self.lease_ttl_s):
                    self.lease_lost = True
                    return
            except redis.RedisError:
                log.warning("batch %s: lease renewal failed; retrying", self.batch_id, exc_info=True)

    def _keep_lease(self) -> None:
        if self.lease_lost:
            raise RuntimeError(f"lost the lease of batch {self.batch_id}; another run owns it now")

    def _run_leased(self) -> BatchStatus:
        batch = self.store.get(self.batch_id)
        if batch.status.is_final:
            return batch.status
        self.endpoint = batch.endpoint
        # The creating key owns the results; its tenant (or, without keys, the creator's) runs the
        # lines, with that tenant's weight, and keeps the batch's prefix cache apart.
        self.owner = self.store.owner(self.batch_id)
        self.tenant = batch.tenant or self.owner
        settings = self.store.settings
        self.tenant_weight = Tenants(settings, load_keys(settings)).terms(self.tenant).weight
        # Validating: the whole file is read and its lines checked before any request is queued.
        try:
            lines = parse_lines(self.store.files.content(batch.input_file_id), batch.endpoint)
        except (NotFoundError, UnicodeDecodeError) as exc:
            return self._fail(f"the input file cannot be read: {exc}", code="invalid_file")
        if not lines:
            return self._fail("the input file holds no requests", code="empty_file")
        if len(lines) > MAX_BATCH_LINES:
            return self._fail(f"the input file holds {len(lines)} requests; at most {MAX_BATCH_LINES}", "too_many")
        self.store.set_fields(self.batch_id, total=len(lines))
        self.store.move(self.batch_id, BatchStatus.IN_PROGRESS, allowed_from=(BatchStatus.VALIDATING,))
        if self.store.status(self.batch_id) == BatchStatus.IN_PROGRESS:
            self._process(self.store.get(self.batch_id), lines)
        return self._finish(lines)

    # The loop --------------------------------------------------------------------------
    def _process(self, batch: BatchObject, lines: list[InputLine]) -> None:
        done = self.store.recorded_lines(self.batch_id)
        todo: Iterator[InputLine] = (line for line in lines if line.line_no not in done)
        progress = _Progress()
        exhausted = False
        while True:
            self._keep_lease()
            status = self.store.status(self.batch_id)
            if status != BatchStatus.IN_PROGRESS:
                self._stop_pending(progress, status)
                return
            if batch.expires_at is not None and time.time() >= batch.expires_at:
                self.store.move(self.batch_id, BatchStatus.EXPIRED, allowed_from=(BatchStatus.IN_PROGRESS,))
                self._stop_pending(progress, BatchStatus.EXPIRED)
                return
            progress.progressed = False
            while not exhausted and len(progress.pending) < self.window:
                line = next(todo, None)
                if line is None:
                    exhausted = True
                    break
                self._start(batch, line, progress)
            self._collect(progress)
            if exhausted and not progress.pending:
                return
            if not progress.progressed:
                time.sleep(self.poll_s)

    def _start(self, batch: BatchObject, line: InputLine, progress: _Progress) -> None:
        progress.progressed = True
        if line.error is not None or line.body is None or line.custom_id is None:
            self._record(line, batch_error_line(line.custom_id, "invalid_request", line.error or "", line.line_no))
            return
        try:
            prepared = self.handler.prepare(batch.endpoint, line.body, batch.model)
        except InflightqError as err:
            self._record(line, failed_response_line(line.custom_id, None, err))
            return
        except Exception as exc:  # a line the tokenizer chokes on must not stop the other lines
            log.warning("batch %s line %d could not be prepared", self.batch_id, line.line_no, exc_info=True)
            err = InflightqError(f"the request could not be prepared: {exc}")
            self._record(line, failed_response_line(line.custom_id, None, err))
            return
        request_id, _ = self.store.claim_request_id(self.batch_id, line.custom_id)
        # A request id claimed by an earlier run may already be queued, running or done: never twice.
        if self.client.status(request_id) is None:
            request = build_request(
                self.store.settings,
                prepared.model,
                prepared.prompt_token_ids,
                prepared.sampling,
                priority=self.priority,
                deadline=float(batch.expires_at) if batch.expires_at else None,
                tenant=self.tenant,
                request_id=request_id,
            )
            request.tenant_weight = self.tenant_weight
            request.adapter = prepared.adapter
            self.client.enqueue(request, check_depth=False)
        progress.pending[request_id] = Pending(line, request_id)

    def _collect(self, progress: _Progress) -> None:
        if not progress.pending:
            return
        ids = list(progress.pending)
        pipe = self.client.redis.pipeline(transaction=False)
        for request_id in ids:
            pipe.hget(self.client.keys.request(request_id), "status")
        statuses = pipe.execute()
        for request_id, status in zip(ids, statuses, strict=True):
            if status is None or status in ("done", "failed", "cancelled", "expired"):
                self._settle(progress.pending.pop(request_id), BatchStatus.IN_PROGRESS)
                progress.progressed = True

    def _settle(self, pending: Pending, batch_status: BatchStatus) -> None:
        """Record the outcome of a request that is final (or that the batch gave up on)."""
        line, request_id = pending.line, pending.request_id
        assert line.custom_id is not None
        info = self.client.status(request_id)
        if info is None:
            self._record(line, batch_error_line(line.custom_id, "request_lost", f"request {request_id} vanished"))
        elif info.result is not None:
            body = self.handler.response_body(self.endpoint, request_id, info.result)
            self._record(line, output_line(line.custom_id, request_id, body), ok=True)
        elif info.error is not None and (
            batch_status == BatchStatus.IN_PROGRESS or info.error.error_type not in ("cancelled", "expired")
        ):
            # The request's own failure; only a cancel or expiry the batch caused is reported as the batch's.
            err = error_from_type(info.error.error_type, info.error.message)
            self._record(line, failed_response_line(line.custom_id, request_id, err))
        else:
            code = "batch_expired" if batch_status == BatchStatus.EXPIRED else "batch_cancelled"
            self._record(line, batch_error_line(line.custom_id, code, f"the batch was {batch_status.value} first"))

    def _stop_pending(self, progress: _Progress, status: BatchStatus) -> None:
        """Cancel what this run still has in the queue, and wait a little for running ones to stop."""
        requests = dict(progress.pending)
        for request_id in requests:
            try:
                self.client.cancel(request_id)
            except NotFoundError:
                pass
        deadline = time.monotonic() + CANCEL_GRACE_S
        while progress.pending and time.monotonic() < deadline:
            self._keep_lease()
            before = len(progress.pending)
            self._collect_stopped(progress, status)
            if len(progress.pending) == before:
                time.sleep(self.poll_s)
        for pending in list(progress.pending.values()):
            self._settle(pending, status)
        progress.pending.clear()

    def _collect_stopped(self, progress: _Progress, status: BatchStatus) -> None:
        for request_id in list(progress.pending):
            info = self.client.status(request_id)
            if info is None or info.status.is_final:
                self._settle(progress.pending.pop(request_id), status)

    def _record(self, line: InputLine, doc: dict[str, Any], *, ok: bool = False) -> None:
        self.store.record_outcome(self.batch_id, line.line_no, doc, ok=ok)

    # Endings ---------------------------------------------------------------------------
    def _fail(self, message: str, code: str) -> BatchStatus:
        self.store.set_errors(self.batch_id, [BatchErrorItem(code=code, message=message)])
        self.store.move(
            self.batch_id, BatchStatus.FAILED, allowed_from=(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
        )
        self.store.move(self.batch_id, BatchStatus.CANCELLED, allowed_from=(BatchStatus.CANCELLING,))
        return self.store.status(self.batch_id)

    def _finish(self, lines: list[InputLine]) -> BatchStatus:
        status = self.store.status(self.batch_id)
        if status.is_final and status != BatchStatus.EXPIRED:
            return status  # cancelled before it started, or failed: nothing to write
        if status == BatchStatus.CANCELLING:
            # Requests started by a run that died before it saw the cancel are still in the queue.
            self._cancel_leftovers(lines, BatchStatus.CANCELLING)
        elif status == BatchStatus.EXPIRED:
            self._cancel_leftovers(lines, BatchStatus.EXPIRED)
        else:
            self.store.move(self.batch_id, BatchStatus.FINALIZING, allowed_from=(BatchStatus.IN_PROGRESS,))
        self._write_files()
        self.store.move(self.batch_id, BatchStatus.COMPLETED, allowed_from=(BatchStatus.FINALIZING,))
        self.store.move(self.batch_id, BatchStatus.CANCELLED, allowed_from=(BatchStatus.CANCELLING,))
        return self.store.status(self.batch_id)

    def _cancel_leftovers(self, lines: list[InputLine], status: BatchStatus) -> None:
        done = self.store.recorded_lines(self.batch_id)
        claimed = self.store.request_ids(self.batch_id)
        progress = _Progress()
        for line in lines:
            if line.line_no not in done and line.custom_id in claimed and line.body is not None:
                progress.pending[claimed[line.custom_id]] = Pending(line, claimed[line.custom_id])
        self._stop_pending(progress, status)

    def _write_files(self) -> None:
        outputs: list[str] = []
        errors: list[str] = []
        usage = BatchUsage()
        for _, ok, doc in self.store.outcomes(self.batch_id):
            (outputs if ok else errors).append(json.dumps(doc, separators=(",", ":")))
            if ok:
                counted = doc["response"]["body"].get("usage") or {}
                usage.input_tokens += int(counted.get("prompt_tokens", 0))
                usage.output_tokens += int(counted.get("completion_tokens", 0))
        usage.total_tokens = usage.input_tokens + usage.output_tokens
        fields: dict[str, str | int] = {"usage": usage.model_dump_json()}
        if outputs or not errors:
            out = self.store.files.put(
                _jsonl(outputs),
                filename=f"{self.batch_id}_output.jsonl",
                purpose="batch_output",
                file_id=f"file-{self.batch_id}-output",
                owner=self.owner,
            )
            fields["output_file_id"] = out.id
        if errors:
            err = self.store.files.put(
                _jsonl(errors),
                filename=f"{self.batch_id}_error.jsonl",
                purpose="batch_output",
                file_id=f"file-{self.batch_id}-error",
                owner=self.owner,
            )
            fields["error_file_id"] = err.id
        self.store.set_fields(self.batch_id, **fields)


def _jsonl(rows: list[str]) -> bytes:
    return ("\n".join(rows) + "\n").encode() if rows else b""
