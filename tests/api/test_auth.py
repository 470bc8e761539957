"""API keys: 401 without a valid one; a key's priority ceiling and its per-minute rate limit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from producer_api.api_keys import find_key, parse_key
from shared.settings import Settings
from tests.api.conftest import ApiServer
from tests.conftest import RedisBackend


@pytest.fixture
def api(
    redis_backend: RedisBackend,
    key_prefix: str,
    tiny_model_dir: Path,
    start_api: Callable[[Settings], ApiServer],
    tmp_path: Path,
) -> ApiServer:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\nfile-key:0\n\n")
    settings = Settings(
        redis_url=redis_backend.url,
        redis_cluster=redis_backend.cluster,
        key_prefix=key_prefix,
        model=str(tiny_model_dir),
        api_keys=["gold:0", "bronze:2:3"],
        api_keys_file=str(keys_file),
        no_worker_wait_s=0,
    )
    return start_api(settings)


def test_parse_key_specs() -> None:
    assert parse_key("k") == parse_key("k::")
    key = parse_key("k:1:30")
    assert (key.secret, key.max_priority, key.requests_per_minute) == ("k", 1, 30)
    assert find_key([parse_key("a"), key], "k") is key
    assert find_key([key], "k2") is None
    with pytest.raises(ValueError) as info:
        parse_key("secret:x")
    assert "secret" not in str(info.value)


def test_missing_or_wrong_key_is_401(api: ApiServer) -> None:
    with api.client() as http:
        response = http.post("/v1/jobs", json={"prompt": "hi"})
        assert response.status_code == 401
        assert response.json()["error_type"] == "authentication"
        assert http.post("/v1/jobs", json={"prompt": "hi"}, headers={"authorization": "Bearer nope"}).status_code == 401
        response = http.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers={"x-api-key": "gol"})
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        # Health, metrics, docs and /info stay open for probes and scrapers.
        for path in ("/health", "/metrics", "/info", "/docs", "/openapi.json"):
            assert http.get(path).status_code == 200, path


def test_valid_key_in_either_header(api: ApiServer) -> None:
    with api.client() as http:
        assert http.post("/v1/jobs", json={"prompt": "hi"}, headers={"authorization": "Bearer gold"}).status_code == 202
        assert http.post("/v1/jobs", json={"prompt": "hi"}, headers={"x-api-key": "file-key"}).status_code == 202


def test_priority_is_clamped_to_the_keys_ceiling(api: ApiServer) -> None:
    with api.client() as http:
        urgent = http.post("/v1/jobs", json={"prompt": "hi", "priority": 0}, headers={"x-api-key": "bronze"}).json()
        assert urgent["priority"] == 2  # bronze may not be more urgent than 2
        lax = http.post("/v1/jobs", json={"prompt": "hi", "priority": 3}, headers={"x-api-key": "bronze"}).json()
        assert lax["priority"] == 3
        gold = http.post("/v1/jobs", json={"prompt": "hi", "priority": 0}, headers={"x-api-key": "gold"}).json()
        assert gold["priority"] == 0


def test_rate_limit_per_key_is_429_rate_limited(api: ApiServer) -> None:
    # bronze allows 3 per minute; 8 requests put at least 4 in one minute window even across a boundary.
    with api.client() as http:
        statuses = []
        for _ in range(8):
            response = http.get("/v1/jobs/nope", headers={"x-api-key": "bronze"})
            statuses.append(response.status_code)
            if response.status_code == 429:
                assert response.json()["error_type"] == "rate_limited"
                assert int(response.headers["retry-after"]) >= 1
        assert 429 in statuses
        assert statuses[:3] == [404, 404, 404] or statuses.count(404) >= 3
        # Other keys keep their own budget.
        assert http.get("/v1/jobs/nope", headers={"x-api-key": "gold"}).status_code == 404


def test_key_never_appears_in_responses_or_metrics(api: ApiServer) -> None:
    with api.client() as http:
        http.get("/v1/jobs/nope", headers={"x-api-key": "gold"})
        http.get("/v1/jobs/nope", headers={"x-api-key": "wrong-secret"})
        assert "gold" not in http.get("/metrics").text
        assert "wrong-secret" not in http.get("/v1/jobs/x", headers={"x-api-key": "wrong-secret"}).text
