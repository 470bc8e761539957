"""``inflightq up``: one command that runs the whole service on one machine.

Starts a private Redis when none answers, then the API, worker and batch-worker processes as children,
and stops them all when any one exits or on Ctrl-C / SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from inflightq_cli.redis_server import ensure_redis
from shared.settings import Settings


def _spawn(args: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "inflightq_cli", *args], env=env)


def threads_per_worker(workers: int) -> int:
    """Each local worker's share of the cores this process may use (at least one)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, workers))


def worker_env(env: dict[str, str], workers: int) -> dict[str, str]:
    """``env`` for one of ``workers`` local workers: its share of the cores unless the operator set
    one, and its share of the memory for KV caches (``workers_per_host``)."""
    env = {**env}
    if workers > 1 and not env.get("INFLIGHTQ_TORCH_THREADS"):
        env["INFLIGHTQ_TORCH_THREADS"] = str(threads_per_worker(workers))
    if workers > 1 and not env.get("INFLIGHTQ_WORKERS_PER_HOST"):
        env["INFLIGHTQ_WORKERS_PER_HOST"] = str(workers)
    return env


def run_stack(
    settings: Settings, *, workers: int = 1, batch_workers: int = 1, host: str | None = None, port: int | None = None
) -> int:
    redis_url, private = ensure_redis(settings.redis_url)
    if private is not None:
        print(f"inflightq: no Redis at {settings.redis_url}; started a private one at {redis_url}", flush=True)
    env = {**os.environ, "INFLIGHTQ_REDIS_URL": redis_url}
    host = host or settings.api_host
    port = port or settings.api_port
    children = [_spawn(["api", "--host", host, "--port", str(port)], env)]
    children += [
        _spawn(["worker", "--name", f"{os.uname().nodename}-{i}"], worker_env(env, workers)) for i in range(workers)
    ]
    children += [_spawn(["batch-worker"], env) for _ in range(batch_workers)]
    print(
        f"inflightq: API on http://{host}:{port} (docs at /docs), {workers} worker(s) for {settings.model}.\n"
        "First request (the worker needs a few seconds to load the model):\n"
        f"  curl -N http://{host}:{port}/generate_stream -H 'Content-Type: application/json' \\\n"
        '    -d \'{"inputs": "What is the capital of France?", "parameters": {"max_new_tokens": 32}}\'\n'
        f"  curl http://{host}:{port}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{settings.model}", "messages": [{{"role": "user", "content": "Hi!"}}]}}\'',
        flush=True,
    )
    stopping = False

    def _stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    code = 0
    try:
        while not stopping:
            exited = [c for c in children if c.poll() is not None]
            if exited:
                code = exited[0].returncode or 1
                print(f"inflightq: a child process exited with {exited[0].returncode}; stopping", flush=True)
                break
            time.sleep(0.5)
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + settings.drain_timeout_s + 5
        for child in children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
        if private is not None:
            private.stop()
    return code
