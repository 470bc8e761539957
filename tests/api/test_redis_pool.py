"""The API's Redis command connections are a bounded pool that waits (issue 18): however many
requests and streams are in flight at once, one API process holds at most
``api_redis_max_connections`` command connections per Redis node (on a standalone Redis its one
pub/sub connection is one of them; on a Cluster a node has up to two more: the hub's pub/sub
connection and redis-py's slot-map queries), every request
still succeeds, and a wait for a connection past ``api_redis_pool_wait_s`` is a 503 with
Retry-After, not a hang. Counted as Redis sees them: the ``CLIENT LIST`` entries named for the API
(``api_client_name``), sampled on every node while the requests run.

On a standalone Redis of this module's own (one test pauses its clients); the same tests run on
the session's Cluster in ``test_redis_pool_on_cluster.py``."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from inflightq_cli.redis_server import PrivateRedis
from producer_api.state import api_client_name
from shared.redis_connect import connect
from shared.settings import Settings
from tests.api.conftest import ApiServer
from tests.conftest import RedisBackend, cluster_backend

pytestmark = pytest.mark.timeout(300)

BOUND = 4  # far below the requests in flight, so the bound bites
REQUESTS = 300


@pytest.fixture(scope="module")
def redis_backend(request: pytest.FixtureRequest) -> Iterator[RedisBackend]:
    """A private standalone Redis (a test pauses its clients: never the shared one), or the
    session's Cluster for a module with ``ON_CLUSTER``."""
    if getattr(request.module, "ON_CLUSTER", False):
        yield cluster_backend(request.getfixturevalue("redis_cluster"))
        return
    server = PrivateRedis().start()
    try:
        yield RedisBackend(server.url)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def nodes(redis_backend: RedisBackend) -> Iterator[dict[str, redis.Redis]]:
    """A plain client of every node (replicas too: the API must hold nothing there either)."""
    if not redis_backend.cluster:
        client = redis.Redis.from_url(redis_backend.url, decode_responses=True)
        yield {redis_backend.url: client}
        client.close()
        return
    cluster = connect(Settings(redis_url=redis_backend.url, redis_cluster=True), decode_responses=True)
    yield {node.name: cluster.get_redis_connection(node) for node in cluster.get_nodes()}  # type: ignore[union-attr]
    cluster.close()


def pool_api(
    start_api: Callable[[Settings], ApiServer], backend: RedisBackend, module_prefix: str, model: Path, **limits: float
) -> ApiServer:
    """An API with no worker (jobs stay queued, their streams wait) and a small command pool."""
    settings = Settings(
        redis_url=backend.url,
        redis_cluster=backend.cluster,
        key_prefix=f"{module_prefix}-{uuid.uuid4().hex[:6]}",
        model=str(model),
        no_worker_wait_s=600,
        api_redis_max_connections=BOUND,
        **limits,  # type: ignore[arg-type]
    )
    return start_api(settings)


class ConnectionWatch:
    """Samples ``CLIENT LIST`` on every node while it runs: the most connections named ``name``
    each node held at once."""

    def __init__(self, nodes: dict[str, redis.Redis], name: str) -> None:
        self.nodes, self.name = nodes, name
        self.most = dict.fromkeys(nodes, 0)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            for node, client in self.nodes.items():
                held = sum(1 for entry in client.client_list() if entry.get("name") == self.name)
                self.most[node] = max(self.most[node], held)
            self.samples += 1
            self._stop.wait(0.02)

    def __enter__(self) -> ConnectionWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def last_event(lines: list[str]) -> dict[str, object]:
    data = [line[5:].strip() for line in lines if line.startswith("data:")]
    return json.loads(data[-1]) if data else {}


@pytest.mark.slow
def test_hundreds_of_requests_and_streams_at_once_share_a_bounded_pool(
    start_api: Callable[[Settings], ApiServer],
    redis_backend: RedisBackend,
    module_prefix: str,
    tiny_model_dir: Path,
    nodes: dict[str, redis.Redis],
) -> None:
    api = pool_api(start_api, redis_backend, module_prefix, tiny_model_dir, api_redis_pool_wait_s=60)
    hub = api.app.state.inflightq.dispatcher.client.hub
    # Per node: the bound; on a Cluster also the hub's own pub/sub connection, and the one redis-py's
    # Cluster client keeps to a node it asked for the slot map (CLUSTER SLOTS, outside the pool).
    most_allowed = BOUND + (2 if redis_backend.cluster else 0)

    async def run() -> tuple[list[int], list[int], list[list[str]]]:
        # Pooled connections expire well before uvicorn closes idle ones (5 s): reusing one the server
        # is closing that moment is a ReadError on the client's side (seen under load), not the API's.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=1.0)
        async with httpx.AsyncClient(base_url=api.url, timeout=120, limits=limits) as http:
            submitted = await asyncio.gather(
                *(http.post("/v1/jobs", json={"prompt": f"job {i}", "max_new_tokens": 1}) for i in range(REQUESTS))
            )
            ids = [r.json().get("id") for r in submitted]
            streams = await asyncio.gather(*(http.send(http.build_request("GET", f"/v1/jobs/{i}/stream"),
                                                       stream=True) for i in ids))  # fmt: skip
            readers = [asyncio.ensure_future(_lines(r)) for r in streams]
            deadline = time.monotonic() + 60
            while hub.channels < REQUESTS and time.monotonic() < deadline:  # every stream subscribed
                await asyncio.sleep(0.1)
            cancelled = await asyncio.gather(*(http.delete(f"/v1/jobs/{i}") for i in ids))
            lines = await asyncio.wait_for(asyncio.gather(*readers), 60)
            return [r.status_code for r in submitted], [r.status_code for r in cancelled], lines

    with ConnectionWatch(nodes, api_client_name(api.settings)) as watch:
        submitted, cancelled, lines = asyncio.run(run())

    # Every request succeeded: waiting for a connection is not failing for want of one.
    assert submitted == [202] * REQUESTS
    assert cancelled == [200] * REQUESTS
    # Every stream was open together, then ended with its own job's cancellation.
    assert [last_event(stream).get("error_type") for stream in lines] == ["cancelled"] * REQUESTS
    # ... and the API never held more than the bound on any node (it did use the pool: > 1).
    assert watch.samples > 10
    assert max(watch.most.values()) > 1, watch.most
    assert all(held <= most_allowed for held in watch.most.values()), watch.most


async def _lines(response: httpx.Response) -> list[str]:
    try:
        return [line async for line in response.aiter_lines()]
    finally:
        await response.aclose()


def test_a_wait_for_a_connection_past_its_limit_is_a_503_not_a_hang(
    start_api: Callable[[Settings], ApiServer],
    redis_backend: RedisBackend,
    module_prefix: str,
    tiny_model_dir: Path,
    nodes: dict[str, redis.Redis],
) -> None:
    wait_s, pause_s = 0.5, 5.0
    api = pool_api(start_api, redis_backend, module_prefix, tiny_model_dir, api_redis_pool_wait_s=wait_s)
    body = {"prompt": "job", "max_new_tokens": 1}
    with httpx.Client(base_url=api.url, timeout=30) as http:
        for _ in range(3):  # the pool's connections exist before Redis stalls
            assert http.post("/v1/jobs", json=body).status_code == 202

    async def during_a_stall() -> list[tuple[int, str | None, float]]:
        async def one(http: httpx.AsyncClient) -> tuple[int, str | None, float]:
            started = time.monotonic()
            response = await http.post("/v1/jobs", json=body)
            return response.status_code, response.headers.get("retry-after"), time.monotonic() - started

        async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
            # Redis answers nobody for pause_s: BOUND requests hold every connection meanwhile.
            for client in nodes.values():
                client.client_pause(int(pause_s * 1000), all=True)
            return await asyncio.gather(*(one(http) for _ in range(3 * BOUND)))

    outcomes = asyncio.run(during_a_stall())
    refused = [(status, retry_after, took) for status, retry_after, took in outcomes if status != 202]
    assert refused, outcomes
    for status, retry_after, took in refused:
        # Out of connections for wait_s: 503 with Retry-After, well before Redis answers again.
        assert (status, retry_after) == (503, "5"), outcomes
        assert took < pause_s - 1, outcomes
    # The pool is whole again once Redis answers.
    deadline = time.monotonic() + 30
    with httpx.Client(base_url=api.url, timeout=30) as http:
        while (status := http.post("/v1/jobs", json=body).status_code) != 202 and time.monotonic() < deadline:
            time.sleep(0.5)
    assert status == 202
