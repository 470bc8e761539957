"""The whole batch path, for real: an API process, a queue worker on the tiny model, and an RQ
batch worker, all on the test Redis under one key prefix per test module."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from producer_api.batches.store import BatchObject, BatchStore
from shared.client import QueueClient
from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


class Proc:
    """A child process in its own session, so stopping it also stops what it forked (RQ's work horse)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.args = args
        self.env = env
        self.log = log
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        out = self.log.open("ab")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "inflightq_cli", *self.args],
            cwd=ROOT,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash: no cleanup runs."""
        if self.popen and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if not self.popen or self.popen.poll() is not None:
            return
        os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def stack_settings(redis_url: str, run_prefix: str, tiny_model_dir: Path) -> Settings:
    # Under the run prefix, so the session's cleanup deletes these keys too.
    return Settings(
        redis_url=redis_url,
        key_prefix=f"{run_prefix}-batch-{uuid.uuid4().hex[:6]}",
        model=str(tiny_model_dir),
        result_ttl_s=900,
        max_num_seqs=4,
        api_port=_free_port(),
        dtype="float64",
        device="cpu",
    )


@pytest.fixture(scope="module")
def stack_env(stack_settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFLIGHTQ_")}
    for name in ("redis_url", "key_prefix", "model", "result_ttl_s", "max_num_seqs", "api_port", "dtype", "device"):
        env[f"INFLIGHTQ_{name.upper()}"] = str(getattr(stack_settings, name))
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batch-logs")


@pytest.fixture(scope="module")
def api_url(stack_settings: Settings, stack_env: dict[str, str], logs: Path) -> Iterator[str]:
    proc = Proc(["api", "--host", "127.0.0.1", "--port", str(stack_settings.api_port)], stack_env, logs / "api.log")
    proc.start()
    url = f"http://127.0.0.1:{stack_settings.api_port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or (proc.popen and proc.popen.poll() is not None):
                pytest.fail("the API did not come up:\n" + proc.tail())
            time.sleep(0.3)
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def queue_worker(stack_settings: Settings, stack_env: dict[str, str], logs: Path) -> Iterator[Proc]:
    proc = Proc(
        ["worker", "--model", stack_settings.model, "--dtype", "float64"], stack_env, logs / "worker.log"
    ).start()
    client = QueueClient(stack_settings)
    try:
        deadline = time.monotonic() + 120
        while not client.live_workers():
            if time.monotonic() > deadline or (proc.popen and proc.popen.poll() is not None):
                pytest.fail("the queue worker did not come up:\n" + proc.tail())
            time.sleep(0.3)
        yield proc
    finally:
        client.close()
        proc.stop()


@pytest.fixture(scope="module")
def batch_worker_factory(
    stack_settings: Settings, stack_env: dict[str, str], logs: Path
) -> Iterator[Callable[[], Proc]]:
    started: list[Proc] = []

    def start() -> Proc:
        proc = Proc(["batch-worker", "--recover-every", "1"], stack_env, logs / f"batch-worker-{len(started)}.log")
        started.append(proc.start())
        return proc

    yield start
    for proc in started:
        proc.stop()
    # RQ's keys live under the run's prefix (tests/conftest.py sets RQ_KEY_PREFIX): the run's cleanup takes them.


@pytest.fixture(scope="module")
def batch_worker(batch_worker_factory: Callable[[], Proc]) -> Proc:
    return batch_worker_factory()


@pytest.fixture
def store(stack_settings: Settings) -> Iterator[BatchStore]:
    client = redis.Redis.from_url(stack_settings.redis_url)
    yield BatchStore(stack_settings, client)
    client.close()


def chat_line(custom_id: str, model: str, content: str, max_tokens: int = 8, **extra: Any) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def wait_for(
    store: BatchStore, batch_id: str, done: Callable[[BatchObject], bool], timeout: float = 120
) -> BatchObject:
    deadline = time.monotonic() + timeout
    while True:
        batch = store.get(batch_id)
        if done(batch):
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch never reached the expected state: {batch.model_dump_json()}")
        time.sleep(0.05)


def jsonl(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]
