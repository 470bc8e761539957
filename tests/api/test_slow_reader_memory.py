"""Slow readers at the DEFAULT settings: four clients stream chat with n=4, logprobs and
top_logprobs=20 and read nothing; the API process's memory levels off (stream_buffer_bytes bounds
what waits for each of them, and each is dropped with a slow_reader event), and it stays there
after they leave. The API runs as its own process, so its RSS is its own."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import redis

from shared.keys import Keys
from shared.request_lifecycle import RequestStatus
from shared.settings import Settings
from tests.api.api_process import SpawnApi, spawn_api  # noqa: F401 - the fixture
from tests.api.conftest import WorkerProcess, wait_for_workers
from tests.conftest import RedisBackend

pytestmark = pytest.mark.slow

MIB = 1024 * 1024
SLOW_READERS = 4
# Each stream's events would take tens of MiB if nothing bounded them (4 x 1,500 tokens, 20 alternatives each).
MAX_TOKENS = 1500


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def all_final(redis_url: str, prefix: str) -> bool:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        statuses = [r.hget(name, "status") for name in r.scan_iter(Keys.for_prefix(prefix).request_pattern())]
    finally:
        r.close()
    return len(statuses) > SLOW_READERS * 4 and all(RequestStatus(s).is_final for s in statuses if s)


def chat_body(max_tokens: int) -> dict[str, object]:
    return {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "stream": True,
        "n": 4,
        "logprobs": True,
        "top_logprobs": 20,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


def open_slow_reader(port: int, model: str) -> socket.socket:
    """A client that sends its request and then reads nothing (a 4 KB receive window)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({**chat_body(MAX_TOKENS), "model": model}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock


def test_slow_multi_choice_readers_leave_the_api_memory_level(
    redis_backend: RedisBackend,
    key_prefix: str,
    tiny_model_dir: Path,
    spawn_api: SpawnApi,  # noqa: F811
    tmp_path: Path,
) -> None:
    settings = Settings(
        redis_url=redis_backend.url,
        redis_cluster=redis_backend.cluster,
        key_prefix=key_prefix,
        model=str(tiny_model_dir),
    )
    worker = WorkerProcess(
        tiny_model_dir, redis_backend.url, key_prefix, tmp_path / "worker.log", cluster=redis_backend.cluster
    )
    try:
        api = spawn_api(settings)
        with api.client() as http:
            wait_for_workers(http, settings.model, 1, [worker])
            # A reader that keeps up, first: what any stream allocates once is in the baseline.
            warm = {**chat_body(64), "model": settings.model}
            with http.stream("POST", "/v1/chat/completions", json=warm) as response:
                assert response.status_code == 200
                assert "[DONE]" in "".join(response.iter_text())
        baseline = rss(api.proc.pid)
        readers = [open_slow_reader(api.port, settings.model) for _ in range(SLOW_READERS)]
        samples = [rss(api.proc.pid)]
        deadline = time.monotonic() + 180
        while not all_final(redis_backend.url, key_prefix):  # each stream cut off (its requests cancelled) or done
            assert time.monotonic() < deadline, "the slow readers' requests never ended"
            time.sleep(0.5)
            samples.append(rss(api.proc.pid))
        levelled = []
        for _ in range(20):  # 10 s more: nothing grows once they have ended
            time.sleep(0.5)
            levelled.append(rss(api.proc.pid))
        peak = max(samples + levelled)
        for sock in readers:
            sock.close()
        time.sleep(3)
        after = rss(api.proc.pid)
        print(f"RSS MiB: baseline {baseline / MIB:.0f}, peak {peak / MIB:.0f}, after {after / MIB:.0f}")
        # Unbounded, the four streams' events alone took several hundred MiB.
        assert peak - baseline < 96 * MIB, (baseline, peak)
        assert max(levelled) - min(levelled) < 8 * MIB, levelled
        assert after - baseline < 96 * MIB, (baseline, after)
        with api.client() as http:  # and the API still serves
            assert http.get("/health").status_code == 200
    finally:
        worker.stop()
