"""Lesser bounds of the API: concurrent DELETEs of one running job (exactly one cancels it),
oversized request headers (431), and how stale a heartbeat may be before /health stops
counting a worker (heartbeat_stale_s)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import httpx

from shared.settings import Settings
from tests.api.conftest import ApiServer
from tests.worker.test_worker import wait_for


def test_concurrent_deletes_cancel_once_headers_are_bounded_and_a_killed_worker_stops_counting(
    spawn_worker, settings: Settings, start_api: Callable[[Settings], ApiServer]
) -> None:
    api = start_api(settings.model_copy(update={"no_worker_wait_s": 60, "max_new_tokens": 2000}))
    worker = spawn_worker("target")
    with api.client() as http:
        job = http.post("/v1/jobs", json={"prompt": "Go", "max_new_tokens": 1500, "ignore_eos": True}).json()["id"]
        wait_for(lambda: http.get(f"/v1/jobs/{job}").json()["status"] == "running", timeout=60)
        answers: list[bool] = []
        barrier = threading.Barrier(20)

        def delete() -> None:
            with httpx.Client(base_url=api.url, timeout=30) as own:
                barrier.wait()
                answers.append(own.delete(f"/v1/jobs/{job}").json()["cancelled"])

        threads = [threading.Thread(target=delete) for _ in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert sorted(answers) == [False] * 19 + [True]
        wait_for(lambda: http.get(f"/v1/jobs/{job}").json()["status"] == "cancelled", timeout=30)

        too_big = http.get("/health", headers={"x-filler": "a" * 200_000})
        assert too_big.status_code == 431 and too_big.json()["error_type"] == "headers_too_large"
        too_many = http.get("/health", headers={f"x-h{i}": "1" for i in range(5000)})
        assert too_many.status_code == 431
        assert http.get("/health", headers={f"x-h{i}": "1" for i in range(20)}).status_code == 200

        assert http.get("/health").json()["workers"][settings.model] == 1
        worker.signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: http.get("/health").json()["workers"][settings.model] == 0, timeout=30)
        gone_s = time.monotonic() - killed
    assert gone_s <= settings.heartbeat_stale_s + 1.5, gone_s
    print(
        f"FAULTS api bounds: 20 concurrent DELETEs -> 1 cancelled:true; 431 on 200 KB / 5,000 headers; "
        f"/health stopped counting a SIGKILLed worker after {gone_s:.1f} s"
    )
