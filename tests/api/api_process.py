"""The API as its own OS process (``python -m inflightq_cli api``), for the durability tests that
kill it and start another: whatever the first kept in its memory dies with it, as in a real
restart (an API thread inside the test process would share its modules with the next one)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from inflightq_cli.redis_server import free_port
from shared.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that gives a process ``settings`` (the fields set explicitly; the rest default)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFLIGHTQ_")}
    for name in settings.model_fields_set:
        value = getattr(settings, name)
        if value is not None:
            text = json.dumps(value) if isinstance(value, list | dict) else str(value)
            env[f"INFLIGHTQ_{name.upper()}"] = text
    return env


class ApiProcess:
    def __init__(self, settings: Settings, log: Path) -> None:
        self.settings = settings
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "inflightq_cli", "api", "--host", "127.0.0.1", "--port", str(self.port)],
                cwd=REPO,
                env={**settings_env(settings), "PYTHONUNBUFFERED": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout: float = 120) -> ApiProcess:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the API process did not come up:\n{self.tail()}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL: no shutdown runs, nothing it held in memory survives."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)  # type: ignore[arg-type]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


SpawnApi = Callable[..., ApiProcess]


@pytest.fixture
def spawn_api(tmp_path: Path) -> Iterator[SpawnApi]:
    """Starts an API process, ready when returned unless ``ready=False`` (it starts beside the test; call
    its ``wait_ready`` before use). Every one still alive is killed when the test ends."""
    started: list[ApiProcess] = []

    def spawn(settings: Settings, *, ready: bool = True) -> ApiProcess:
        api = ApiProcess(settings, tmp_path / f"api-{len(started)}.log")
        started.append(api)
        return api.wait_ready() if ready else api

    yield spawn
    for api in started:
        api.kill()
        print(f"--- log of API process on port {api.port} ---\n{api.tail()}")  # shown when the test failed
