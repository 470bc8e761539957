"""Load shedding: 429 overloaded past the queue depth limit; 503 when no worker serves the model
(after no_worker_wait_s) or Redis is gone; never a hang."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from inflightq_cli.redis_server import free_port
from shared.keys import Keys
from shared.settings import Settings
from tests.api.conftest import ApiServer, fake_heartbeat


@pytest.fixture
def make_settings(redis_url: str, key_prefix: str, tiny_model_dir: Path) -> Callable[..., Settings]:
    def make(**overrides: object) -> Settings:
        fields: dict[str, object] = {"redis_url": redis_url, "key_prefix": key_prefix, "model": str(tiny_model_dir)}
        return Settings(**{**fields, **overrides})  # type: ignore[arg-type]

    return make


def test_queue_deeper_than_the_limit_is_429_overloaded(
    make_settings: Callable[..., Settings], start_api: Callable[[Settings], ApiServer], redis_url: str
) -> None:
    settings = make_settings(max_queue_depth=1)
    fake_heartbeat(redis_url, settings)  # "live", but consumes nothing: the queue only grows
    api = start_api(settings)
    with api.client() as http:
        assert http.post("/v1/jobs", json={"prompt": "one", "max_new_tokens": 2}).status_code == 202
        response = http.post("/generate", json={"inputs": "two", "parameters": {"max_new_tokens": 2}})
        assert response.status_code == 429
        assert response.json()["error_type"] == "overloaded"
        assert response.headers["retry-after"]
        response = http.post(
            "/v1/chat/completions",
            json={"model": settings.model, "messages": [{"role": "user", "content": "x"}], "stream": True},
        )
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "overloaded"
        assert http.post("/v1/jobs", json={"prompt": "three"}).json()["error_type"] == "overloaded"


def test_n_choices_past_the_limit_withdraw_the_accepted_ones(
    make_settings: Callable[..., Settings],
    start_api: Callable[[Settings], ApiServer],
    redis_url: str,
    redis_client: redis.Redis,
    keys: Keys,
) -> None:
    settings = make_settings(max_queue_depth=2)
    fake_heartbeat(redis_url, settings)
    api = start_api(settings)
    with api.client() as http:
        body = {"model": settings.model, "prompt": "x", "n": 3, "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 429
    statuses = [redis_client.hget(key, "status") for key in redis_client.scan_iter(match=keys.request_pattern())]
    assert statuses == ["cancelled", "cancelled"]


def test_no_live_worker_is_503_after_the_wait(
    make_settings: Callable[..., Settings], start_api: Callable[[Settings], ApiServer]
) -> None:
    api = start_api(make_settings(no_worker_wait_s=0.5))
    with api.client() as http:
        started = time.monotonic()
        response = http.post("/generate", json={"inputs": "hi"})
        waited = time.monotonic() - started
        assert response.status_code == 503
        assert response.json()["error_type"] == "unavailable"
        # It waited for a worker to appear (no_worker_wait_s) before giving up; a hang instead shows as
        # the client's timeout, not as a bound on seconds that a busy machine could break.
        assert waited >= api.settings.no_worker_wait_s
        chat = {"model": api.settings.model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        assert http.post("/v1/chat/completions", json=chat).json()["error"]["type"] == "service_unavailable"
        assert http.get("/v1/models").json() == {"object": "list", "data": []}
        idle = http.get(f"/v1/models/{api.settings.model}")  # served, but as /v1/models says: not live
        assert idle.status_code == 404 and "no live worker" in idle.json()["error"]["message"]


def test_a_request_whose_workers_all_die_gets_503_not_a_hang(
    make_settings: Callable[..., Settings], start_api: Callable[[Settings], ApiServer], redis_url: str
) -> None:
    settings = make_settings(heartbeat_ttl_s=1, no_worker_wait_s=0.5)
    fake_heartbeat(redis_url, settings, fresh_for_s=0)  # alive at dispatch, dead a second later
    api = start_api(settings)
    with api.client() as http:  # a hang would be the client's timeout
        response = http.post("/generate", json={"inputs": "hi"})
        assert response.status_code == 503, response.text
        assert "any more" in response.json()["error"]


def test_leaving_a_stream_while_still_queued_cancels_the_request(
    make_settings: Callable[..., Settings],
    start_api: Callable[[Settings], ApiServer],
    redis_url: str,
    redis_client: redis.Redis,
    keys: Keys,
) -> None:
    # No token will ever come (nobody consumes), so only watching the connection can notice the leave.
    settings = make_settings()
    fake_heartbeat(redis_url, settings)
    api = start_api(settings)
    with api.client() as http:
        with http.stream("POST", "/generate_stream", json={"inputs": "hi"}) as response:
            request_id = response.headers["x-request-id"]
            assert redis_client.hget(keys.request(request_id), "status") == "queued"
        deadline = time.monotonic() + 10
        while redis_client.hget(keys.request(request_id), "status") != "cancelled" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert redis_client.hget(keys.request(request_id), "status") == "cancelled"
        gauge = 'inflightq_api_streams_in_flight{route="/generate_stream"} 0.0'
        assert gauge in http.get("/metrics").text


def test_jobs_are_accepted_without_a_worker(
    make_settings: Callable[..., Settings], start_api: Callable[[Settings], ApiServer]
) -> None:
    # A queued job is what scales workers up from zero, so the jobs API does not wait for one.
    api = start_api(make_settings(no_worker_wait_s=0))
    with api.client() as http:
        created = http.post("/v1/jobs", json={"prompt": "hi", "priority": 0})
        assert created.status_code == 202
        job = http.get(f"/v1/jobs/{created.json()['id']}").json()
        assert job["status"] == "queued" and job["priority"] == 0
        cancelled = http.delete(f"/v1/jobs/{job['id']}").json()
        assert cancelled == {"id": job["id"], "object": "job", "cancelled": True}
        assert http.get(f"/v1/jobs/{job['id']}").json()["status"] == "cancelled"


def test_redis_unreachable_is_503_at_once(
    make_settings: Callable[..., Settings], start_api: Callable[[Settings], ApiServer]
) -> None:
    # "At once": not after waiting for a worker (no_worker_wait_s is longer than the client's patience).
    api = start_api(make_settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", no_worker_wait_s=600))
    with api.client() as http:  # timeout=60
        for method, path, body in (
            ("POST", "/generate", {"inputs": "hi"}),
            ("POST", "/generate_stream", {"inputs": "hi"}),
            ("POST", "/v1/jobs", {"prompt": "hi"}),
            ("GET", "/v1/jobs/abc", None),
            ("POST", "/v1/completions", {"model": api.settings.model, "prompt": "hi"}),
        ):
            response = http.request(method, path, json=body)
            assert response.status_code == 503, (path, response.text)
        assert http.get("/health").status_code == 503
        # Validation still answers without Redis.
        assert http.post("/generate", json={"inputs": ""}).status_code == 422
