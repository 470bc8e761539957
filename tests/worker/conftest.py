"""Real worker processes (``python -m inflightq_cli worker``) on the tiny model in float64,
against a real Redis, each test under its own key prefix. Every process a test starts is
killed when it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shared.client import QueueClient
from shared.schemas import SamplingSpec
from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
# Short recovery times keep takeover tests quick; live workers refresh every third of this.
# Not shorter: on two shared cores a loaded worker's refresh thread can stall for a second.
RECLAIM_AFTER_S = 3.0
# The recovery settings an operator gets by default, for the tests that measure them (worker_env
# shortens both for the others).
DEFAULT_RECOVERY = {
    "INFLIGHTQ_RECLAIM_AFTER_S": str(Settings().reclaim_after_s),
    "INFLIGHTQ_HEARTBEAT_TTL_S": str(Settings().heartbeat_ttl_s),
}
# The suite's own short ones, for a test that measures both.
TUNED_RECOVERY = {"INFLIGHTQ_RECLAIM_AFTER_S": str(RECLAIM_AFTER_S), "INFLIGHTQ_HEARTBEAT_TTL_S": "3"}
# INFLIGHTQ_FAULTS_AT_DEFAULTS=1: every worker keeps the defaults and the default drain timeout, for the
# defaults column of docs/reliability.md's fault table.
AT_DEFAULTS = os.environ.get("INFLIGHTQ_FAULTS_AT_DEFAULTS") == "1"


@dataclass
class WorkerProcess:
    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    entry: list[str] = field(default_factory=lambda: ["-m", "inflightq_cli"])  # or a script wrapping the CLI
    process: subprocess.Popen[bytes] | None = None
    _log: object = field(default=None, repr=False)

    def start(self) -> WorkerProcess:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, *self.entry, "worker", "--name", self.name, *self.args],
            env=self.env,
            cwd=ROOT,
            stdout=self._log,  # type: ignore[arg-type]
            stderr=subprocess.STDOUT,
        )
        return self

    def wait_ready(self, client: QueueClient, timeout: float = 240.0) -> WorkerProcess:
        # Generous: loading the default model on a starved 2-core machine took over 60 s; a worker
        # that dies early fails at once anyway (poll below), so only a hung start waits it out.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(w.name == self.name for w in client.live_workers()):
                return self
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"worker {self.name} exited early:\n{self.log()}")
            time.sleep(0.1)
        raise AssertionError(f"worker {self.name} never sent a heartbeat:\n{self.log()}")

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


SpawnWorker = Callable[..., WorkerProcess]


@pytest.fixture
def worker_env(settings: Settings) -> dict[str, str]:
    env = {
        **os.environ,
        "INFLIGHTQ_REDIS_URL": settings.redis_url,
        "INFLIGHTQ_REDIS_CLUSTER": "true" if settings.redis_cluster else "false",
        "INFLIGHTQ_KEY_PREFIX": settings.key_prefix,
        **TUNED_RECOVERY,
        "INFLIGHTQ_DRAIN_TIMEOUT_S": "20",
        # Two shared cores: one intra-op thread per worker keeps several workers from thrashing.
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if AT_DEFAULTS:
        env |= {**DEFAULT_RECOVERY, "INFLIGHTQ_DRAIN_TIMEOUT_S": str(Settings().drain_timeout_s)}
    return env


@pytest.fixture
def spawn_worker(
    worker_env: dict[str, str], tiny_model_dir: Path, tmp_path: Path, settings: Settings
) -> Iterator[SpawnWorker]:
    started: list[WorkerProcess] = []

    def spawn(
        name: str,
        *args: str,
        env: dict[str, str] | None = None,
        ready: bool = True,
        url: str | None = None,
        script: Path | None = None,
    ) -> WorkerProcess:
        full_env = {**worker_env, **(env or {})}
        if url is not None:
            full_env["INFLIGHTQ_REDIS_URL"] = url
        base = ["--model", str(tiny_model_dir), "--dtype", "float64", "--device", "cpu", "--num-kv-blocks", "256"]
        worker = WorkerProcess(name, [*base, *args], full_env, tmp_path / f"{name}.log")
        if script is not None:
            worker.entry = [str(script)]
        worker.start()
        started.append(worker)
        if ready:
            client_settings = settings.model_copy(update={"redis_url": full_env["INFLIGHTQ_REDIS_URL"]})
            with QueueClient(client_settings) as client:
                worker.wait_ready(client)
        return worker

    yield spawn
    for worker in started:
        if worker.process is not None and worker.process.poll() is None:
            worker.signal(signal.SIGKILL)
        worker.stop()
        # Shown by pytest only when the test failed.
        print(f"--- log of worker {worker.name} ---\n{worker.log()}")


@pytest.fixture
def client(settings: Settings) -> Iterator[QueueClient]:
    with QueueClient(settings) as queue:
        yield queue


@pytest.fixture(scope="session")
def reference(tiny_model_dir: Path) -> Callable[[list[int], int], list[int]]:
    """Greedy tokens of an uninterrupted run of the same engine, in this process."""
    import torch

    from worker.engine import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float64", device="cpu", num_kv_blocks=256)
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def generate(prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in cache:
            params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
            # Like the workers (OMP_NUM_THREADS=1): on two shared cores a second intra-op thread
            # makes every step several times slower; float64 greedy output does not depend on it.
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                cache[key] = llm.generate([prompt], params)[0].token_ids
            finally:
                torch.set_num_threads(threads)
        return cache[key]

    return generate


def greedy(max_new_tokens: int) -> SamplingSpec:
    # ignore_eos: every request runs its full length, so timings and comparisons are predictable.
    return SamplingSpec(max_new_tokens=max_new_tokens, ignore_eos=True)
