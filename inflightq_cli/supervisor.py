"""``inflightq up``: one command that runs the whole service on one machine.

Starts a private Redis when none answers (or when asked), then the API, worker and batch-worker
processes as children; prints "ready" only once the API's /health answers 200 with a live worker, and
stops them all when any one exits or on Ctrl-C / SIGTERM. While it runs, ``deployment.json`` says where
its Redis is, for the CLI in other shells (``inflightq_cli/deployment_file.py``)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

from inflightq_cli.deployment_file import Deployment, deployment_path, remove_deployment, write_deployment
from inflightq_cli.redis_server import PrivateRedis, ensure_redis
from shared.keys import Keys
from shared.settings import Settings

# Worker i serves Prometheus metrics on DEFAULT_METRICS_PORT + i, as in docker-compose.yml
# (deploy/prometheus/prometheus-local.yml scrapes these from Prometheus on the same machine).
DEFAULT_METRICS_PORT = 9100
PROGRESS_EVERY_S = 10.0


def _spawn(args: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "inflightq_cli", *args], env=env)


def worker_env(env: dict[str, str], workers: int) -> dict[str, str]:
    """``env`` for one of ``workers`` local workers: its share of the memory for KV caches and of the
    CPUs (``workers_per_host``). Each worker sizes its threads to its share of the CPUs it may use
    (affinity, cgroup quota) and runs fewer while the API, Redis or anything else takes some
    (worker/engine/core/cpu_threads.py); an operator's INFLIGHTQ_TORCH_THREADS fixes the count instead."""
    env = {**env}
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
        return (
            f"external, at {redacted(redis_url)} (keys under {Keys.for_prefix(settings.key_prefix).described()}): "
            "whatever server answers there, shared with whoever else uses it; this deployment writes only "
            "under its prefix (--private-redis starts a private one instead)"
        )
    return (
        f"private, on 127.0.0.1:{private.port} ({private.binary}); in memory only, nothing saved: its data dir "
        f"{private.workdir} is deleted when this stops (set INFLIGHTQ_REDIS_URL to keep data in your own Redis)"
    )


def redacted(url: str) -> str:
    """A Redis URL without its password."""
    from inflightq_cli import _redacted

    return _redacted(url)


def export_line(settings: Settings, redis_url: str) -> str:
    """The shell line that points other tools and scripts at this deployment."""
    names = {"INFLIGHTQ_REDIS_URL": redacted(redis_url), "INFLIGHTQ_KEY_PREFIX": settings.key_prefix}
    if settings.redis_cluster:
        names["INFLIGHTQ_REDIS_CLUSTER"] = "true"
    return "export " + " ".join(f"{name}={shlex.quote(value)}" for name, value in names.items())


def api_start(model: str) -> str:
    """What the API does before it answers: what the launcher says it waits for."""
    from shared.model_source import resolve

    try:
        source = resolve(model)
        from_gguf = bool(source.gguf_file) and not (source.converted_dir / "tokenizer_config.json").exists()
    except FileNotFoundError:
        from_gguf = False
    where = ", read from the GGUF file until a worker has converted it once" if from_gguf else ""
    return f"the API to start (it imports transformers and torch, then loads {model}'s tokenizer{where})"


def wait_until_ready(
    base: str, model: str, workers: int, children: list[subprocess.Popen[bytes]], stopping: list[bool]
) -> bool:
    """True once /health is 200 with ``workers`` live workers for ``model``; False if a child exits or we stop."""
    started = last_note = time.monotonic()
    what = api_start(model)
    while not stopping[0]:
        if any(c.poll() is not None for c in children):
            return False
        try:
            response = httpx.get(base + "/health", timeout=2)
            live = response.json().get("workers", {}).get(model, 0) if response.status_code == 200 else 0
            if response.status_code == 200 and live >= workers:
                return True
            ok = response.status_code == 200
            what = f"{workers - live} worker(s) to load {model}" if ok else "the API to reach Redis"
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
    before_s: float = 0.0,
) -> str:
    """``took_s``: since the start counted (the quick start's, its install included); ``before_s``:
    how much of it passed before this ``up`` began."""
    shown_ports = ", ".join(f":{p}" for p in ports)
    took = f"{took_s:.0f} s"
    if before_s >= 1:
        took += f" ({took_s - before_s:.0f} s to start the service, after {before_s:.0f} s of install)"
    return "\n".join(
        [
            f"inflightq: ready in {took}",
            f"  API:       {base}   (docs {base}/docs, health {base}/health, metrics {base}/metrics)",
            f"  Redis:     {redis_line(settings, redis_url, private)}",
            f"  workers:   {workers} x {settings.model}, Prometheus metrics on {shown_ports}",
            f"  CLI:       {cli_hint()}   (from any shell: it finds this deployment in {deployment_path()})",
            f"  env:       {export_line(settings, redis_url)}   (for other tools and scripts)",
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
    private_redis: bool = False,
    started_at: float | None = None,
) -> int:
    """``started_at``: the Unix time the ready line counts from (the quick start's, so its install
    counts); default now."""
    began = time.time()
    counted_from = min(started_at or began, began)
    redis_url, private = ensure_redis(settings.redis_url, private=private_redis)
    if private is not None:
        why = "as asked (--private-redis)" if private_redis else f"no Redis at {redacted(settings.redis_url)}"
        print(f"inflightq: {why}; started a private one at {redis_url}", flush=True)
    else:
        where = Keys.for_prefix(settings.key_prefix).described()
        print(
            f"inflightq: using the Redis that answers at {redacted(redis_url)}, whoever runs it; this deployment "
            f"writes only keys under {where} (--private-redis starts a private one instead)",
            flush=True,
        )
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
        f"inflightq: starting the API on {base} and {workers} worker(s) for {settings.model}: the API loads its"
        " tokenizer, each worker its weights (a first start on a machine also converts a GGUF model and compiles"
        " a CPU kernel)",
        flush=True,
    )
    deployment = Deployment(redis_url, settings.redis_cluster, settings.key_prefix, base, os.getpid())
    stopping = [False]

    def _stop(signum: int, _frame: object) -> None:
        stopping[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    code = 0
    try:
        write_deployment(deployment)
        if wait_until_ready(base, settings.model, workers, children, stopping):
            banner = ready_banner(
                settings,
                base=base,
                redis_url=redis_url,
                private=private,
                workers=workers,
                ports=ports,
                took_s=time.time() - counted_from,
                before_s=began - counted_from,
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
        remove_deployment(deployment.pid)
        if private is not None:
            private.stop()
    return code
