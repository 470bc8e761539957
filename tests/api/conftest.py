"""API test fixtures: an API server on a free port (uvicorn in a thread, so tests can give it any
Settings), a fake worker heartbeat for dispatch without consumption, and a real worker process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import uvicorn

from inflightq_cli.redis_server import free_port
from producer_api.app import create_app
from producer_api.tokenization import Tokenizers
from shared.keys import Keys
from shared.model_source import load_tokenizer
from shared.schemas import WorkerHeartbeat
from shared.settings import Settings
from tests.conftest import RedisBackend

REPO = Path(__file__).resolve().parents[2]


class ApiServer:
    def __init__(self, settings: Settings, tokenizer: Any) -> None:
        self.settings = settings
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        tokenizers = Tokenizers(settings, {model: tokenizer for model in settings.served_models})
        self.app = create_app(settings, tokenizers=tokenizers)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ApiServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the API server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="session")
def start_api(tiny_tokenizer: Any) -> Iterator[Callable[[Settings], ApiServer]]:
    """Starts API servers for any Settings; all are stopped at the end of the session."""
    servers: list[ApiServer] = []

    def start(settings: Settings) -> ApiServer:
        server = ApiServer(settings, tiny_tokenizer).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def start_queue_api(
    redis_backend: RedisBackend, key_prefix: str, tiny_model_dir: Path, start_api: Callable[[Settings], ApiServer]
) -> Callable[..., ApiServer]:
    """Starts an API with no worker behind it, for the test, with settings overridden by keyword: what a
    request creates stays queued, and the interactive routes do not wait for a worker."""

    def start(**overrides: Any) -> ApiServer:
        settings = Settings(
            redis_url=redis_backend.url,
            redis_cluster=redis_backend.cluster,
            key_prefix=key_prefix,
            model=str(tiny_model_dir),
            no_worker_wait_s=0,
            **overrides,
        )
        return start_api(settings)

    return start


@pytest.fixture
def keyed_api(start_queue_api: Callable[..., ApiServer]) -> ApiServer:
    """An API with two API keys, ``key-a`` and ``key-b``, and no worker."""
    return start_queue_api(api_keys=["key-a", "key-b"])


def fake_heartbeat(redis_url: str, settings: Settings, name: str = "fake-worker", *, fresh_for_s: float = 600) -> None:
    """A live worker that never consumes: dispatch finds it, the queue only grows (429 tests).
    It looks alive for about ``fresh_for_s`` beyond heartbeat_ttl_s, then as dead as a crashed worker."""
    keys = Keys.for_prefix(settings.key_prefix)
    now = time.time()
    beat = WorkerHeartbeat(
        name=name,
        model=settings.model,
        device="cpu",
        dtype="float64",
        max_num_seqs=1,
        num_kv_blocks=1,
        running=0,
        waiting=0,
        free_kv_blocks=1,
        started_at=now,
    )
    r = redis.Redis.from_url(redis_url)
    r.set(keys.worker(name), beat.model_dump_json(), ex=600)
    r.zadd(keys.workers(), {name: now + fresh_for_s})  # scored in the future: stays "fresh" that long
    r.close()


class WorkerProcess:
    def __init__(
        self,
        model_dir: Path,
        redis_url: str,
        prefix: str,
        log: Path,
        extra_env: dict[str, str] | None = None,
        script: Path | None = None,  # a script wrapping the CLI (tests/worker/paced_worker.py)
        *,
        cluster: bool = False,
    ) -> None:
        env = {
            **os.environ,
            "INFLIGHTQ_REDIS_URL": redis_url,
            "INFLIGHTQ_REDIS_CLUSTER": "true" if cluster else "false",
            "INFLIGHTQ_KEY_PREFIX": prefix,
            "INFLIGHTQ_MODEL": str(model_dir),
            "INFLIGHTQ_HEARTBEAT_TTL_S": "3",
            **(extra_env or {}),
        }
        self.log = log
        self._log_file = log.open("wb")
        entry = [str(script)] if script else ["-m", "inflightq_cli"]
        self.proc = subprocess.Popen(
            [sys.executable, *entry, "worker", "--model", str(model_dir), "--dtype", "float64"],
            cwd=REPO,
            env=env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )

    def crash(self) -> None:
        """SIGKILL: no drain, no goodbye; its request stays pending in Redis for another to take."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log_file.close()


@pytest.fixture(scope="module")
def module_prefix(run_prefix: str) -> str:
    return f"{run_prefix}-m{uuid.uuid4().hex[:6]}"


def wait_for_workers(http: httpx.Client, model: str, count: int, workers: list[WorkerProcess]) -> None:
    deadline = time.monotonic() + 120
    while http.get("/health").json()["workers"].get(model, 0) < count:
        for worker in workers:
            if worker.proc.poll() is not None:
                raise RuntimeError(f"worker exited: {worker.log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no worker heartbeat: {workers[-1].log.read_text()[-3000:]}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def live_worker_env() -> dict[str, str]:
    """The settings ``live_api``'s worker gets beside the defaults; a module may override it."""
    return {}


@pytest.fixture(scope="module")
def live_api(
    redis_backend: RedisBackend,
    module_prefix: str,
    tiny_model_dir: Path,
    start_api: Callable[[Settings], ApiServer],
    tmp_path_factory: pytest.TempPathFactory,
    live_worker_env: dict[str, str],
) -> Iterator[ApiServer]:
    """An API with one real worker (tiny model, float64, ``live_worker_env``) behind it, for the module."""
    settings = Settings(
        redis_url=redis_backend.url,
        redis_cluster=redis_backend.cluster,
        key_prefix=module_prefix,
        model=str(tiny_model_dir),
        heartbeat_ttl_s=3,
        no_worker_wait_s=60,
        max_new_tokens=2000,
        default_max_new_tokens=16,
    )
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    worker = WorkerProcess(
        tiny_model_dir, redis_backend.url, module_prefix, log, live_worker_env, cluster=redis_backend.cluster
    )
    try:
        server = start_api(settings)
        with server.client() as http:
            wait_for_workers(http, settings.model, 1, [worker])
        yield server
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def api(live_api: ApiServer) -> ApiServer:
    """The module's API with a worker; a module that needs another kind of API defines its own ``api``."""
    return live_api


@pytest.fixture(scope="module")
def oai(api: ApiServer) -> Iterator[openai.OpenAI]:
    """The real ``openai`` SDK pointed at ``api``."""
    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()
