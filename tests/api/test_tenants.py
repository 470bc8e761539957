"""Tenants through real clients (httpx and the openai package) against a running API on real Redis:
who a request's tenant is (key, header, user field), the tenant in job and batch records, a tenant
over its queued limit refused (429 + Retry-After) while another is served, requests and tokens per
minute per key, and the tenant metrics' bounded labels.

Saturated by construction: a worker that beats but never consumes (``never_consuming_worker``), so
whatever a tenant queues stays queued. tests/api/test_tenants_on_cluster.py runs the limits again on a
Redis Cluster."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from producer_api.api_keys import parse_key
from producer_api.batches.job import ApiLineHandler
from producer_api.batches.runner import BatchRunner
from producer_api.batches.store import BatchStore
from producer_api.tenants import Tenants
from shared.client import QueueClient
from shared.keys import Keys
from shared.redis_connect import connect
from shared.schemas import QueuedRequest, WorkerHeartbeat
from shared.settings import Settings
from shared.work_queue import STREAM_FIELD
from tests.api.conftest import ApiServer
from tests.conftest import RedisBackend

BIG = "sk-big"  # tenant "big", weight 3, at most 3 queued
SMALL = "sk-small"  # tenant "small", weight 1
PLAIN = "sk-plain"  # its own tenant: its key id
RATED = "sk-rated"  # 2 requests and 100 tokens per minute
KEYS = [
    f"{BIG}:tenant=big:weight=3:max_queued=3",
    f"{SMALL}:2:tenant=small",
    PLAIN,
    f"{RATED}:rpm=2:tpm=100",
]


def never_consuming_worker(settings: Settings, name: str = "fake-worker") -> None:
    """A live worker's heartbeat (``tests.api.conftest.fake_heartbeat``'s) written through the settings'
    client, a RedisCluster on the Cluster: dispatch finds it, what is queued stays queued."""
    keys, now = Keys.for_prefix(settings.key_prefix), time.time()
    beat = WorkerHeartbeat(
        name=name, model=settings.model, device="cpu", dtype="float64", max_num_seqs=1, num_kv_blocks=1,
        running=0, waiting=0, free_kv_blocks=1, started_at=now,
    )  # fmt: skip
    client = connect(settings)
    client.set(keys.worker(name), beat.model_dump_json(), ex=600)
    client.zadd(keys.workers(), {name: now + 600})
    client.close()


@pytest.fixture
def make_api(
    redis_backend: RedisBackend,
    key_prefix: str,
    tiny_model_dir: Path,
    start_api: Callable[[Settings], ApiServer],
) -> Callable[..., ApiServer]:
    def make(**overrides: object) -> ApiServer:
        fields: dict[str, object] = {
            "redis_url": redis_backend.url,
            "redis_cluster": redis_backend.cluster,
            "key_prefix": key_prefix,
            "model": str(tiny_model_dir),
            "no_worker_wait_s": 0,
            **overrides,
        }
        settings = Settings(**fields)  # type: ignore[arg-type]
        never_consuming_worker(settings)
        return start_api(settings)

    return make


def job(
    http: httpx.Client, key: str | None = None, headers: dict[str, str] | None = None, **body: object
) -> httpx.Response:
    auth = {"x-api-key": key} if key else {}
    return http.post(
        "/v1/jobs", json={"prompt": "hi", "max_new_tokens": 4, **body}, headers={**auth, **(headers or {})}
    )


def tenant_of_job(http: httpx.Client, job_id: str, key: str | None = None) -> str | None:
    record = http.get(f"/v1/jobs/{job_id}", headers={"x-api-key": key} if key else {})
    assert record.status_code == 200, record.text
    return record.json()["tenant"]


def rejections(http: httpx.Client, tenant: str, limit: str) -> float:
    """The API's count of ``tenant``'s 429s for ``limit`` (0 before the first)."""
    pattern = rf'inflightq_api_tenant_rejections_total\{{limit="{limit}",tenant="{tenant}"\}} (\S+)'
    found = re.search(pattern, http.get("/metrics").text)
    return float(found.group(1)) if found else 0.0


def test_key_specs_with_named_options_and_the_old_positional_form() -> None:
    big = parse_key(KEYS[0])
    assert (big.tenant, big.weight, big.max_queued, big.max_priority) == ("big", 3.0, 3, None)
    small = parse_key(KEYS[1])
    assert (small.tenant, small.max_priority, small.weight) == ("small", 2, 1.0)
    assert parse_key(PLAIN).tenant == parse_key(PLAIN).key_id
    rated = parse_key(KEYS[3])
    assert (rated.requests_per_minute, rated.tokens_per_minute) == (2, 100)
    assert parse_key("k:1:30:tpm=5") == parse_key("k:max_priority=1:rpm=30:tpm=5")
    # Keys of one tenant must agree on its terms; a tenant no key names gets weight 1 and the default limit.
    tenants = Tenants(
        Settings(tenant_max_queued=7), [parse_key("a:tenant=t:weight=2"), parse_key("b:tenant=t:weight=2")]
    )
    assert (tenants.terms("t").weight, tenants.terms("t").max_queued) == (2.0, 7)
    assert (tenants.terms("elsewhere").weight, tenants.terms(None).max_queued) == (1.0, 7)
    with pytest.raises(ValueError, match="'t'"):
        Tenants(Settings(), [parse_key("a:tenant=t:weight=2"), parse_key("b:tenant=t")])
    for bad in ("s3cret:weight=0", "s3cret:weight=x", "s3cret:colour=red", "s3cret:1:2:3", "s3cret:tpm=many"):
        with pytest.raises(ValueError) as info:
            parse_key(bad)
        assert "s3cret" not in str(info.value)


def test_the_tenant_comes_from_the_key_and_shows_in_job_and_batch_records(make_api: Callable[..., ApiServer]) -> None:
    api = make_api(api_keys=KEYS)
    with api.client() as http:
        created = job(http, BIG)
        assert created.status_code == 202 and created.json()["tenant"] == "big"
        assert tenant_of_job(http, created.json()["id"], BIG) == "big"
        # A key without a tenant option is its own tenant (its key id); a body's tenant cannot override a key.
        plain = job(http, PLAIN, tenant="big").json()
        assert tenant_of_job(http, plain["id"], PLAIN) == parse_key(PLAIN).key_id
        # A Responses API response shows its tenant too.
        response = http.post(
            "/v1/responses",
            json={"input": "hi", "max_output_tokens": 2, "background": True},
            headers={"x-api-key": BIG},
        )
        assert response.status_code == 200 and response.json()["tenant"] == "big", response.text
        shown = http.get(f"/v1/responses/{response.json()['id']}", headers={"x-api-key": BIG}).json()
        assert shown["tenant"] == "big"
        # Objects belong to the tenant: another tenant's key does not see them.
        assert http.get(f"/v1/jobs/{created.json()['id']}", headers={"x-api-key": SMALL}).status_code == 404
        # A batch records its creator's tenant; its lines run as that tenant.
        line = (
            '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 2}}'
        )
        upload = http.post(
            "/v1/files",
            files={"file": ("in.jsonl", line.encode())},
            data={"purpose": "batch"},
            headers={"x-api-key": SMALL},
        )
        assert upload.status_code == 200, upload.text
        batch = http.post(
            "/v1/batches",
            json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"},
            headers={"x-api-key": SMALL},
        )
        assert batch.status_code == 200, batch.text
        assert batch.json()["tenant"] == "small"
        shown = http.get(f"/v1/batches/{batch.json()['id']}", headers={"x-api-key": SMALL}).json()
        assert shown["tenant"] == "small"


def test_batch_lines_run_as_their_creators_tenant_with_its_weight(make_api: Callable[..., ApiServer]) -> None:
    api = make_api(api_keys=KEYS)
    settings = api.settings
    lines = "\n".join(
        json.dumps(
            {
                "custom_id": f"l{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": settings.model, "prompt": "x", "max_tokens": 2},
            }
        )
        for i in range(3)
    )
    with api.client(headers={"x-api-key": BIG}) as http:
        upload = http.post("/v1/files", files={"file": ("in.jsonl", lines.encode())}, data={"purpose": "batch"})
        batch = http.post(
            "/v1/batches",
            json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"},
        ).json()
        assert batch["tenant"] == "big"
        # The batch worker's run, in a thread: it queues the lines, which stay queued (no worker consumes).
        client = QueueClient(settings)
        runner = BatchRunner(
            BatchStore(settings, client.redis), client, ApiLineHandler(settings), batch["id"], poll_s=0.05
        )
        run = threading.Thread(target=runner.run, daemon=True)
        run.start()
        try:
            lane = client.keys.lane(settings.model, settings.priority_levels - 1, "big")
            deadline = time.monotonic() + 30
            while client.redis.xlen(lane) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            queued = [
                QueuedRequest.model_validate_json(fields[STREAM_FIELD]) for _, fields in client.redis.xrange(lane)
            ]
            assert [(q.tenant, q.tenant_weight) for q in queued] == [("big", 3.0)] * 3
        finally:
            assert http.post(f"/v1/batches/{batch['id']}/cancel").status_code == 200
            run.join(timeout=30)
            client.close()
        assert not run.is_alive()


def test_without_keys_the_tenant_comes_from_the_header(make_api: Callable[..., ApiServer]) -> None:
    api = make_api(tenant_source="header", tenant_header="X-Team")
    with api.client() as http:
        created = job(http, headers={"X-Team": "search"}, tenant="ignored")
        assert tenant_of_job(http, created.json()["id"]) == "search"
        assert tenant_of_job(http, job(http).json()["id"]) is None
        oversized = job(http, headers={"X-Team": "t" * 129})
        assert oversized.status_code == 422 and oversized.json()["field"] == "X-Team"
        # TGI's routes take the header too (leaving the stream cancels the request; its record keeps the tenant).
        body = {"inputs": "x", "parameters": {"max_new_tokens": 2}}
        with http.stream("POST", "/generate_stream", json=body, headers={"X-Team": "ads"}) as stream:
            assert stream.status_code == 200
            request_id = stream.headers["x-request-id"]
        assert tenant_of_job(http, request_id) == "ads"


def test_without_keys_the_tenant_comes_from_openais_user_field(make_api: Callable[..., ApiServer]) -> None:
    api = make_api(tenant_source="user")
    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=api.settings.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True, user="acme"
    )
    request_id = raw.headers["x-request-id"]
    raw.parse().close()  # leaving the stream cancels the request; its record keeps the tenant
    with api.client() as http:
        assert tenant_of_job(http, request_id) == "acme"
        assert tenant_of_job(http, job(http, tenant="jobs-field").json()["id"]) == "jobs-field"


def test_a_tenant_over_its_queued_limit_gets_429_while_another_is_served(make_api: Callable[..., ApiServer]) -> None:
    api = make_api(api_keys=KEYS, tenant_metrics=["big"], tenant_metrics_max=0)
    big = openai.OpenAI(base_url=f"{api.url}/v1", api_key=BIG, max_retries=0)
    small = openai.OpenAI(base_url=f"{api.url}/v1", api_key=SMALL, max_retries=0)
    with api.client() as http:
        refusals_before = rejections(http, "big", "tenant_overloaded")
        # big fills its share of the queue: 3 jobs waiting, no worker takes them.
        for _ in range(3):
            assert job(http, BIG).status_code == 202
        refused = job(http, BIG)
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error_type"] == "overloaded"
        assert refused.json()["limit"] == {"name": "tenant_max_queued", "value": 3}
        # TGI's dialect for the same limit.
        generated = http.post(
            "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}}, headers={"x-api-key": BIG}
        )
        assert generated.status_code == 429 and generated.json()["limit"]["name"] == "tenant_max_queued"
        # small, at the same priority level, is still taken.
        assert job(http, SMALL).status_code == 202
    # OpenAI's dialect, through the openai package: big refused with its limit named, small accepted.
    with pytest.raises(openai.RateLimitError) as info:
        big.completions.create(model=api.settings.model, prompt="x", max_tokens=2)
    assert info.value.code == "tenant_overloaded"
    assert int(info.value.response.headers["retry-after"]) >= 1
    assert info.value.body["limit"] == {"name": "tenant_max_queued", "value": 3}  # type: ignore[index]
    raw = small.chat.completions.with_raw_response.create(
        model=api.settings.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
    )
    assert raw.http_response.status_code == 200
    raw.parse().close()
    with api.client() as http:
        # The API's counters live in its process (several test APIs share them): counted from before.
        assert rejections(http, "big", "tenant_overloaded") == refusals_before + 3


def test_requests_and_tokens_per_minute_per_key(make_api: Callable[..., ApiServer]) -> None:
    api = make_api(api_keys=KEYS)
    with api.client() as http:
        # 2 requests per minute: the third is refused, naming the limit; other keys keep their own budget.
        assert job(http, RATED, max_new_tokens=1).status_code == 202
        assert http.get("/v1/jobs/nope", headers={"x-api-key": RATED}).status_code == 404
        refused = job(http, RATED, max_new_tokens=1)
        assert refused.status_code == 429 and refused.json()["error_type"] == "rate_limited"
        assert refused.json()["limit"] == {"name": "requests_per_minute", "value": 2}
        assert 1 <= int(refused.headers["retry-after"]) <= 120
        assert job(http, PLAIN).status_code == 202
    rated = openai.OpenAI(base_url=f"{api.url}/v1", api_key=RATED, max_retries=0)
    with pytest.raises(openai.RateLimitError) as info:
        rated.completions.create(model=api.settings.model, prompt="x", max_tokens=2)
    assert info.value.code == "requests_per_minute"


def test_tokens_per_minute_count_prompt_and_max_new_tokens(make_api: Callable[..., ApiServer]) -> None:
    api = make_api(api_keys=["sk-tpm:tpm=100", PLAIN])
    with api.client() as http:
        first = job(http, "sk-tpm", prompt=[1, 2, 3, 4], max_new_tokens=56)  # 60 tokens
        assert first.status_code == 202, first.text
        refused = job(http, "sk-tpm", prompt=[1, 2, 3, 4], max_new_tokens=56)  # 120 > 100
        assert refused.status_code == 429
        assert refused.json()["limit"] == {"name": "tokens_per_minute", "value": 100}
        # The 60 tokens leave the sliding window within its two minutes; the wait says when there is room.
        assert 60 <= int(refused.headers["retry-after"]) <= 120
        assert job(http, "sk-tpm", prompt=[1, 2, 3, 4], max_new_tokens=36).status_code == 202  # 100 in all
        too_big = job(http, "sk-tpm", prompt=[1], max_new_tokens=200)
        assert too_big.status_code == 429 and "exceed" in too_big.json()["error"]
        assert job(http, PLAIN, max_new_tokens=200).status_code == 202


def test_tenant_queue_depth_labels_are_bounded(make_api: Callable[..., ApiServer]) -> None:
    api = make_api(tenant_source="header", tenant_metrics=["gold"], tenant_metrics_max=1)
    with api.client() as http:
        for tenant, count in (("gold", 1), ("deep", 3), ("a", 1), ("b", 2)):
            for _ in range(count):
                assert job(http, headers={"X-Tenant": tenant}).status_code == 202
        metrics = http.get("/metrics").text
    depth = dict(re.findall(r'inflightq_queue_tenant_depth\{model="[^"]*",tenant="([^"]*)"\} (\S+)', metrics))
    # gold by name, the deepest other by name, the rest folded.
    assert depth == {"gold": "1.0", "deep": "3.0", "other": "3.0"}
    with QueueClient(api.settings) as client:
        assert client.tenant_waiting(api.settings.model) == {"gold": 1, "deep": 3, "a": 1, "b": 2}


def test_the_queue_view_an_autoscaler_reads_counts_every_tenants_lane_per_priority(
    make_api: Callable[..., ApiServer],
) -> None:
    """KEDA's metrics-api triggers (deploy/k8s/keda-scaledobject.yaml) read ``waiting.p<n>`` from ``GET /queue``:
    requests of named tenants wait in their own lanes, and every one of them counts."""
    api = make_api(api_keys=KEYS)
    with api.client() as http:
        for key, priority, count in ((BIG, 1, 2), (SMALL, 2, 3), (PLAIN, 0, 1), (PLAIN, 1, 1)):
            for _ in range(count):
                assert job(http, key, priority=priority).status_code == 202
        view = http.get("/queue", params={"model": api.settings.model})
        assert view.status_code == 200, view.text
        body = view.json()
        assert body["waiting"] == {"p0": 1, "p1": 3, "p2": 3, "p3": 0} and body["waiting_total"] == 7
        assert body["oldest_waiting_age_s"] >= 0
        assert http.get("/queue").json()["waiting"] == body["waiting"], "one model served: that one"
        metrics = http.get("/metrics").text
        depth = dict(re.findall(r'inflightq_queue_depth\{model="[^"]*",priority="(\d)"\} (\S+)', metrics))
        assert {f"p{p}": int(float(v)) for p, v in depth.items()} == body["waiting"], "as the metric counts"
        unknown = http.get("/queue", params={"model": "nope"})
        assert unknown.status_code == 422 and unknown.json()["field"] == "model", unknown.text
