"""``inflightq up``: one command that runs the whole service on one machine.

Starts a private Redis when none answers, then the API, worker and batch-worker processes as children;
prints "ready" only once the API's /health answers 200 with a live worker, and stops them all when any
one exits or on Ctrl-C / SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

from inflightq_cli.redis_server import PrivateRedis, ensure_redis
from shared.keys import Keys
from shared.settings import Settings

# Worker i serves Prometheus metrics on DEFAULT_METRICS_PORT + i, as in docker-compose.yml
# (deploy/prometheus/prometheus-local.yml scrapes these from Prometheus on the same machine).
DEFAULT_METRICS_PORT = 9100
PROGRESS_EVERY_S = 10.0


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


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def metrics_ports(first: int, workers: int) -> list[int]:
    """``first``, ``first + 1``, ... for the workers; a port already taken (another deployment) or 0 gets a
    free one instead, so a second stack on the machine still starts (and says which ports it took)."""
    from inflightq_cli.redis_server import free_port

    ports: list[int] = []
    for i in range(workers):
        wanted = first + i if first else 0
        ports.append(wanted if wanted and port_is_free(wanted) else free_port())
    return ports


def cli_hint() -> str:
    """How this shell reaches the ``inflightq`` command that is running now."""
    script = os.path.join(os.path.dirname(sys.executable), "inflightq")
    if shutil.which("inflightq") == script:
        return "inflightq status"
    if os.path.exists(script):
        venv = os.path.dirname(os.path.dirname(script))
        return f"{script} status   (or: . {venv}/bin/activate, then inflightq status)"
    return f"{sys.executable} -m inflightq_cli status"


def redis_line(settings: Settings, redis_url: str, private: PrivateRedis | None) -> str:
    if private is None:
        return f"external, at {redis_url} (keys under {Keys.for_prefix(settings.key_prefix).described()})"
    return (
        f"private, on 127.0.0.1:{private.port} ({private.binary}); in memory only, nothing saved: its data dir "
        f"{private.workdir} is deleted when this stops (set INFLIGHTQ_REDIS_URL to keep data in your own Redis)"
    )


def wait_until_ready(
    base: str, model: str, workers: int, children: list[subprocess.Popen[bytes]], stopping: list[bool]
) -> bool:
    """True once /health is 200 with ``workers`` live workers for ``model``; False if a child exits or we stop."""
    started = last_note = time.monotonic()
    what = "the API to start"
    while not stopping[0]:
        if any(c.poll() is not None for c in children):
            return False
        try:
            response = httpx.get(base + "/health", timeout=2)
            live = response.json().get("workers", {}).get(model, 0) if response.status_code == 200 else 0
            if response.status_code == 200 and live >= workers:
                return True
            what = f"{workers - live} worker(s) to load {model}" if response.status_code == 200 else "Redis"
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() - last_note >= PROGRESS_EVERY_S:
            print(f"inflightq: waiting for {what} ({time.monotonic() - started:.0f} s)", flush=True)
            last_note = time.monotonic()
        time.sleep(0.5)
    return False


def ready_banner(
    settings: Settings,
    *,
    base: str,
    redis_url: str,
    private: PrivateRedis | None,
    workers: int,
    ports: list[int],
    took_s: float,
) -> str:
    shown_ports = ", ".join(f":{p}" for p in ports)
    return "\n".join(
        [
            f"inflightq: ready in {took_s:.0f} s",
            f"  API:       {base}   (docs {base}/docs, health {base}/health, metrics {base}/metrics)",
            f"  Redis:     {redis_line(settings, redis_url, private)}",
            f"  workers:   {workers} x {settings.model}, Prometheus metrics on {shown_ports}",
            f"  CLI:       {cli_hint()}",
            "  try:",
            f"    curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\",
            f'      -d \'{{"model": "{settings.model}", '
            '"messages": [{"role": "user", "content": "Name the capital of France."}]}\'',
            "  stop:      Ctrl-C here (or kill -TERM " + str(os.getpid()) + "); then `inflightq purge --yes` deletes "
            "this deployment's keys from Redis",
        ]
    )


def run_stack(
    settings: Settings,
    *,
    workers: int = 1,
    batch_workers: int = 1,
    host: str | None = None,
    port: int | None = None,
    metrics_port: int | None = None,
) -> int:
    began = time.monotonic()
    redis_url, private = ensure_redis(settings.redis_url)
    if private is not None:
        print(f"inflightq: no Redis at {settings.redis_url}; started a private one at {redis_url}", flush=True)
    else:
        print(f"inflightq: using the Redis at {redis_url}", flush=True)
    env = {**os.environ, "INFLIGHTQ_REDIS_URL": redis_url}
    host = host or settings.api_host
    port = port or settings.api_port
    first = metrics_port if metrics_port is not None else (settings.metrics_port or DEFAULT_METRICS_PORT)
    ports = metrics_ports(first, workers)
    children = [_spawn(["api", "--host", host, "--port", str(port)], env)]
    children += [
        _spawn(
            ["worker", "--name", f"{os.uname().nodename}-{i}", "--metrics-port", str(ports[i])],
            worker_env(env, workers),
        )
        for i in range(workers)
    ]
    children += [_spawn(["batch-worker"], env) for _ in range(batch_workers)]
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"http://{shown_host}:{port}"
    print(
        f"inflightq: starting the API on {base} and {workers} worker(s) for {settings.model}"
        " (loading the model takes 5-30 s; the first start on a machine compiles a kernel too)",
        flush=True,
    )
    stopping = [False]

    def _stop(signum: int, _frame: object) -> None:
        stopping[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    code = 0
    try:
        if wait_until_ready(base, settings.model, workers, children, stopping):
            took = time.monotonic() - began
            banner = ready_banner(
                settings, base=base, redis_url=redis_url, private=private, workers=workers, ports=ports, took_s=took
            )
            print(banner, flush=True)
        while not stopping[0]:
            exited = [c for c in children if c.poll() is not None]
            if exited:
                code = exited[0].returncode or 1
                print(f"inflightq: a child process exited with {exited[0].returncode}; stopping", flush=True)
                break
            time.sleep(0.5)
    finally:
        if stopping[0]:
            print("inflightq: stopping (workers finish what they run, up to INFLIGHTQ_DRAIN_TIMEOUT_S)", flush=True)
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
