"""A cancel frees the compute, not only the status: after DELETE /v1/jobs/{id}, a client leaving its
stream, a Responses cancel or a batch cancel, the engine stops generating the request within one
step, its KV blocks are free and the request waiting for its slot runs in the very next step.

One worker with a single slot and no prefetch, whose engine writes a line per step
(``tests/worker/step_log_worker.py``): the request waiting for the slot stays in Redis until the
slot frees, and every claim is counted in engine steps, never in seconds."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from producer_api.batches.store import BatchStore
from shared.client import QueueClient
from shared.request_lifecycle import RequestStatus
from shared.schemas import SamplingSpec
from shared.settings import Settings
from tests.api.conftest import ApiServer, WorkerProcess, wait_for_workers
from tests.batch.conftest import Proc
from tests.conftest import RedisBackend
from tests.worker import step_log_worker
from tests.worker.step_log_worker import Step, read_steps

pytestmark = pytest.mark.timeout(180)

LONG = 1500  # tokens: paced at a few ms a step, far from done when the test cancels it
PROMPT = [1, 2, 3, 4, 5]


@dataclass
class Stack:
    api: ApiServer
    client: QueueClient
    step_log: Path

    def steps(self) -> list[Step]:
        return read_steps(self.step_log)

    def wait_steps(self, request_id: str, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while sum(request_id in s.batch for s in self.steps()) < count:
            assert time.monotonic() < deadline, f"{request_id} never ran {count} steps"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def stack(
    redis_backend: RedisBackend,
    module_prefix: str,
    tiny_model_dir: Path,
    start_api: Callable[[Settings], ApiServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    settings = Settings(
        redis_url=redis_backend.url,
        key_prefix=module_prefix,
        model=str(tiny_model_dir),
        heartbeat_ttl_s=3,
        max_new_tokens=2000,
    )
    logs = tmp_path_factory.mktemp("cancel")
    step_log = logs / "steps.jsonl"
    worker_env = {
        "INFLIGHTQ_TEST_STEP_LOG": str(step_log),
        "INFLIGHTQ_TEST_STEP_S": "0.005",
        "INFLIGHTQ_MAX_NUM_SEQS": "1",
        "INFLIGHTQ_PREFETCH_SEQS": "0",
        "OMP_NUM_THREADS": "1",
    }
    worker = WorkerProcess(
        tiny_model_dir, redis_backend.url, module_prefix, logs / "worker.log", worker_env, step_log_worker.SCRIPT
    )
    batch_env = {
        **os.environ,
        "INFLIGHTQ_REDIS_URL": redis_backend.url,
        "INFLIGHTQ_KEY_PREFIX": module_prefix,
        "INFLIGHTQ_MODEL": str(tiny_model_dir),
    }
    batches = Proc(["batch-worker", "--recover-every", "1"], batch_env, logs / "batch-worker.log").start()
    client = QueueClient(settings)
    try:
        api = start_api(settings)
        with api.client() as http:
            wait_for_workers(http, settings.model, 1, [worker])
        yield Stack(api, client, step_log)
    finally:
        client.close()
        batches.stop()
        worker.stop()


@pytest.fixture
def http(stack: Stack) -> Iterator[httpx.Client]:
    with stack.api.client() as client:
        yield client


@pytest.fixture
def oai(stack: Stack) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{stack.api.url}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()


def cancel_frees_the_slot(stack: Stack, victim: str, cancel: Callable[[], None]) -> None:
    """``victim`` is generating in the worker's only slot; a request of its priority waits in Redis.
    After ``cancel``, the victim is in at most one more step than the tokens its cancel recorded, and
    the waiting request runs in the next step, alone, with the victim's blocks back in the pool."""
    client = stack.client
    stack.wait_steps(victim, 3)
    info = client.status(victim)
    assert info is not None and info.status is RequestStatus.RUNNING
    waiting = client.submit(info.model, PROMPT, SamplingSpec(max_new_tokens=2), priority=info.priority)
    queued = client.status(waiting)
    assert queued is not None and queued.status is RequestStatus.QUEUED  # the single slot is the victim's
    start = len(stack.steps())

    cancel()
    deadline = time.monotonic() + 60
    while (info := client.status(victim)) is None or info.status is not RequestStatus.CANCELLED:
        assert time.monotonic() < deadline, f"{victim} was never cancelled: {info}"
        time.sleep(0.02)
    assert info.error is not None and info.error.index is not None
    sent = info.error.index  # tokens the worker had when it took the cancel; one step may be under way

    while True:
        steps = stack.steps()
        if any(waiting in s.batch for s in steps):
            break
        ran = sum(victim in s.batch for s in steps)
        assert ran <= sent + 1, f"the engine kept generating the cancelled request: {ran} steps for {sent} tokens"
        assert time.monotonic() < deadline, "the waiting request never started"
        time.sleep(0.02)
    victim_steps = [i for i, s in enumerate(steps) if victim in s.batch]
    assert len(victim_steps) <= sent + 1, f"{len(victim_steps)} steps for {sent} tokens sent"
    first = next(i for i, s in enumerate(steps) if waiting in s.batch)
    assert first == victim_steps[-1] + 1 and first >= start
    now = steps[first]
    assert now.held == [waiting], "the cancelled request is still in the engine"
    assert now.free_blocks == now.total_blocks - now.blocks[waiting], "the cancelled request's blocks are not free"
    assert client.result(waiting, timeout=60).usage.completion_tokens == 2
    # The worker reports the engine empty again.
    deadline = time.monotonic() + 30
    while not any(w.running == 0 and w.free_kv_blocks == w.num_kv_blocks for w in client.live_workers()):
        assert time.monotonic() < deadline, f"the worker still reports work: {client.live_workers()}"
        time.sleep(0.05)


def test_delete_of_a_running_job_frees_its_slot(stack: Stack, http: httpx.Client) -> None:
    victim = http.post("/v1/jobs", json={"prompt": "Go on", "max_new_tokens": LONG, "ignore_eos": True}).json()["id"]
    cancel_frees_the_slot(stack, victim, lambda: http.delete(f"/v1/jobs/{victim}").raise_for_status())


def test_a_client_leaving_its_stream_frees_its_slot(stack: Stack, http: httpx.Client) -> None:
    body = {"model": stack.api.settings.model, "prompt": "Go", "max_tokens": LONG, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        victim = response.headers["x-request-id"]
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        cancel_frees_the_slot(stack, victim, response.close)


def test_cancel_of_a_background_response_frees_its_slot(stack: Stack, oai: openai.OpenAI) -> None:
    created = oai.responses.create(
        model=stack.api.settings.model,
        input="Go on",
        background=True,
        max_output_tokens=LONG,
        extra_body={"ignore_eos": True},
    )
    cancel_frees_the_slot(stack, created.id, lambda: oai.responses.cancel(created.id))


def test_cancel_of_a_batch_frees_the_slot_of_its_running_request(stack: Stack, oai: openai.OpenAI) -> None:
    line = {
        "custom_id": "long",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": stack.api.settings.model, "prompt": "Go on", "max_tokens": LONG, "ignore_eos": True},
    }
    uploaded = oai.files.create(file=("long.jsonl", json.dumps(line).encode()), purpose="batch")
    batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    store = BatchStore(stack.api.settings, stack.client.redis)
    deadline = time.monotonic() + 60
    while (victim := store.request_ids(batch.id).get("long")) is None:
        assert time.monotonic() < deadline, "the batch never queued its request"
        time.sleep(0.05)
    cancel_frees_the_slot(stack, victim, lambda: oai.batches.cancel(batch.id))
