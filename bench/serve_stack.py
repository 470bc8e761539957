"""The stack under test, started as the real thing: ``inflightq api`` and ``inflightq worker``
subprocesses on a free port, under a key prefix of their own, on the given Redis.

Each benchmark run presents its own API key. The API hands a key's id to the worker as the tenant,
and the engine salts prefix-cache hashes by tenant, so no run reuses KV blocks another run left
in the cache (the same prompts are sent many times)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
import redis

from inflightq_cli.redis_server import free_port
from inflightq_cli.supervisor import worker_env
from shared.keys import Keys
from shared.settings import Settings

T = TypeVar("T")


@dataclass
class Stack:
    settings: Settings  # redis_url, key_prefix, model and engine sizes the children get
    api_keys: list[str]
    port: int = field(default_factory=free_port)
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="inflightq-bench-serve-")))
    api: subprocess.Popen[bytes] | None = None
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    worker_metrics: bool = False  # each worker serves Prometheus metrics on a free port (``metrics_urls``)
    metrics_urls: list[str] = field(default_factory=list)
    # Where the children run: ``python -m`` imports from its working directory first, so another
    # checkout (a worktree of an older commit) runs that code under this harness. None: here.
    cwd: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)  # more INFLIGHTQ_* settings for every child

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        s = self.settings
        env = {
            "INFLIGHTQ_REDIS_URL": s.redis_url,
            "INFLIGHTQ_REDIS_CLUSTER": "true" if s.redis_cluster else "false",
            "INFLIGHTQ_KEY_PREFIX": s.key_prefix,
            "INFLIGHTQ_MODEL": s.model,
            "INFLIGHTQ_DTYPE": s.dtype,
            "INFLIGHTQ_MAX_NUM_SEQS": str(s.max_num_seqs),
            "INFLIGHTQ_MAX_NUM_BATCHED_TOKENS": str(s.max_num_batched_tokens),
            "INFLIGHTQ_MAX_PREFILL_TOKENS_BESIDE_DECODES": str(s.max_prefill_tokens_beside_decodes),
            "INFLIGHTQ_BLOCK_SIZE": str(s.block_size),
            "INFLIGHTQ_MAX_QUEUE_DEPTH": str(s.max_queue_depth),
            "INFLIGHTQ_API_KEYS": ",".join(self.api_keys),
        }
        if s.num_kv_blocks is not None:
            env["INFLIGHTQ_NUM_KV_BLOCKS"] = str(s.num_kv_blocks)
        return {**os.environ, **env, **self.extra_env}

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("wb")
        return subprocess.Popen(
            [sys.executable, "-m", "inflightq_cli", *args], env=env or self._env(), cwd=self.cwd, stdout=log, stderr=log
        )

    def start(self, workers: int = 1, timeout: float = 300.0) -> Stack:
        self.api = self._spawn(
            "api", ["api", "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        )
        if workers == 1:
            self.add_worker(timeout=timeout)
        else:  # each with its share of the cores: N workers of all cores each would oversubscribe them
            self.restart_workers(workers, timeout)
        return self

    def _worker_args(self, name: str) -> list[str]:
        args = ["worker", "--name", name]
        if self.worker_metrics:
            port = free_port()
            self.metrics_urls.append(f"http://127.0.0.1:{port}/metrics")
            args += ["--metrics-port", str(port)]
        return args

    def add_worker(self, timeout: float = 300.0) -> None:
        name = f"bench-worker-{len(self.workers)}"
        self.workers.append(self._spawn(name, self._worker_args(name)))
        self.wait_ready(len(self.workers), timeout)

    def restart_workers(self, count: int, timeout: float = 300.0) -> None:
        """Replaces the workers by ``count`` fresh ones, each with its share of the cores, as
        ``inflightq up --workers N`` starts them (so the comparison is not one of oversubscription)."""
        self._stop_children(self.workers)
        self.workers, self.metrics_urls = [], []
        for i in range(count):
            name = f"bench-worker-{count}x-{i}"
            self.workers.append(self._spawn(name, self._worker_args(name), worker_env(self._env(), count)))
        self.wait_ready(count, timeout)

    def wait_ready(self, workers: int, timeout: float) -> None:
        """Until /health answers and counts ``workers`` live workers for the model."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for child in [self.api, *self.workers]:
                if child is not None and child.poll() is not None:
                    raise RuntimeError(f"a stack process exited with {child.returncode}; logs in {self.logs}")
            try:
                health = httpx.get(f"{self.base_url}/health", timeout=2).json()
                if health.get("workers", {}).get(self.settings.model, 0) >= workers:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the stack was not ready with {workers} worker(s) in {timeout:.0f}s; logs in {self.logs}")

    def stop(self) -> None:
        self._stop_children([c for c in [*self.workers, self.api] if c is not None])
        self.workers, self.api, self.metrics_urls = [], None, []
        delete_prefix(self.settings)

    @staticmethod
    def _stop_children(children: list[subprocess.Popen[bytes]]) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 40
        for child in children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def delete_prefix(settings: Settings) -> None:
    """Deletes this benchmark's keys, and only those (the Redis may be shared)."""
    client = redis.Redis.from_url(settings.redis_url)
    try:
        for key in client.scan_iter(match=Keys.for_prefix(settings.key_prefix).pattern(), count=1000):
            client.delete(key)
    finally:
        client.close()


def _ancestors(pid: int) -> set[int]:
    found = set()
    while pid > 1:
        found.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return found


def other_benchmarks(own: set[int]) -> list[str]:
    """Command lines of other running benchmarks (``pgrep -af bench``, less this process's family):
    on a shared machine a measurement taken beside one is worthless."""
    mine = own | _ancestors(os.getpid())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if "bench" in cmdline and "bench-worker" not in cmdline:
            found.append(f"{entry.name} {cmdline[:160]}")
    return found


def wait_for_quiet(own: set[int], max_wait_s: float) -> list[str]:
    """Waits (up to ``max_wait_s``) until no other benchmark runs; returns what still ran, if anything."""
    deadline = time.monotonic() + max_wait_s
    while (others := other_benchmarks(own)) and time.monotonic() < deadline:
        print(f"waiting: another benchmark runs: {others[0]}", flush=True)
        time.sleep(10)
    return others


class ContentionWatch:
    """Samples the process table while a measurement runs, to tell whether another benchmark ran beside it."""

    def __init__(self, own: set[int], every_s: float = 2.0) -> None:
        self.own, self.every_s = own, every_s
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            self.seen += [c for c in other_benchmarks(self.own) if c not in self.seen]

    def __enter__(self) -> ContentionWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Quiet:
    """How a measurement keeps clear of other benchmarks: ``own`` process ids are not others."""

    own: set[int] = field(default_factory=set)
    max_wait_s: float = 300.0
    retries: int = 1

    def with_own(self, own: set[int]) -> Quiet:
        return Quiet(own, self.max_wait_s, self.retries)


def measure(fn: Callable[[int], T], quiet: Quiet | None, label: str) -> tuple[T, list[str]]:
    """``fn(attempt)`` on a quiet machine: waits (up to ``max_wait_s``) for other benchmarks to end,
    and measures again (up to ``retries`` times) when one ran alongside. Returns the result and what
    ran beside its last attempt. ``quiet`` None: measure once, watch nothing."""
    attempt = 0
    while True:
        if quiet is None:
            return fn(attempt), []
        wait_for_quiet(quiet.own, max_wait_s=quiet.max_wait_s)
        with ContentionWatch(quiet.own) as watch:
            out = fn(attempt)
        if not watch.seen or attempt >= quiet.retries:
            return out, watch.seen
        print(f"{label}: another benchmark ran alongside ({watch.seen[0]}); measuring again", flush=True)
        attempt += 1


def quiet_policy(args: argparse.Namespace) -> Quiet | None:
    return None if args.no_wait else Quiet(max_wait_s=args.max_wait, retries=args.retries)
