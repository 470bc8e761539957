"""A batch run that dies is resumed without submitting any line twice: by running the job function
again, or by a restarted RQ batch worker picking the batch up."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from producer_api.batches.job import ApiLineHandler
from producer_api.batches.queue import create_batch
from producer_api.batches.runner import BatchRunner
from producer_api.batches.store import BatchObject, BatchStore
from shared.client import QueueClient
from shared.settings import Settings
from tests.batch.conftest import ROOT, Proc, chat_line, jsonl, wait_for

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

N = 16


def _upload(store: BatchStore, model: str) -> str:
    # Long enough that a fast worker has not finished the batch by the time a test kills its job.
    lines = [chat_line(f"row-{i}", model, f"Tell me about {i}", max_tokens=48, ignore_eos=True) for i in range(N)]
    return store.files.put("\n".join(lines).encode(), filename="rows.jsonl", purpose="batch").id


def _run_job(batch_id: str, settings: Settings, env: dict[str, str]) -> subprocess.Popen[str]:
    code = "import sys; from producer_api.batches.job import run_batch; print(run_batch(sys.argv[1], sys.argv[2]))"
    return subprocess.Popen(
        [sys.executable, "-c", code, batch_id, settings.key_prefix],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _run_in_process(batch_id: str, settings: Settings) -> str:
    client = QueueClient(settings)
    try:
        store = BatchStore(settings, client.redis)
        return BatchRunner(store, client, ApiLineHandler(settings), batch_id).run().value
    finally:
        client.close()


def _submitted_at(settings: Settings, request_ids: list[str]) -> dict[str, tuple[float | None, int]]:
    client = QueueClient(settings)
    try:
        infos = {rid: client.status(rid) for rid in request_ids}
    finally:
        client.close()
    return {rid: (info.submitted_at, info.deliveries) for rid, info in infos.items() if info is not None}


def _assert_each_line_once(store: BatchStore, batch: BatchObject, settings: Settings) -> None:
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed) == (N, N)
    assert batch.output_file_id and batch.error_file_id is None
    outputs = jsonl(store.files.content(batch.output_file_id))
    assert [o["custom_id"] for o in outputs] == [f"row-{i}" for i in range(N)]
    mapped = store.request_ids(batch.id)
    assert len(mapped) == N and {o["response"]["request_id"] for o in outputs} == set(mapped.values())
    # One submission per line: a second XADD of a request would have been delivered (and counted) again.
    assert all(deliveries == 1 for _, deliveries in _submitted_at(settings, list(mapped.values())).values())


def test_running_the_job_again_after_a_crash_duplicates_nothing(
    store: BatchStore, stack_settings: Settings, stack_env: dict[str, str], queue_worker: Proc
) -> None:
    batch = store.create(input_file_id=_upload(store, stack_settings.model), endpoint="/v1/chat/completions")
    first = _run_job(batch.id, stack_settings, stack_env)
    try:
        wait_for(store, batch.id, lambda b: b.request_counts.completed >= 3, timeout=120)
    finally:
        first.kill()  # a crash: no cleanup, the lease stays until its TTL
        first.wait(10)
    assert store.get(batch.id).status == "in_progress"
    before = _submitted_at(stack_settings, list(store.request_ids(batch.id).values()))

    # The job function again, in this process: it waits out the dead run's lease, then resumes.
    assert _run_in_process(batch.id, stack_settings) == "completed"
    done = store.get(batch.id)
    _assert_each_line_once(store, done, stack_settings)
    after = _submitted_at(stack_settings, list(before))
    assert all(after[rid][0] == before[rid][0] for rid in before)  # never re-enqueued

    assert _run_in_process(batch.id, stack_settings) == "completed"
    assert store.get(batch.id) == done


def test_a_killed_batch_worker_is_replaced_and_the_batch_resumes(
    store: BatchStore,
    stack_settings: Settings,
    queue_worker: Proc,
    batch_worker_factory: Callable[[], Proc],
) -> None:
    crashed = batch_worker_factory()
    batch = create_batch(
        stack_settings, store, input_file_id=_upload(store, stack_settings.model), endpoint="/v1/chat/completions"
    )
    wait_for(store, batch.id, lambda b: b.request_counts.completed >= 3, timeout=120)
    crashed.kill()
    assert not store.get(batch.id).status.is_final

    batch_worker_factory()
    done = wait_for(store, batch.id, lambda b: b.status.is_final, timeout=150)
    _assert_each_line_once(store, done, stack_settings)
