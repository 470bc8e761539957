"""A Redis Cluster master dies (SIGKILL) under live traffic: its replica is promoted, the API and
the worker reconnect by themselves, every request accepted before, during or after the failover
completes, and every client's job stream, resumed by ``Last-Event-ID``, sees each token exactly
once and in order.

The test runs its own Cluster (3 masters + 3 replicas, AOF on): the session's ``redis_cluster``
must keep all its masters' replicas for the other modules. The worker is the real one, paced
(``slow_worker.py``) so that its requests are still generating when the replica takes over."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from inflightq_cli.redis_cluster import PrivateRedisCluster
from shared.keys import Keys
from shared.redis_connect import connect
from shared.settings import Settings
from tests.api.conftest import ApiServer, WorkerProcess, wait_for_workers
from tests.api.test_end_to_end import sse_events
from tests.worker.slow_worker import SCRIPT as SLOW_WORKER

pytestmark = pytest.mark.timeout(180)

JOBS = 6
JOB_TOKENS = 400  # x 15 ms a step: about 6 s of generation, longer than a failover
STEP_S = "0.015"
SEEN_BEFORE_KILL = 3  # tokens each client has before the master dies


@pytest.fixture
def own_cluster() -> Iterator[PrivateRedisCluster]:
    # A short node timeout: the replica is promoted about 1-2 s after its master stops answering.
    cluster = PrivateRedisCluster(node_timeout_ms=1000).start()
    yield cluster
    cluster.stop()


@dataclass
class Follower:
    """One client of a job's SSE stream, on its own thread: it leaves its stream once after the
    kill (as a client whose connection dropped) and on any transport error, and comes back
    with ``Last-Event-ID`` set to the last index it saw."""

    api_url: str
    job_id: str
    killed: threading.Event
    seen: list[tuple[int, int]] = field(default_factory=list)  # (index, token id)
    final: dict | None = None
    errors: list[str] = field(default_factory=list)
    connections: int = 0
    warmed: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        last: str | None = None
        left_after_kill = False
        deadline = time.monotonic() + 90
        with httpx.Client(base_url=self.api_url, timeout=60) as http:
            while self.final is None and time.monotonic() < deadline:
                headers = {"last-event-id": last} if last is not None else {}
                self.connections += 1
                try:
                    with http.stream("GET", f"/v1/jobs/{self.job_id}/stream", headers=headers) as response:
                        if response.status_code != 200:
                            self.errors.append(f"HTTP {response.status_code}: {response.read()!r}")
                            continue
                        for event_id, data in sse_events(response):
                            event = json.loads(data)
                            if "error" in event:
                                self.errors.append(data)
                                break
                            assert event_id is not None and int(event_id) == event["index"]
                            self.seen.append((event["index"], event["token"]["id"]))
                            last = event_id
                            if len(self.seen) >= SEEN_BEFORE_KILL:
                                self.warmed.set()
                            if event["generated_text"] is not None:
                                self.final = event
                                return
                            if self.killed.is_set() and not left_after_kill:
                                left_after_kill = True
                                break
                except httpx.TransportError as error:
                    self.errors.append(f"transport: {error!r}")


def test_a_killed_master_fails_over_without_losing_or_repeating_a_token(
    own_cluster: PrivateRedisCluster,
    run_prefix: str,
    tiny_model_dir: Path,
    start_api: Callable[[Settings], ApiServer],
    tmp_path: Path,
) -> None:
    cluster = own_cluster
    prefix = f"{run_prefix}-failover"
    settings = Settings(
        redis_url=cluster.url,
        redis_cluster=True,
        key_prefix=prefix,
        model=str(tiny_model_dir),
        heartbeat_ttl_s=3,
        no_worker_wait_s=60,
        max_new_tokens=2000,
    )
    keys = Keys.for_prefix(prefix)
    worker = WorkerProcess(
        tiny_model_dir,
        cluster.url,
        prefix,
        tmp_path / "worker.log",
        {"INFLIGHTQ_TEST_STEP_S": STEP_S},
        SLOW_WORKER,
        cluster=True,
    )
    threads: list[threading.Thread] = []
    try:
        api = start_api(settings)
        with api.client() as http:
            wait_for_workers(http, settings.model, 1, [worker])
            body = {"prompt": "Go", "max_new_tokens": JOB_TOKENS, "ignore_eos": True}
            job_ids = [http.post("/v1/jobs", json=body).json()["id"] for _ in range(JOBS)]

            # The master to kill: the one holding the request keys of most of the jobs.
            homes = Counter(cluster.node_of(keys.request(job_id)).port for job_id in job_ids)
            victim = next(n for n in cluster.nodes if n.port == homes.most_common(1)[0][0])
            on_victim = [j for j in job_ids if cluster.node_of(keys.request(j)).port == victim.port]

            killed = threading.Event()
            followers = [Follower(api.url, job_id, killed) for job_id in job_ids]
            threads = [threading.Thread(target=f.run, daemon=True) for f in followers]
            for thread in threads:
                thread.start()
            for follower in followers:
                assert follower.warmed.wait(60), f"{follower.job_id}: no tokens before the kill: {follower.errors}"

            victim.kill()
            killed.set()
            # Submissions while the shard is down or being promoted: each one accepted must complete.
            accepted: list[str] = []
            refused: list[int] = []
            short = {"prompt": "Hi", "max_new_tokens": 4, "ignore_eos": True}
            while not cluster.healthy() and len(accepted) + len(refused) < 20:
                response = http.post("/v1/jobs", json=short, timeout=30)
                if response.status_code == 202:
                    accepted.append(response.json()["id"])
                else:
                    refused.append(response.status_code)
            cluster.wait_failover(timeout=30)
            statuses = {j: job_status(http, j) for j in on_victim}
            # Otherwise the test proves nothing about generating across the failover.
            assert "running" in statuses.values() or "queued" in statuses.values(), statuses

            deadline = time.monotonic() + 60
            for thread in threads:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
            stuck = {
                f.job_id: (len(f.seen), f.errors, http.get(f"/v1/jobs/{f.job_id}").json())
                for f in followers
                if f.final is None
            }
            assert not stuck, f"streams that did not end: {stuck}\nworker: {worker.log.read_text()[-4000:]}"
            assert api.app.state.inflightq.dispatcher.client.hub.connections <= 3  # still one per node
            after = http.post("/v1/jobs", json=short).json()["id"]
            jobs = {j: wait_done(http, j) for j in [*job_ids, *accepted, after]}
    finally:
        for thread in threads:
            thread.join(timeout=1)
        worker_alive = worker.proc.poll() is None
        worker.stop()

    log = worker.log.read_text()
    assert worker_alive, f"the worker died instead of reconnecting: {log[-3000:]}"
    assert "dropping a round trip" not in log and "unexpected error" not in log, log[-3000:]
    assert all(job["status"] == "done" for job in jobs.values()), {j: job["status"] for j, job in jobs.items()}
    assert refused == [] or set(refused) <= {429, 503}, refused
    for follower in followers:
        indexes = [index for index, _ in follower.seen]
        assert indexes == list(range(JOB_TOKENS)), f"{follower.job_id}: gaps or repeats ({follower.errors})"
        assert [token for _, token in follower.seen] == jobs[follower.job_id]["result"]["token_ids"]
        assert follower.final is not None
        assert follower.final["generated_text"] == jobs[follower.job_id]["result"]["generated_text"]
        assert follower.connections >= 2  # each client came back once with Last-Event-ID
    # The settings name the first node, which may be the one killed: ask a live one (the API and
    # the worker found the rest of the Cluster while it was up).
    live = cluster.live_nodes()[0].url
    r = connect(settings.model_copy(update={"redis_url": live}), decode_responses=True)
    try:
        assert all(r.hget(keys.request(j), "status") == "done" for j in on_victim)
    finally:
        r.close()


def job_status(http: httpx.Client, job_id: str, timeout: float = 15) -> str:
    """The job's status, asked again while the API answers 503: right after a failover its cluster client
    may still be finding the promoted master, and says so with a 503 (a client retries those)."""
    deadline = time.monotonic() + timeout
    while True:
        response = http.get(f"/v1/jobs/{job_id}")
        if response.status_code != 503 or time.monotonic() > deadline:
            assert response.status_code == 200, f"{job_id}: {response.status_code} {response.text}"
            return response.json()["status"]
        time.sleep(0.1)


def wait_done(http: httpx.Client, job_id: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        response = http.get(f"/v1/jobs/{job_id}")
        job = response.json()
        if response.status_code == 503 and time.monotonic() <= deadline:  # see job_status
            time.sleep(0.1)
            continue
        if job["status"] in ("done", "error", "cancelled", "expired") or time.monotonic() > deadline:
            return job
        time.sleep(0.1)
