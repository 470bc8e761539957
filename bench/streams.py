"""``inflightq bench streams``: what an open, idle-waiting stream costs the API (issue 18).

For each N (``--counts``, default 100, 1,000 and 10,000) a fresh ``inflightq api`` subprocess,
with no worker, on Redis under a key prefix of its own: N jobs are queued (``POST /v1/jobs``),
then one asyncio client process (this one, aiohttp) opens ``GET /v1/jobs/{id}/stream`` for each
and holds it. The jobs stay queued, so every stream waits on pub/sub, as a stream queued behind
a full pool does. ``INFLIGHTQ_NO_WORKER_WAIT_S`` is raised so the API does not end the streams
with 503 for want of a worker.

Measured, from outside the API:

- its Redis connections: the API process's established TCP sockets to the Redis node(s)
  (psutil), and, on each node, ``CLIENT LIST`` entries from those sockets' addresses: how many
  are pub/sub connections and how many channels they carry (which must add up to N: every
  stream really is subscribed);
- its RSS before any stream and with N open (/proc through psutil);
- its CPU seconds (user + sys) per wall second over ``--idle-s`` while the streams sit idle,
  after ``--settle-s`` so that every stream's safety-net check has backed off to its steady
  interval (QUEUED_CHECK_MAX_S, 30 s, for a queued request); and the CPU seconds the API spent
  queueing the jobs and opening the streams.

``--cluster`` (default on) repeats everything on a private 3-master Redis Cluster
(``INFLIGHTQ_REDIS_CLUSTER=true``, sharded pub/sub). ``--api-checkout DIR`` starts the API from
another checkout (a git worktree of an older commit: "before" figures) under this harness. Writes
bench/results/streams-<date>[-tag].{json,md,png}.

    python -m bench.streams                       # or: inflightq bench streams
    python -m bench.streams --counts 20 --idle-s 2 --settle-s 0 --no-cluster   # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import redis

from bench import results_files
from bench.serve import stop_on_sigterm
from bench.serve_stack import Stack
from inflightq_cli.redis_cluster import PrivateRedisCluster
from inflightq_cli.redis_server import ensure_redis
from shared.client_core import QUEUED_CHECK_MAX_S
from shared.settings import Settings, get_settings

STREAM_ROUTE = "/v1/jobs/{job_id}/stream"
# Requests in flight while queueing jobs and opening streams: enough to go fast, few enough not to
# time out against one API process on a small machine.
OPEN_CONCURRENCY = 128
# How long an API may take to answer /health: on a loaded 2-core machine, under nice, its imports alone
# took over 120 s.
API_START_S = 600
# A 503 while queueing or opening (an API starved of CPU on a loaded machine: its Redis waits time
# out) is retried after its Retry-After, this many times at most, and counted in the row.
RETRIES_503 = 20
# File descriptors: the client holds N sockets and so does the API (which inherits this limit), and
# an API from before one subscriber per process (``--api-checkout``) holds N more to Redis.
FD_HEADROOM = 1024


@dataclass(frozen=True)
class Backend:
    """A Redis (standalone, or a Cluster's nodes) the API runs on."""

    name: str
    url: str
    cluster: bool
    node_urls: list[str]

    @property
    def ports(self) -> set[int]:
        return {int(u.rsplit(":", 1)[1].split("/")[0]) for u in self.node_urls}


class ApiOnly(Stack):
    """``inflightq api`` alone: no worker, streams wait on queued jobs instead of 503."""

    cluster: bool = False

    def _env(self) -> dict[str, str]:
        env = super()._env()
        env["INFLIGHTQ_REDIS_CLUSTER"] = "true" if self.cluster else "false"
        env["INFLIGHTQ_NO_WORKER_WAIT_S"] = "86400"
        if self.cwd is not None:
            env["PYTHONPATH"] = str(self.cwd)  # that checkout's code only, not this one's behind it
        return env


def raise_fd_limit(streams: int) -> int:
    """Soft RLIMIT_NOFILE up to what N streams need (the hard limit caps it); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * streams + FD_HEADROOM
    if soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


# Measuring the API from outside ------------------------------------------------------------------
def redis_sockets(process: psutil.Process, ports: set[int]) -> set[tuple[int, str]]:
    """(Redis port, the API's ``ip:port``) of the API's established TCP connections to the Redis node(s).

    Keyed by the node too: the kernel reuses one local port for connections to different remote
    ports, so on a Cluster of loopback nodes the API's address alone may name another process's
    connection to another node."""
    return {
        (c.raddr.port, f"{c.laddr.ip}:{c.laddr.port}")
        for c in process.net_connections(kind="tcp")
        if c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED
    }


def redis_side(backend: Backend, sockets: set[tuple[int, str]]) -> dict[str, int]:
    """What the node(s) say of the API's connections (CLIENT LIST): connections, pub/sub ones, channels."""
    out = {"connections": 0, "pubsub_connections": 0, "channels": 0}
    for url in backend.node_urls:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with redis.Redis.from_url(url, decode_responses=True) as node:
            for client in node.client_list():
                if (port, client["addr"]) not in sockets:
                    continue
                channels = int(client.get("sub", 0)) + int(client.get("ssub", 0)) + int(client.get("psub", 0))
                out["connections"] += 1
                out["pubsub_connections"] += int(channels > 0 or "P" in client.get("flags", ""))
                out["channels"] += channels
    return out


def snapshot(process: psutil.Process, backend: Backend) -> dict[str, Any]:
    sockets = redis_sockets(process, backend.ports)
    cpu = process.cpu_times()
    return {
        "rss_mib": process.memory_info().rss / 2**20,
        "cpu_s": cpu.user + cpu.system,
        "redis_sockets": len(sockets),
        "redis": redis_side(backend, sockets),
        "at": time.monotonic(),
    }


async def streams_in_flight(http: aiohttp.ClientSession, base_url: str) -> int:
    """The API's own count of open streams on the jobs route (its /metrics gauge)."""
    async with http.get(f"{base_url}/metrics") as response:
        text = await response.text()
    for line in text.splitlines():
        if line.startswith("inflightq_api_streams_in_flight") and f'route="{STREAM_ROUTE}"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


# One N ---------------------------------------------------------------------------------------------
async def hold_streams(stack: ApiOnly, backend: Backend, n: int, settle_s: float, idle_s: float) -> dict[str, Any]:
    assert stack.api is not None
    api = psutil.Process(stack.api.pid)
    base = stack.base_url
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=None)
    gate = asyncio.Semaphore(OPEN_CONCURRENCY)
    responses: list[aiohttp.ClientResponse] = []
    received: list[bytes] = []
    readers: list[asyncio.Task[None]] = []
    refused: list[str] = []

    async def submit(http: aiohttp.ClientSession, i: int) -> str:
        body = {"prompt": [1, 2, 3 + i % 50], "max_new_tokens": 1}
        for _ in range(RETRIES_503):
            async with gate, http.post(f"{base}/v1/jobs", json=body) as response:
                if response.status != 503:
                    response.raise_for_status()
                    return str((await response.json())["id"])
                refused.append("submit")
            await asyncio.sleep(float(response.headers.get("retry-after", "1")))
        raise RuntimeError(f"POST /v1/jobs: 503 {RETRIES_503} times")

    async def read(response: aiohttp.ClientResponse) -> None:
        # Anything a queued job's stream sends while it waits (an error event, an end) is a failure.
        while chunk := await response.content.readany():
            received.append(chunk)
        received.append(b"<eof>")

    async def open_stream(http: aiohttp.ClientSession, job_id: str) -> None:
        for _ in range(RETRIES_503):
            async with gate:
                response = await http.get(f"{base}/v1/jobs/{job_id}/stream")
                if response.status == 200:
                    responses.append(response)
                    readers.append(asyncio.ensure_future(read(response)))
                    return
                if response.status != 503:
                    raise RuntimeError(f"stream {job_id}: HTTP {response.status}: {await response.text()}")
                refused.append("stream")
                response.release()
            await asyncio.sleep(float(response.headers.get("retry-after", "1")))
        raise RuntimeError(f"stream {job_id}: 503 {RETRIES_503} times")

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        before = snapshot(api, backend)
        started = time.monotonic()
        ids = await asyncio.gather(*(submit(http, i) for i in range(n)))
        queued = time.monotonic()
        await asyncio.gather(*(open_stream(http, job_id) for job_id in ids))
        # Open means subscribed: the API counts N streams and Redis holds N channels for it.
        deadline = time.monotonic() + 120
        while (
            await streams_in_flight(http, base),
            redis_side(backend, redis_sockets(api, backend.ports))["channels"],
        ) != (n, n):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} streams did not all subscribe within 120 s")
            await asyncio.sleep(0.2)
        opened = snapshot(api, backend)
        await asyncio.sleep(settle_s)
        idle_from = snapshot(api, backend)
        await asyncio.sleep(idle_s)
        idle_to = snapshot(api, backend)
        still_open = await streams_in_flight(http, base)
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        for response in responses:
            response.close()

    if received or still_open != n:
        raise RuntimeError(f"idle streams were not idle: {still_open}/{n} open, {len(received)} chunks received")
    window = idle_to["at"] - idle_from["at"]
    cpu_per_s = (idle_to["cpu_s"] - idle_from["cpu_s"]) / window
    return {
        "streams": n,
        "queue_s": round(queued - started, 2),
        "open_s": round(opened["at"] - queued, 2),
        "open_cpu_s": round(opened["cpu_s"] - before["cpu_s"], 2),
        "open_cpu_ms_per_stream": round((opened["cpu_s"] - before["cpu_s"]) / n * 1000, 3),
        "rss_before_mib": round(before["rss_mib"], 1),
        "rss_mib": round(idle_to["rss_mib"], 1),
        "rss_kib_per_stream": round((idle_to["rss_mib"] - before["rss_mib"]) * 1024 / n, 1),
        "redis_connections_before": before["redis_sockets"],
        "redis_connections": idle_to["redis_sockets"],
        "redis_side": idle_to["redis"],
        "redis_connections_per_stream": round(idle_to["redis_sockets"] / n, 4),
        "idle_window_s": round(window, 1),
        "idle_cpu_s_per_s": round(cpu_per_s, 4),
        "idle_cpu_us_per_stream_per_s": round(cpu_per_s / n * 1e6, 2),
        "streams_open_after_idle": still_open,
        "retried_503": {"submit": refused.count("submit"), "stream": refused.count("stream")},
    }


def run_backend(
    backend: Backend,
    settings: Settings,
    counts: list[int],
    settle_s: float,
    idle_s: float,
    checkout: Path | None = None,
) -> list[dict[str, Any]]:
    rows = []
    for n in counts:
        prefix = f"bench-streams-{uuid.uuid4().hex[:8]}"
        stack = ApiOnly(
            settings.model_copy(update={"redis_url": backend.url, "key_prefix": prefix}), api_keys=[], cwd=checkout
        )
        stack.cluster = backend.cluster
        stack.start(workers=0)
        try:
            stack.wait_ready(0, timeout=API_START_S)
            row = asyncio.run(hold_streams(stack, backend, n, settle_s, idle_s))
        finally:
            stack.stop()
        print(
            f"{backend.name} N={n}: {row['redis_connections']} Redis connections "
            f"({row['redis_side']['pubsub_connections']} pub/sub, {row['redis_side']['channels']} channels), "
            f"RSS {row['rss_before_mib']} -> {row['rss_mib']} MiB ({row['rss_kib_per_stream']} KiB/stream), "
            f"idle CPU {row['idle_cpu_s_per_s']} s/s",
            flush=True,
        )
        rows.append(row)
    return rows


# The run -------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="inflightq bench streams", description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", default="100,1000,10000", help="Open streams per measurement, comma-separated.")
    p.add_argument("--settle-s", type=float, default=QUEUED_CHECK_MAX_S + 5,
                   help="Wait after the last stream opened, before the idle window.")  # fmt: skip
    p.add_argument("--idle-s", type=float, default=QUEUED_CHECK_MAX_S, help="Idle window CPU is measured over.")
    p.add_argument("--cluster", action=argparse.BooleanOptionalAction, default=True,
                   help="Also on a private 3-master Redis Cluster.")  # fmt: skip
    p.add_argument("--api-checkout", type=Path, default=None,
                   help="Start the API from this checkout (e.g. a git worktree of an older commit); "
                   "default: this one.")  # fmt: skip
    p.add_argument("--model", default=None, help="Model the API serves (its tokenizer); default: a tiny random one.")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tag", default="", help="Suffix of the result files' names.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    stop_on_sigterm()
    counts = [int(c) for c in args.counts.split(",")]
    load_before = os.getloadavg()[0]
    fd_limit = raise_fd_limit(max(counts))
    base = get_settings()
    url, private = ensure_redis(base.redis_url)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from worker.engine.model.tiny_model import make_tiny_llama

            model = str(make_tiny_llama(Path(tmp) / "tiny-random-llama"))
        settings = base.model_copy(update={"model": model, "max_queue_depth": max(counts) + 1024})
        runs: dict[str, list[dict[str, Any]]] = {}
        try:
            runs["standalone"] = run_backend(Backend("standalone", url, False, [url]), settings, counts,
                                             args.settle_s, args.idle_s, args.api_checkout)  # fmt: skip
        finally:
            if private is not None:
                private.stop()
        if args.cluster:
            cluster = PrivateRedisCluster(replicas_per_master=0).start()
            try:
                backend = Backend("cluster", cluster.url, True, [n.url for n in cluster.nodes])
                runs["cluster"] = run_backend(backend, settings, counts, args.settle_s, args.idle_s, args.api_checkout)
            finally:
                cluster.stop()
    report = {
        "command": " ".join(["inflightq bench streams", *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "redis": redis_version(url) if private is None else "a private redis-server",
        "model": "tiny random Llama (its tokenizer only: no worker runs)" if args.model is None else args.model,
        "settle_s": args.settle_s,
        "idle_s": args.idle_s,
        "queued_check_max_s": QUEUED_CHECK_MAX_S,
        "rlimit_nofile": fd_limit,
        "api_code": api_code(args.api_checkout),
        # CPU figures are CPU time the API consumed, which others' load does not inflate much; noted anyway.
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "runs": runs,
    }
    stem = Path(args.out) / f"streams-{report['date'][:10]}{'-' + args.tag if args.tag else ''}"
    results_files.save(stem, report, markdown(report), plot)
    print("\n".join(markdown(report)))
    return report


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}"


def api_code(checkout: Path | None) -> str:
    """The commit the API ran (``git log -1`` of its checkout), marked when the tree had changes."""
    where = checkout or Path.cwd()

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True).stdout.strip()

    commit = git("log", "-1", "--format=%h %s")
    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    return f"{commit[:100]}{dirty}" if commit else str(where)


def redis_version(url: str) -> str:
    with redis.Redis.from_url(url) as client:
        return f"Redis {client.info('server')['redis_version']}"


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        f"# Per-stream API cost: idle-waiting streams ({report['date']})",
        "",
        f"Command: `{report['command']}`",
        "",
        f"API code: {report.get('api_code', 'this checkout')}. Machine load (1-minute average) at the start and "
        f"end: {report.get('load_avg_1m', '-')}.",
        "",
        f"Machine: {report['machine']}; {report['redis']} (standalone), and a private 3-master Redis Cluster "
        "(`INFLIGHTQ_REDIS_CLUSTER=true`, sharded pub/sub, no replicas)."
        if "cluster" in report["runs"]
        else f"Machine: {report['machine']}; {report['redis']} (standalone).",
        "",
        "One `inflightq api` process per row, no worker; N jobs queued, then N `GET /v1/jobs/{id}/stream` held "
        "open by one asyncio client (aiohttp). Every stream waits on pub/sub for a job that does not start. "
        "Connections: the API's established TCP sockets to Redis (psutil), matched against `CLIENT LIST` on "
        "every node (pub/sub connections and the channels they carry; the channels equal N). CPU: the API's "
        f"user + sys seconds per second over {report['idle_s']:.0f} s, after {report['settle_s']:.0f} s of "
        f"settling (a queued stream's safety-net check backs off to one per {report['queued_check_max_s']:.0f} s).",
        "",
        "| Redis | streams | API Redis connections (pub/sub; channels) | per stream | RSS before -> with N MiB "
        "| RSS KiB / stream | idle CPU s/s | idle CPU us / stream / s | queue + open s | open CPU ms / stream |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in report["runs"].items():
        for r in rows:
            side = r["redis_side"]
            lines.append(
                f"| {name} | {r['streams']:,} | {r['redis_connections']:,} ({side['pubsub_connections']}; "
                f"{side['channels']:,}) | {r['redis_connections_per_stream']:.4f} | {r['rss_before_mib']:.0f} -> "
                f"{r['rss_mib']:.0f} | {r['rss_kib_per_stream']:.1f} | {r['idle_cpu_s_per_s']:.3f} "
                f"| {r['idle_cpu_us_per_stream_per_s']:.1f} | {r['queue_s']:.1f} + {r['open_s']:.1f} "
                f"| {r['open_cpu_ms_per_stream']:.2f} |"
            )
    lines += [
        "",
        "The API's other Redis connections are its command pool. Since it is bounded (issue 18), at most "
        "`INFLIGHTQ_API_REDIS_MAX_CONNECTIONS` per node (64 by default; on a standalone Redis the pub/sub "
        "connection is one of them, on a Cluster a node may hold one more that redis-py uses for the slot map), "
        "and a command past them waits for a free one. Before (an `--api-checkout` of older code), redis-py "
        "opened a pooled connection whenever more commands were in flight than it had idle connections, up to "
        "`INFLIGHTQ_REDIS_MAX_CONNECTIONS` (10,000), and kept it: the pool followed the peak of commands in "
        f"flight at once (queueing and opening, {OPEN_CONCURRENCY} requests at a time, and the streams' "
        "safety-net checks); before one subscriber per process, every stream also held its own pub/sub "
        "connection.",
    ]
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    plt = results_files.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, rows in report["runs"].items():
        n = [r["streams"] for r in rows]
        axes[0].plot(n, [r["redis_connections"] for r in rows], marker="o", label=f"{name}: all")
        axes[0].plot(n, [r["redis_side"]["pubsub_connections"] for r in rows], marker="x", linestyle="--",
                     label=f"{name}: pub/sub")  # fmt: skip
        axes[1].plot(n, [r["rss_mib"] - r["rss_before_mib"] for r in rows], marker="o", label=name)
        axes[2].plot(n, [r["idle_cpu_s_per_s"] for r in rows], marker="o", label=name)
    titles = ("API's Redis connections", "API RSS growth (MiB)", "API CPU while idle (s/s)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("open idle streams")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"Per-stream API cost ({report['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
