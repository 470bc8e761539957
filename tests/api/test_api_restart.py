"""Work outlives the API process that took it: a job and a background response are created on one
API process, which is SIGKILLed while its client reads the stream; another API process (started
beside it, as in a rolling restart, and used only after the kill) serves the record and the rest of
the stream, resumed by ``Last-Event-ID`` / ``starting_after``,
with no event lost or repeated. The worker is a process of its own that never stops, paced by the
test (tests/worker/paced_worker.py) so the kill lands mid-generation on any machine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from shared.settings import Settings
from tests.api.api_process import SpawnApi, spawn_api  # noqa: F401 - the fixture
from tests.api.conftest import WorkerProcess, wait_for_workers
from tests.api.test_end_to_end import sse_events
from tests.api.test_responses import check_sequence, sdk
from tests.conftest import RedisBackend
from tests.worker import paced_worker

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

TOKENS = 16
BEFORE_KILL = 10  # tokens the worker may generate while the first API process lives


@dataclass
class Stack:
    settings: Settings
    gates: redis.Redis
    worker: WorkerProcess

    def allow(self, request_id: str, steps: int) -> None:
        paced_worker.allow_steps(self.gates, self.settings.key_prefix, request_id, steps)


@pytest.fixture(scope="module")
def stack(
    redis_backend: RedisBackend, module_prefix: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    settings = Settings(
        redis_url=redis_backend.url,
        key_prefix=module_prefix,
        model=str(tiny_model_dir),
        heartbeat_ttl_s=3,
        max_new_tokens=2000,
    )
    log = tmp_path_factory.mktemp("restart") / "worker.log"
    worker = WorkerProcess(tiny_model_dir, redis_backend.url, module_prefix, log, None, paced_worker.SCRIPT)
    gates = redis.Redis.from_url(redis_backend.url)
    try:
        yield Stack(settings, gates, worker)
    finally:
        gates.close()
        worker.stop()


def test_a_jobs_stream_resumes_on_a_restarted_api(stack: Stack, spawn_api: SpawnApi) -> None:  # noqa: F811
    first, second = spawn_api(stack.settings), spawn_api(stack.settings, ready=False)
    with first.client() as http:
        wait_for_workers(http, stack.settings.model, 1, [stack.worker])
        job_id = http.post("/v1/jobs", json={"prompt": "Go", "max_new_tokens": TOKENS, "ignore_eos": True}).json()["id"]
        stack.allow(job_id, BEFORE_KILL)
        with http.stream("GET", f"/v1/jobs/{job_id}/stream") as response:
            events = sse_events(response)
            seen = [next(events) for _ in range(BEFORE_KILL)]
            first.kill()  # its client's connection dies with it, mid-stream

    stack.allow(job_id, TOKENS - BEFORE_KILL)
    with second.wait_ready().client() as http:
        assert http.get(f"/v1/jobs/{job_id}").json()["status"] in ("running", "done")
        with http.stream("GET", f"/v1/jobs/{job_id}/stream", headers={"last-event-id": seen[-1][0]}) as response:
            rest = list(sse_events(response))
        job = http.get(f"/v1/jobs/{job_id}").json()
    assert [event_id for event_id, _ in seen + rest] == [str(i) for i in range(TOKENS)]
    assert job["status"] == "done"
    assert [json.loads(data)["token"]["id"] for _, data in seen + rest] == job["result"]["token_ids"]
    assert json.loads(rest[-1][1])["generated_text"] == job["result"]["generated_text"]


def test_a_background_response_resumes_on_a_restarted_api(stack: Stack, spawn_api: SpawnApi) -> None:  # noqa: F811
    first, later = spawn_api(stack.settings), spawn_api(stack.settings, ready=False)
    with first.client() as http:
        wait_for_workers(http, stack.settings.model, 1, [stack.worker])
    created = sdk(first).responses.create(
        input="Go",
        instructions="Be brief.",
        max_output_tokens=TOKENS,
        background=True,
        metadata={"case": "restart"},
        extra_body={"ignore_eos": True},
    )
    stack.allow(created.id, BEFORE_KILL)
    seen = []
    stream = sdk(first).responses.retrieve(created.id, stream=True)
    for event in stream:
        seen.append(event)
        if len(seen) == 12:  # 4 opening events and 8 deltas: the worker waits after BEFORE_KILL tokens
            first.kill()
            break

    second = sdk(later.wait_ready())
    again = second.responses.retrieve(created.id)
    assert again.metadata == {"case": "restart"} and again.instructions == "Be brief."
    assert again.background is True and again.max_output_tokens == TOKENS
    stack.allow(created.id, TOKENS - BEFORE_KILL)
    seen += list(second.responses.retrieve(created.id, stream=True, starting_after=seen[-1].sequence_number))
    final = second.responses.retrieve(created.id)
    check_sequence(seen)
    assert final.status in ("completed", "incomplete") and final.usage is not None
    assert final.usage.output_tokens == TOKENS
    assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == final.output_text
