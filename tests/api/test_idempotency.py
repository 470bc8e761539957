"""Idempotency-Key on the POST routes that create work: a retry answers with the object the
first request created and never creates a second; the same key with another body is a 409."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import redis

from shared.keys import Keys
from shared.settings import Settings
from tests.api.conftest import ApiServer
from tests.conftest import RedisBackend


def requests_made(r: redis.Redis, settings: Settings) -> int:
    """Requests ever created under the deployment's prefix (each has its hash while its result lives)."""
    return sum(1 for _ in r.scan_iter(Keys.for_prefix(settings.key_prefix).request_pattern(), count=1000))


def test_a_retried_job_is_the_same_job_and_runs_once(api: ApiServer, redis_backend: RedisBackend) -> None:
    r = redis.Redis.from_url(redis_backend.url)
    before = requests_made(r, api.settings)
    body = {"prompt": "hello", "max_new_tokens": 4}
    with api.client() as http:
        first = http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "job-retry-1"})
        again = http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "job-retry-1"})
        assert first.status_code == again.status_code == 202
        assert again.json() == first.json() and again.headers["location"] == first.headers["location"]
        assert again.headers["idempotent-replayed"] == "true" and "idempotent-replayed" not in first.headers
        job_id = first.json()["id"]
        deadline = time.monotonic() + 60
        while http.get(f"/v1/jobs/{job_id}").json()["status"] != "done":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert requests_made(r, api.settings) == before + 1  # one job ran
        # Another body under the same key is refused, naming the header; it queues nothing.
        other = http.post("/v1/jobs", json={**body, "prompt": "bye"}, headers={"Idempotency-Key": "job-retry-1"})
        assert other.status_code == 409
        assert other.json()["field"] == "Idempotency-Key"
        # Without the header, or with another key, each POST is a new job.
        assert http.post("/v1/jobs", json=body).json()["id"] != job_id
        assert http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "job-retry-2"}).json()["id"] != job_id
    assert requests_made(r, api.settings) == before + 3
    r.close()


def test_concurrent_retries_create_one_job(api: ApiServer, redis_backend: RedisBackend) -> None:
    r = redis.Redis.from_url(redis_backend.url)
    before = requests_made(r, api.settings)
    body = {"prompt": "together", "max_new_tokens": 2}

    def post(_: int) -> httpx.Response:
        with api.client() as http:
            return http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "job-race"})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(8)))
    ids = {a.json()["id"] for a in answers if a.status_code == 202}
    assert len(ids) == 1
    # A retry racing the first one is told to retry later, never given a second job.
    assert all(a.status_code in (202, 409) for a in answers)
    assert requests_made(r, api.settings) == before + 1
    r.close()


def test_a_failed_first_request_frees_its_key(api: ApiServer) -> None:
    with api.client() as http:
        bad = http.post("/v1/jobs", json={"prompt": [10**9]}, headers={"Idempotency-Key": "job-fails-first"})
        assert bad.status_code == 422
        good = http.post("/v1/jobs", json={"prompt": "fine"}, headers={"Idempotency-Key": "job-fails-first"})
        assert good.status_code == 202


def test_a_retried_response_is_the_same_response(api: ApiServer) -> None:
    body = {"model": api.settings.model, "input": "hi", "background": True, "max_output_tokens": 4}
    with api.client() as http:
        first = http.post("/v1/responses", json=body, headers={"Idempotency-Key": "resp-1"})
        again = http.post("/v1/responses", json=body, headers={"Idempotency-Key": "resp-1"})
        assert first.status_code == again.status_code == 200
        assert again.json()["id"] == first.json()["id"]
        other = http.post("/v1/responses", json={**body, "input": "ho"}, headers={"Idempotency-Key": "resp-1"})
        assert other.status_code == 409
        assert other.json()["error"]["param"] == "Idempotency-Key"
        stream = http.post("/v1/responses", json={**body, "stream": True}, headers={"Idempotency-Key": "resp-2"})
        assert stream.status_code == 400 and stream.json()["error"]["param"] == "Idempotency-Key"


def test_retried_files_and_batches_are_the_same_objects(api: ApiServer) -> None:
    with api.client() as http:
        upload = {"files": {"file": ("in.jsonl", b"\n")}, "data": {"purpose": "batch"}}
        first = http.post("/v1/files", **upload, headers={"Idempotency-Key": "file-1"})  # type: ignore[arg-type]
        again = http.post("/v1/files", **upload, headers={"Idempotency-Key": "file-1"})  # type: ignore[arg-type]
        file_id = first.json()["id"]
        assert again.json()["id"] == file_id
        assert [f["id"] for f in http.get("/v1/files").json()["data"]].count(file_id) == 1
        changed = {"files": {"file": ("in.jsonl", b"{}\n")}, "data": {"purpose": "batch"}}
        assert http.post("/v1/files", **changed, headers={"Idempotency-Key": "file-1"}).status_code == 409  # type: ignore[arg-type]

        body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
        batch = http.post("/v1/batches", json=body, headers={"Idempotency-Key": "batch-1"}).json()
        assert http.post("/v1/batches", json=body, headers={"Idempotency-Key": "batch-1"}).json()["id"] == batch["id"]
        batch_ids = [b["id"] for b in http.get("/v1/batches", params={"limit": 100}).json()["data"]]
        assert batch_ids.count(batch["id"]) == 1
        changed_batch = {**body, "metadata": {"n": "2"}}
        assert http.post("/v1/batches", json=changed_batch, headers={"Idempotency-Key": "batch-1"}).status_code == 409


def test_each_api_key_has_its_own_idempotency_keys(keyed_api: ApiServer) -> None:
    with keyed_api.client() as http:
        headers = {"Idempotency-Key": "shared-name"}
        a = http.post("/v1/jobs", json={"prompt": "a"}, headers={**headers, "authorization": "Bearer key-a"})
        b = http.post("/v1/jobs", json={"prompt": "b"}, headers={**headers, "authorization": "Bearer key-b"})
        assert a.status_code == b.status_code == 202
        assert a.json()["id"] != b.json()["id"]
