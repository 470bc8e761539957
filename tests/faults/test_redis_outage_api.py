"""A Redis restart shorter than redis_outage_grace_s is only a pause to a streaming client: the
API resumes every open stream from its replay log at the last index it sent, so each client sees
every token once, in order. Meanwhile new requests get 503 with Retry-After at once (never a
hang), /health reports the outage and recovers as soon as Redis is back, and no stale pooled
connection answers 503 afterwards. Private Redis with an append-only file."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from inflightq_cli.redis_server import free_port
from shared.settings import Settings
from tests.api.conftest import ApiServer
from tests.api.test_end_to_end import sse_events
from tests.faults.conftest import scale
from tests.worker.test_redis_outage import persistent_redis
from tests.worker.test_worker import wait_for

OUTAGE_S = 3.0


def follow(url: str, max_new_tokens: int, seen: list[dict], errors: list[str]) -> None:
    body = {"inputs": "Go", "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    try:
        with (
            httpx.Client(base_url=url, timeout=120) as http,
            http.stream("POST", "/generate_stream", json=body) as response,
        ):
            if response.status_code != 200:
                errors.append(f"{response.status_code} {response.read()[:200]!r}")
                return
            for _, data in sse_events(response):
                event = json.loads(data)
                if "error" in event:
                    errors.append(event["error"])
                else:
                    seen.append(event)
    except Exception as error:  # the stream broke: that is what this test forbids
        errors.append(repr(error))


def test_a_short_redis_restart_is_only_a_pause_for_streams(
    spawn_worker, settings: Settings, start_api: Callable[[Settings], ApiServer], tmp_path: Path
) -> None:
    streams, n = scale(10, 50), scale(200, 400)
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    api_settings = settings.model_copy(
        update={"redis_url": url, "heartbeat_ttl_s": 3, "no_worker_wait_s": 60, "max_new_tokens": 2000}
    )
    first = persistent_redis(port, tmp_path)
    redis_process = first.__enter__()
    second = None
    try:
        spawn_worker("steady", url=url, env={"INFLIGHTQ_MAX_NUM_SEQS": str(max(64, streams))})
        api = start_api(api_settings)
        seen: list[list[dict]] = [[] for _ in range(streams)]
        errors: list[list[str]] = [[] for _ in range(streams)]
        threads = [threading.Thread(target=follow, args=(api.url, n, seen[i], errors[i])) for i in range(streams)]
        for thread in threads:
            thread.start()
        wait_for(lambda: all(len(s) >= 5 for s in seen), timeout=120)
        assert all(len(s) < n for s in seen), "every stream must still be open when Redis goes away"

        redis_process.terminate()  # a clean shutdown: the append-only file keeps everything
        redis_process.wait(timeout=10)
        down_at = time.monotonic()
        with api.client() as http:
            asked = time.monotonic()
            refused = http.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
            refuse_s = time.monotonic() - asked
            health = http.get("/health")
            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))
            second = persistent_redis(port, tmp_path)
            second.__enter__()
            back_at = time.monotonic()
            wait_for(lambda: http.get("/health").status_code == 200, timeout=30, every=0.05)
            health_back_s = time.monotonic() - back_at
        assert refused.status_code == 503 and refused.headers.get("retry-after"), refused.text
        assert refuse_s < 3.0, f"a request during the outage waited {refuse_s:.1f} s for its 503"
        assert health.status_code == 503 and health.json()["redis"] is False

        for thread in threads:
            thread.join(timeout=300)
        for i in range(streams):
            assert errors[i] == [], f"stream {i} saw errors: {errors[i]}"
            assert [e["index"] for e in seen[i]] == list(range(n)), f"stream {i}: a gap or a duplicate"
            assert seen[i][-1]["generated_text"] is not None

        # No stale pooled connection: everything answers at once.
        with api.client() as http:
            answers = [http.get("/health").status_code for _ in range(40)]
            answers += [http.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).status_code]
        assert set(answers) == {200}, answers
        print(
            f"FAULTS redis restart: {streams} streams x {n} tokens, outage {OUTAGE_S:.0f} s, lost 0, duplicated 0, "
            f"errors 0; 503 during it in {refuse_s:.2f} s; /health back {health_back_s:.2f} s after Redis"
        )
    finally:
        if second is not None:
            second.__exit__(None, None, None)
        first.__exit__(None, None, None)
