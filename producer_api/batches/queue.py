"""RQ's part in batches: the queue batch runs wait in, enqueueing a run, the batch worker, and
picking up batches whose run died.

RQ only orchestrates, with its JSON serializer (never pickle): the job it runs
(``job.run_batch``) submits lines into the model queues like any other client and never touches a model."""

from __future__ import annotations

import logging
import os
import uuid
from datetime import UTC, datetime

import redis

from shared.keys import Keys
from shared.settings import Settings, get_settings

# RQ reads its key prefix once, when it is imported: from here on every key RQ writes (queues, jobs,
# results, workers, registries, scheduler locks) lives under the deployment's own prefix, {iq}:rq:...,
# so `inflightq purge` and a shared Redis see them as the deployment's. RQ_KEY_PREFIX, when set, wins.
os.environ.setdefault("RQ_KEY_PREFIX", Keys.for_prefix(get_settings().key_prefix).rq())

from rq import Queue, Retry, Worker
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from producer_api.batches.job import run_batch, warm_up
from producer_api.batches.runner import LEASE_TTL_S
from producer_api.batches.store import BatchErrorItem, BatchObject, BatchStatus, BatchStore

log = logging.getLogger("inflightq.batch")

QUEUE_NAME = "inflightq-batches"
# The completion window plus slack: RQ must not kill a run that is still inside its window.
JOB_TIMEOUT_S = 24 * 3600 + 600
# Transient failures (Redis restarting, a worker-side hiccup) are retried; every run resumes.
RETRY_INTERVALS_S = [2, 10, 30]


def queue_name(settings: Settings) -> str:
    """One RQ queue per key prefix, so deployments (and test runs) sharing a Redis stay apart."""
    return QUEUE_NAME if settings.key_prefix == "iq" else f"{QUEUE_NAME}-{settings.key_prefix}"


def rq_connection(settings: Settings) -> redis.Redis:
    # RQ reads raw bytes replies; the queue client's decoded connection would break it. RQ does not
    # run on a Redis Cluster: there, rq_redis_url names a standalone Redis for it.
    return redis.Redis.from_url(settings.rq_redis_url or settings.redis_url)


def batch_queue(settings: Settings, connection: redis.Redis | None = None) -> Queue:
    return Queue(queue_name(settings), connection=connection or rq_connection(settings), serializer=JSONSerializer)


def enqueue_run(settings: Settings, store: BatchStore, batch_id: str, connection: redis.Redis | None = None) -> str:
    """Queue one run of the batch; several queued runs are harmless (the lease admits one)."""
    job = batch_queue(settings, connection).enqueue(
        run_batch,
        batch_id,
        settings.key_prefix,
        job_id=f"batch-{batch_id}-{uuid.uuid4().hex[:8]}",
        retry=Retry(max=len(RETRY_INTERVALS_S), interval=RETRY_INTERVALS_S),
        job_timeout=JOB_TIMEOUT_S,
        result_ttl=settings.result_ttl_s,
        failure_ttl=settings.result_ttl_s,
        description=f"batch {batch_id}",
    )
    store.set_fields(batch_id, rq_job=job.id)
    return job.id


def _run_is_alive(store: BatchStore, batch_id: str, connection: redis.Redis) -> bool | None:
    """True when a run is queued or running; False when none is; None when the last one failed for good."""
    if store.lease_held(batch_id):
        return True
    job_id = store.redis.hget(store.keys.batch(batch_id), "rq_job")
    if not job_id:
        return False
    try:
        job = Job.fetch(job_id.decode() if isinstance(job_id, bytes) else job_id, connection, JSONSerializer)
    except NoSuchJobError:
        return False
    status = job.get_status()
    if status in (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED):
        return True
    if status == JobStatus.STARTED:
        # Started but holding no lease: alive only in the moment between start and taking the lease.
        started = job.started_at
        if started is None:
            return True
        if started.tzinfo is None:
            started = started.replace(tzinfo=UTC)
        return (datetime.now(UTC) - started).total_seconds() < LEASE_TTL_S
    if status == JobStatus.FAILED:
        return None
    return False


def recover(settings: Settings, store: BatchStore, connection: redis.Redis) -> list[str]:
    """Queue a run for every unfinished batch that has none alive (its batch worker died)."""
    restarted = []
    for batch_id in store.unfinished():
        alive = _run_is_alive(store, batch_id, connection)
        if alive:
            continue
        if alive is None:
            # Every retry failed: the failure is not transient, so the batch fails rather than loops.
            store.set_errors(batch_id, [BatchErrorItem(code="batch_job_failed", message="the batch job kept failing")])
            store.move(
                batch_id,
                BatchStatus.FAILED,
                allowed_from=(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING),
            )
            store.move(batch_id, BatchStatus.CANCELLED, allowed_from=(BatchStatus.CANCELLING,))
            continue
        log.warning("batch %s has no live run; queueing one", batch_id)
        enqueue_run(settings, store, batch_id, connection)
        restarted.append(batch_id)
    return restarted


class BatchWorker(Worker):
    """RQ's worker, plus: at start and every maintenance interval, re-queue batches whose run died."""

    def __init__(self, settings: Settings, store: BatchStore, **kwargs: object) -> None:
        connection = rq_connection(settings)
        super().__init__(
            [batch_queue(settings, connection)],
            connection=connection,
            serializer=JSONSerializer,
            **kwargs,  # type: ignore[arg-type]
        )
        self.inflightq_settings = settings
        self.store = store

    def run_maintenance_tasks(self) -> None:
        super().run_maintenance_tasks()
        try:
            recover(self.inflightq_settings, self.store, self.connection)
            self.store.files.sweep_disk()
        except redis.RedisError:
            log.exception("batch recovery failed; retrying at the next maintenance")


class _MaintenanceToDebug(logging.Filter):
    """RQ logs its registry cleaning at INFO every maintenance interval (15 s here): to DEBUG with it."""

    QUIET = ("cleaning registries", "cleaning group registries", "subscribing to channel")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and any(q in str(record.msg) for q in self.QUIET):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def run_batch_worker(
    settings: Settings, *, name: str | None = None, recover_every_s: int = 15, burst: bool = False
) -> int:
    from shared.redis_connect import connect

    # Every run is forked from this process: whatever the job module loads now, runs get for free.
    warm_up(settings)
    store = BatchStore(settings, connect(settings))  # type: ignore[arg-type]
    worker = BatchWorker(
        settings,
        store,
        name=name or f"batch-{uuid.uuid4().hex[:8]}",
        maintenance_interval=recover_every_s,
        # The dequeue wait is worker_ttl - 15 s; keeping it short lets maintenance (recovery) run often.
        worker_ttl=recover_every_s + 15,
    )
    worker.log.addFilter(_MaintenanceToDebug())
    ok = worker.work(with_scheduler=True, burst=burst, logging_level="INFO")
    return 0 if ok else 1


# What the API and the CLI call: create and cancel, each a store change plus the RQ side. ----
def create_batch(
    settings: Settings,
    store: BatchStore,
    *,
    input_file_id: str,
    endpoint: str,
    completion_window: str = "24h",
    metadata: dict[str, str] | None = None,
    model: str | None = None,
    owner: str | None = None,
    tenant: str | None = None,
    connection: redis.Redis | None = None,
) -> BatchObject:
    batch = store.create(
        input_file_id=input_file_id,
        endpoint=endpoint,
        completion_window=completion_window,
        metadata=metadata,
        model=model,
        owner=owner,
        tenant=tenant,
    )
    enqueue_run(settings, store, batch.id, connection)
    return batch


def cancel_batch(
    settings: Settings,
    store: BatchStore,
    batch_id: str,
    connection: redis.Redis | None = None,
    owner: str | None = None,
) -> BatchObject:
    """Cancel a batch: at once when no run has started it, else through ``cancelling``."""
    batch = store.get(batch_id, owner=owner)
    if batch.status.is_final:
        return batch
    # No run has queued anything yet; a run that starts now finds the batch final and leaves.
    if (
        batch.status == BatchStatus.VALIDATING
        and not store.lease_held(batch_id)
        and store.move(batch_id, BatchStatus.CANCELLED, allowed_from=(BatchStatus.VALIDATING,))
    ):
        return store.get(batch_id)
    batch = store.cancel(batch_id)
    connection = connection or rq_connection(settings)
    if batch.status == BatchStatus.CANCELLING and not _run_is_alive(store, batch_id, connection):
        # The run that would notice the cancel is gone (or still queued behind other batches).
        enqueue_run(settings, store, batch_id, connection)
    return batch
