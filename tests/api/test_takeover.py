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

pytestmark = pytest.mark.timeout(300)


JOB_TOKENS = 1500


def test_job_stream_survives_a_worker_crash(
    redis_backend: RedisBackend,
    module_prefix: str,
    tiny_model_dir: Path,
    start_api: Callable[[Settings], ApiServer],
    tmp_path: Path,
) -> None:
    redis_url, cluster = redis_backend.url, redis_backend.cluster
    settings = Settings(
        redis_url=redis_url,
        redis_cluster=cluster,
        key_prefix=module_prefix,
        model=str(tiny_model_dir),
        heartbeat_ttl_s=3,
        no_worker_wait_s=120,  # the stream must wait out the gap between the crash and the new worker
        max_new_tokens=2000,
    )
    fast_reclaim = {"INFLIGHTQ_RECLAIM_AFTER_S": "1"}

    def worker(name: str) -> WorkerProcess:
        return WorkerProcess(tiny_model_dir, redis_url, module_prefix, tmp_path / name, fast_reclaim, cluster=cluster)

    first = worker("first.log")
    second: WorkerProcess | None = None
    try:
        api = start_api(settings)
        with api.client() as http:
            wait_for_workers(http, settings.model, 1, [first])
            # Long enough to still be running when the crash lands: an idle box runs the tiny model at ~1 ms a token.
            body = {"prompt": "Go", "max_new_tokens": JOB_TOKENS, "ignore_eos": True}
            job_id = http.post("/v1/jobs", json=body).json()["id"]
            seen: list[tuple[int, int]] = []  # (index, token id)
            final: dict | None = None
            with http.stream("GET", f"/v1/jobs/{job_id}/stream") as response:
                for event_id, data in sse_events(response):
                    event = json.loads(data)
                    assert "error" not in event, event
                    assert int(event_id) == event["index"]
                    seen.append((event["index"], event["token"]["id"]))
                    if len(seen) == 5:
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
    assert r.hget(Keys.for_prefix(module_prefix).request(job_id), "status") == "done"
    r.close()
