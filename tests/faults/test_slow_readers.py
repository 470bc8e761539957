"""A client that stops reading a multi-choice stream cannot grow the API's memory: its events
wait in a bounded buffer (stream_buffer_events), past which it is dropped with a slow_reader
error; clients reading at the same time are unaffected."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import httpx

from shared.settings import Settings
from tests.api.conftest import ApiServer
from tests.api.test_end_to_end import sse_events
from tests.faults.conftest import scale
from tests.worker.test_worker import wait_for

BUFFER = 64


def open_unread_stream(port: int, body: dict) -> socket.socket:
    """Sends the request and reads nothing: a tiny receive window, so the API's writes stall."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


def read_all(sock: socket.socket, timeout: float = 120) -> bytes:
    sock.settimeout(timeout)
    chunks = []
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        if b"[DONE]" in chunk or b"slow_reader" in b"".join(chunks[-2:]):
            break
    return b"".join(chunks)


def test_a_slow_reader_is_dropped_and_others_are_unaffected(
    spawn_worker, client, settings: Settings, start_api: Callable[[Settings], ApiServer], tmp_path: Path
) -> None:
    slow_readers = scale(2, 5)
    api = start_api(
        settings.model_copy(
            update={
                "stream_buffer_events": BUFFER,
                "no_worker_wait_s": 60,
                "max_new_tokens": 2000,
                "heartbeat_ttl_s": 3,
            }
        )
    )
    spawn_worker("busy", env={"INFLIGHTQ_MAX_NUM_SEQS": "64"})
    heavy = {
        "model": settings.model,
        "messages": [{"role": "user", "content": "Go"}],
        "stream": True,
        "n": 4,
        "logprobs": True,
        "top_logprobs": 20,
        "max_completion_tokens": 1000,
        "ignore_eos": True,
    }
    slow = [open_unread_stream(api.port, heavy) for _ in range(slow_readers)]
    try:
        # Meanwhile, well-behaved clients of the same kind of stream get everything.
        fine: list[int] = []

        def read_normally() -> None:
            body = {**heavy, "max_completion_tokens": 100}
            with (
                httpx.Client(base_url=api.url, timeout=300) as http,
                http.stream("POST", "/v1/chat/completions", json=body) as response,
            ):
                datas = [data for _, data in sse_events(response)]
            assert datas[-1] == "[DONE]", datas[-3:]
            chunks = [json.loads(d) for d in datas[:-1]]
            assert not any("error" in c for c in chunks)
            fine.append(sum(1 for c in chunks for ch in c["choices"] if ch["delta"].get("content") is not None))

        readers = [threading.Thread(target=read_normally) for _ in range(2)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout=300)
        assert len(fine) == 2
        # The slow streams' choices run to their end meanwhile, far past what socket buffers hold.
        wait_for(lambda: sum(w.running for w in client.live_workers()) == 0, timeout=600, every=0.5)
        for sock in slow:
            received = read_all(sock)
            assert b"slow_reader" in received and b"too slowly" in received, received[-500:]
            assert b"[DONE]" not in received
    finally:
        for sock in slow:
            sock.close()
    with api.client() as http:
        assert http.get("/health").status_code == 200
    print(
        f"FAULTS slow readers: {slow_readers} never-reading n=4 streams dropped with slow_reader, 2 readers unaffected"
    )
