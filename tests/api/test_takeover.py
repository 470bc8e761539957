"""A job's SSE stream follows it across a worker crash: another worker takes the request over and
the client sees one gap-free, duplicate-free sequence of tokens ending in the result."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.keys import Keys
from shared.redis_connect import connect
from shared.settings import Settings
from tests.api.conftest import ApiServer, WorkerProcess, wait_for_workers
from tests.api.test_end_to_end import sse_events
from tests.conftest import RedisBackend
from tests.worker import paced_worker

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


JOB_TOKENS = 300
ALLOWED_BEFORE_CRASH = 5  # tokens the first worker may generate; it is killed while it waits for the 6th


def test_job_stream_survives_a_worker_crash(
    redis_backend: RedisBackend,
    module_prefix: str,
    tiny_model_dir: Path,
    start_api: Callable[[Settings], ApiServer],
    tmp_path: Path,
) -> None:
    redis_url, cluster = redis_backend.url, redis_backend.cluster
    # A prefix of its own: a module's stack (another worker of the same model) may share module_prefix,
    # and must not take the job in place of the worker this test crashes.
    prefix = module_prefix + "-takeover"
    settings = Settings(
        redis_url=redis_url,
        redis_cluster=cluster,
        key_prefix=prefix,
        model=str(tiny_model_dir),
        heartbeat_ttl_s=3,
        no_worker_wait_s=120,  # the stream must wait out the gap between the crash and the new worker
        max_new_tokens=2000,
    )
    fast_reclaim = {"INFLIGHTQ_RECLAIM_AFTER_S": "1"}

    def worker(name: str, paced: bool = False) -> WorkerProcess:
        # The first worker is paced (tests/worker/paced_worker.py): it generates the tokens the test
        # allows and then waits, so the crash lands mid-job however fast the machine runs the model.
        script = paced_worker.SCRIPT if paced else None
        log = tmp_path / name
        return WorkerProcess(tiny_model_dir, redis_url, prefix, log, fast_reclaim, script, cluster=cluster)

    first = worker("first.log", paced=True)
    second: WorkerProcess | None = None
    try:
        api = start_api(settings)
        with api.client() as http:
            wait_for_workers(http, settings.model, 1, [first])
            body = {"prompt": "Go", "max_new_tokens": JOB_TOKENS, "ignore_eos": True}
            job_id = http.post("/v1/jobs", json=body).json()["id"]
            gates = connect(settings)
            paced_worker.allow_steps(gates, prefix, job_id, ALLOWED_BEFORE_CRASH)
            gates.close()
            seen: list[tuple[int, int]] = []  # (index, token id)
            final: dict | None = None
            with http.stream("GET", f"/v1/jobs/{job_id}/stream") as response:
                for event_id, data in sse_events(response):
                    event = json.loads(data)
                    assert "error" not in event, event
                    assert int(event_id) == event["index"]
                    seen.append((event["index"], event["token"]["id"]))
                    if len(seen) == ALLOWED_BEFORE_CRASH:  # the first worker now waits for a permit
                        first.crash()
                        second = worker("second.log")
                    if event["generated_text"] is not None:
                        final = event
            job = http.get(f"/v1/jobs/{job_id}").json()
    finally:
        first.stop()
        if second is not None:
            second.stop()
    assert final is not None and job["status"] == "done"
    assert job["attempt"] >= 1, "the request was not taken over (it finished before the crash?)"
    assert [index for index, _ in seen] == list(range(JOB_TOKENS))
    assert [token for _, token in seen] == job["result"]["token_ids"]
    assert final["generated_text"] == job["result"]["generated_text"]
    r = connect(settings, decode_responses=True)
    assert r.hget(Keys.for_prefix(prefix).request(job_id), "status") == "done"
    r.close()
