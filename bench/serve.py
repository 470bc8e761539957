"""``inflightq bench serve``: a serving load generator in the manner of ``vllm bench serve``.

One run, one set of seeded synthetic chat prompts (bench/serve_dataset.py), several systems:

- anchors in this process: our offline engine (``LLM.generate``, all requests at once; and each
  request alone, for the low-load TTFT floor) and transformers' continuous batching;
- the full stack, started here (``inflightq api`` + ``inflightq worker`` on Redis, own key prefix)
  or already running (``--base-url``), driven through TGI's ``/generate_stream``, OpenAI's
  ``/v1/chat/completions`` (both SSE) and straight through the queue client: first one request at
  a time (low load), then Poisson arrivals at each ``--request-rate`` (inf = all at once);
- the same at saturation with a second worker;
- with ``--peers vllm,llamacpp``: vLLM's CPU build and llama.cpp's server, on the same weights in BF16,
  through their OpenAI chat routes at the same load points (bench/serve_peer_runs.py; installed by
  bench/peers/install.sh, and skipped with a message naming it where they are not).

``--concurrency 1,8,32`` adds closed-loop load points (every request released, at most N in flight) to the
request rates, or replaces them when ``--request-rate`` is not given.

Writes bench/results/serve-<date>.{json,md,png} and README-serve.md (table, plot, command).

    python -m bench.serve --quick            # or: inflightq bench serve --quick
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import functools
import gc
import math
import shlex
import signal
import sys
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from bench.results_files import machine
from bench.serve_clients import ENDPOINTS, Sender, chat_sender, queue_sender, run_load, tgi_sender
from bench.serve_cpu import WORKERS, CpuMeter, local_redis_pid
from bench.serve_dataset import ChatSample, describe, synthetic_chat
from bench.serve_low_load import OneRequest, interleaved, paired_added_ms
from bench.serve_metrics import RequestResult, print_summary, summarize
from bench.serve_report import checkpoint, rate_label
from bench.serve_stack import Quiet, Stack, measure, quiet_policy
from shared.async_client import AsyncQueueClient
from shared.client import redis_kwargs
from shared.redis_connect import connect_async
from shared.settings import Settings, get_settings
from shared.startup_objects import freeze_startup_objects

QUICK_REQUESTS = 100
LABELS = {"generate_stream": "API /generate_stream", "chat": "API /v1/chat/completions", "queue": "queue client"}
OFFLINE = "offline_engine"  # the low-load phase's name for one request alone in the in-process engine


class Runner:
    """Runs load against one stack; each run presents a fresh API key (a fresh prefix-cache tenant)."""

    def __init__(self, settings: Settings, base_url: str, api_keys: list[str], quiet: Quiet | None = None) -> None:
        self.settings, self.base_url, self.api_keys = settings, base_url, api_keys
        self.used = 0
        self.quiet = quiet  # None: measure whatever else runs
        self.report: dict[str, Any] = {}
        self.cpu = CpuMeter()  # which processes' CPU each run reports (bench/serve_cpu.py)

    def _sender(
        self, endpoint: str, http: httpx.AsyncClient, queue: AsyncQueueClient, priority: int | None = None
    ) -> Sender:
        key = self.api_keys[self.used % len(self.api_keys)] if self.api_keys else ""
        self.used += 1
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if endpoint == "generate_stream":
            return tgi_sender(http, headers, priority)
        if endpoint == "chat":
            return chat_sender(http, headers, self.settings.model, priority)
        return queue_sender(queue, self.settings.model, tenant=f"bench-{key or uuid.uuid4().hex}", priority=priority)

    @contextlib.asynccontextmanager
    async def _clients(self) -> AsyncIterator[tuple[httpx.AsyncClient, AsyncQueueClient]]:
        """An HTTP client and a queue client with room for every stream a run opens."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(None, connect=30)
        async with (
            httpx.AsyncClient(base_url=self.base_url, limits=limits, timeout=timeout) as http,
            AsyncQueueClient(self.settings, client=queue_redis(self.settings)) as queue,
        ):
            yield http, queue

    async def run(
        self, endpoint: str, samples: list[ChatSample], *, rate: float = math.inf, concurrency: int | None = None
    ) -> dict[str, Any]:
        async with self._clients() as (http, queue):
            send = self._sender(endpoint, http, queue)
            results, duration = await run_load(send, samples, request_rate=rate, max_concurrency=concurrency)
        return summarize(results, duration)

    async def low_load(
        self, endpoints: list[str], samples: list[ChatSample], offline: Any = None
    ) -> dict[str, tuple[list[RequestResult], float]]:
        """Each sample alone through every way in (and the offline engine), interleaved: see bench/serve_low_load."""
        async with self._clients() as (http, queue):
            systems: dict[str, OneRequest] = {}
            if offline is not None:
                from bench.serve_anchors import offline_one

                tenant = f"low-load-{uuid.uuid4().hex[:8]}"
                counter = iter(range(len(samples)))

                async def offline_request(sample: ChatSample) -> RequestResult:
                    # Runs on the event loop's thread on purpose: nothing else is in flight at low load.
                    return offline_one(offline, sample, f"{tenant}-{next(counter)}", tenant)

                systems[OFFLINE] = offline_request
            for endpoint in endpoints:
                systems[endpoint] = self._sender(endpoint, http, queue)
            return await interleaved(systems, samples)


def queue_redis(settings: Settings) -> aioredis.Redis:
    """The queue client's connection (a RedisCluster on a Cluster), with room for every concurrent
    command: streams share one pub/sub connection per node, but each submit and idle check takes one
    from the pool while it runs, and redis-py's default pool of 100 fails past that (MaxConnectionsError)."""
    return connect_async(  # type: ignore[return-value]
        settings, **(redis_kwargs(settings, asyncio=True) | {"max_connections": 100_000})
    )


def run_low_load(runner: Runner, endpoints: list[str], samples: list[ChatSample], workers: int, offline: Any) -> None:
    """The interleaved low-load phase: a row per system, and the paired TTFT differences."""
    report = runner.report
    systems = ([OFFLINE] if offline is not None else []) + endpoints
    title = f"low load, {len(samples)} prompts, each alone through {', '.join(systems)}"
    by_system, contended = measure(
        lambda _: asyncio.run(runner.low_load(endpoints, samples, offline)), runner.quiet, title
    )
    for name, (results, busy) in by_system.items():
        metrics = summarize(results, busy)
        if name == OFFLINE:
            report["anchors"]["offline_engine_low_load"] = metrics
            print_summary("offline engine, one request at a time", metrics)
            continue
        row = {"phase": "low_load", "endpoint": name, "workers": workers, "concurrency": 1, "rate": "inf"}
        row |= {"system": LABELS[name], "metrics": metrics}
        if contended:
            row["contended_by"] = contended
        print_summary(f"{LABELS[name]}, {workers} worker(s), one request at a time", metrics)
        report["runs"].append(row)
    bases = [b for b in (OFFLINE, "queue") if b in by_system]
    report["low_load_paired_ttft_added_ms"] = {
        f"{path} vs {base}": paired_added_ms(by_system[path][0], by_system[base][0])
        for path in endpoints
        for base in bases
        if path != base
    }
    for pair, added in report["low_load_paired_ttft_added_ms"].items():
        print(f"TTFT added, {pair}: median {added['median']} ms (quartiles {added['p25']} / {added['p75']})")
    checkpoint(report)


def run_phase(
    runner: Runner, plan: list[dict[str, Any]], samples: dict[str, list[ChatSample]], done: list[dict[str, Any]]
) -> list[dict]:
    """Runs each planned run in order, appending each to ``done`` with its metrics as it ends."""
    for spec in plan:
        rate, concurrency = spec.get("rate", math.inf), spec.get("concurrency")
        title = f"{LABELS[spec['endpoint']]}, {spec['workers']} worker(s), rate {rate_label(rate)}, concurrency"
        title += f" {concurrency}"
        one = functools.partial(
            runner.run, spec["endpoint"], samples[spec["phase"]], rate=rate, concurrency=concurrency
        )

        def metered(_: int, one: Any = one) -> dict[str, Any]:
            runner.cpu.start()
            out = asyncio.run(one())
            cpu = runner.cpu.stop(out["total_output_tokens"])
            return {**out, "cpu": cpu} if cpu else out

        metrics, contended = measure(metered, runner.quiet, title)
        row = {**spec, "rate": rate_label(rate), "system": LABELS[spec["endpoint"]], "metrics": metrics}
        if contended:
            row["contended_by"] = contended
        print_summary(title, metrics)
        done.append(row)
        checkpoint(runner.report)
    return done


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="inflightq bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: INFLIGHTQ_MODEL")
    p.add_argument("--dtype", default=None, help="auto, float32, bfloat16 (default: INFLIGHTQ_DTYPE)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_REQUESTS} requests instead of 1,000")
    p.add_argument("--num-requests", type=int, default=None, help="default 1000 (100 with --quick)")
    p.add_argument("--input-len", default="50,500", help="prompt tokens, min,max (uniform)")
    p.add_argument("--output-len", default="10,200", help="new tokens, min,max (uniform; ignore_eos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--request-rate", default=None, help="requests/s, comma list; inf = all at once (default 1,inf; full: 1,2,inf)"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight in rate runs")
    p.add_argument(
        "--concurrency",
        default="",
        help="comma list of concurrency levels: runs with all requests released and at most N in flight"
        " (replaces the rate sweep unless --request-rate is given too)",
    )
    p.add_argument(
        "--peers", default="", help="also run these servers at the same load points: vllm,llamacpp (bench/peers/)"
    )
    p.add_argument("--peer-timeout", type=float, default=900.0, help="seconds a peer may take to start")
    p.add_argument("--endpoints", default=",".join(ENDPOINTS), help="generate_stream,chat,queue ('' = none)")
    p.add_argument("--low-load-requests", type=int, default=8, help="requests sent one at a time (0 = skip)")
    p.add_argument("--workers", default="1,2", help="worker counts; beyond the first only at saturation")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per engine (default 3072)")
    p.add_argument("--skip-anchors", action="store_true", help="no offline engine / transformers runs")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--base-url", default=None, help="use this running API (its Redis/prefix from INFLIGHTQ_*)")
    p.add_argument("--api-key", default=None, help="with --base-url: the key to present")
    p.add_argument("--no-wait", action="store_true", help="do not wait for other benchmarks to finish")
    p.add_argument("--max-wait", type=float, default=300.0, help="seconds to wait for other benchmarks, per run")
    p.add_argument("--retries", type=int, default=1, help="measure again when another benchmark ran alongside")
    p.add_argument("--out", default="bench/results", help="folder for serve-<date>.*; '' to skip writing")
    p.add_argument("--tag", default="", help="name files serve-<date>-<tag>.* and leave README-serve.md alone")
    args = p.parse_args(argv)
    from bench.serve_peers import parse_peers

    try:
        args.peers = parse_peers(args.peers)
        args.points = sweep_points(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def sweep_points(args: argparse.Namespace) -> list[tuple[float, int | None]]:
    """The sweep's load points, (request rate, concurrency cap): each rate (capped by --max-concurrency),
    then each --concurrency level with every request released at once."""
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if any(c < 1 for c in levels):
        raise ValueError(f"--concurrency levels must be >= 1: {args.concurrency}")
    default_rates = "" if levels else ("1,inf" if args.quick else "1,2,inf")
    rates = [float(r) for r in (args.request_rate if args.request_rate is not None else default_rates).split(",") if r]
    return [(r, args.max_concurrency) for r in rates] + [(math.inf, c) for c in levels]


def bench_settings(args: argparse.Namespace) -> Settings:
    base = get_settings()
    update: dict[str, Any] = {"model": args.model or base.model, "dtype": args.dtype or base.dtype}
    if args.base_url is None:  # a stack of our own: keys nobody else reads or deletes
        update["key_prefix"] = f"bench-serve-{uuid.uuid4().hex[:8]}"
        update["max_queue_depth"] = max(base.max_queue_depth, 4096)  # inf rate enqueues all at once
    # Sized from memory the cache takes most of RAM (6 GB here); a fixed size is the same for every system.
    update["num_kv_blocks"] = args.num_kv_blocks or base.num_kv_blocks or 3072
    return base.model_copy(update=update)


def stop_on_sigterm() -> None:
    """SIGTERM (``timeout``, a CI cancel) unwinds like Ctrl-C, so the stack's API and workers are
    stopped by their ``finally`` instead of outliving the benchmark and loading the machine."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    stop_on_sigterm()
    from shared.model_source import load_tokenizer

    settings = bench_settings(args)
    num = args.num_requests or (QUICK_REQUESTS if args.quick else 1000)
    lo_in, hi_in = map(int, args.input_len.split(","))
    lo_out, hi_out = map(int, args.output_len.split(","))
    tokenizer = load_tokenizer(settings.model)
    samples = synthetic_chat(tokenizer, num, input_len=(lo_in, hi_in), output_len=(lo_out, hi_out), seed=args.seed)
    phases = {"low_load": samples[: args.low_load_requests], "sweep": samples, "scale": samples}
    warm = synthetic_chat(tokenizer, 8, input_len=(40, 60), output_len=(4, 4), seed=args.seed + 1)
    endpoints = [e for e in args.endpoints.split(",") if e]
    workers = [int(w) for w in args.workers.split(",")]
    report = report_head("inflightq bench serve", argv, settings, samples, args) | {"anchors": {}, "runs": []}
    offline = None
    if not args.skip_anchors:
        report["anchors"], offline = run_anchors(settings, samples, bool(phases["low_load"]), args)
        report["dtype"] = report["anchors"].pop("dtype")
    else:  # what "auto" means on this machine, as the worker resolves it (the peers run the same)
        from worker.engine_config import settings_dtype

        report["dtype"] = str(settings_dtype(settings)).replace("torch.", "")
    checkpoint(report)
    # This process is the load generator; with the anchors' models loaded, one full collection of its
    # objects took ~0.3-0.4 s of a core during the stack's runs, CPU no real client spends.
    freeze_startup_objects()
    if endpoints:  # --endpoints '': no runs through our stack (e.g. to try a peer alone)
        run_stack(settings, args, endpoints, args.points, workers, phases, warm, report, offline)
    if args.peers:
        from bench.serve_peer_runs import run_peers

        run_peers(args.peers, settings, args.points, samples, warm, report, args)
    report["targets"] = targets(report)
    if args.out:
        from bench.serve_report import write

        write(report, Path(args.out), tag=args.tag)
    return report


ENGINE_KEYS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_prefill_tokens_beside_decodes",
    "block_size",
    "num_kv_blocks",
)


def report_head(
    prog: str,
    argv: list[str] | None,
    settings: Settings,
    samples: list[ChatSample],
    args: argparse.Namespace,
    engine_keys: tuple[str, ...] = ENGINE_KEYS,
) -> dict[str, Any]:
    """What every benchmark report opens with: the command, when, where, the model, engine and dataset."""
    return {
        "command": f"{prog} " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": settings.model,
        "dtype": settings.dtype,
        "engine": {k: getattr(settings, k) for k in engine_keys},
        "dataset": describe(samples)
        | {
            "seed": args.seed,
            "input_len": list(map(int, args.input_len.split(","))),
            "output_len": list(map(int, args.output_len.split(","))),
        },
    }


def run_anchors(
    settings: Settings, samples: list[ChatSample], keep_for_low_load: bool, args: argparse.Namespace
) -> tuple[dict[str, Any], Any]:
    """Each anchor measured on a quiet machine (see ``measure``); what still overlapped is recorded.
    Returns the anchors and, for the low-load phase that interleaves it with the stack, the offline LLM."""
    from bench.serve_anchors import load_offline, offline_generate, transformers_cb, warm_up
    from worker.engine_config import settings_dtype

    dtype = settings_dtype(settings)
    anchors: dict[str, Any] = {"dtype": str(dtype).replace("torch.", "")}
    llm = load_offline(settings, dtype)
    warm_up(llm, len(llm.tokenizer))
    quiet = quiet_policy(args)
    contended: dict[str, list[str]] = {}
    anchors["offline_engine"], contended["offline_engine"] = measure(
        lambda _, llm=llm: offline_generate(llm, samples), quiet, "offline engine"
    )
    print(f"offline engine (LLM.generate): {anchors['offline_engine']['output_throughput']} tok/s", flush=True)
    if not keep_for_low_load:
        del llm
        llm = None
    gc.collect()
    if not args.skip_transformers:
        anchors["transformers_cb"], contended["transformers_cb"] = measure(
            lambda _: transformers_cb(settings, dtype, samples), quiet, "transformers CB"
        )
        print(f"transformers CB: {anchors['transformers_cb']['output_throughput']} tok/s", flush=True)
        gc.collect()
    anchors["contended_by"] = {k: v for k, v in contended.items() if v}
    return anchors, llm


def run_stack(
    settings: Settings,
    args: argparse.Namespace,
    endpoints: list[str],
    points: list[tuple[float, int | None]],
    workers: list[int],
    phases: dict[str, list[ChatSample]],
    warm: list[ChatSample],
    report: dict[str, Any],
    offline: Any = None,
) -> None:
    keys = [f"bench-{uuid.uuid4().hex[:12]}" for _ in range(256)]
    stack = None if args.base_url else Stack(settings, keys)
    try:
        if stack is not None:
            stack.start(workers=workers[0])
            own = {c.pid for c in [stack.api, *stack.workers] if c is not None}
            policy = quiet_policy(args)
            runner = Runner(settings, stack.base_url, keys, policy.with_own(own) if policy else None)
        else:
            runner = Runner(settings, args.base_url, [args.api_key] if args.api_key else [], None)
        runner.report = report
        runner.cpu.groups = stack_processes(settings, stack)
        warm_stack(runner, endpoints, warm)
        if phases["low_load"]:
            run_low_load(runner, endpoints, phases["low_load"], workers[0], offline)
        plan: list[dict[str, Any]] = [
            {"phase": "sweep", "endpoint": e, "workers": workers[0], "rate": r, "concurrency": c}
            for r, c in points  # point-major: the ways in at one load point run close together in time
            for e in endpoints
        ]
        runs = run_phase(runner, plan, phases, report["runs"])
        for count in workers[1:]:
            if stack is None:
                print("--base-url: cannot add workers; skipping the worker-count comparison")
                break
            stack.restart_workers(count)
            own = {c.pid for c in [stack.api, *stack.workers] if c is not None}
            runner.quiet = runner.quiet.with_own(own) if runner.quiet else None
            runner.cpu.groups = stack_processes(settings, stack)
            warm_stack(runner, endpoints[:1], warm)
            scale = [
                {"phase": "scale", "endpoint": endpoints[0], "workers": count, "concurrency": args.max_concurrency}
            ]
            run_phase(runner, scale, phases, runs)
    finally:
        if stack is not None:
            stack.stop()


def stack_processes(settings: Settings, stack: Stack | None) -> dict[str, list[int]]:
    """The processes whose CPU a run reports: the API and workers this benchmark started, and the
    Redis server when it runs on this machine. (With --base-url: Redis only, when local.)"""
    import redis

    groups: dict[str, list[int]] = {}
    if stack is not None:
        groups["api"] = [stack.api.pid] if stack.api is not None else []
        groups[WORKERS] = [w.pid for w in stack.workers]
    pid = None  # on a Cluster, many servers: no Redis column
    if not settings.redis_cluster:
        with (
            contextlib.suppress(redis.RedisError, ValueError),
            redis.Redis.from_url(settings.redis_url, socket_timeout=2) as client,
        ):
            pid = local_redis_pid(client.info("server"))
    if pid is not None:
        groups["redis"] = [pid]
    return groups


def warm_stack(runner: Runner, endpoints: list[str], warm: list[ChatSample]) -> None:
    """First-call costs (model kernels, connection pools) out of the way, on prompts no run sends."""
    for endpoint in endpoints:
        asyncio.run(runner.run(endpoint, warm))


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's two targets, as ratios and differences against anchors from this same run."""
    out: dict[str, Any] = {}
    anchors = report["anchors"]
    runs = [r for r in report["runs"] if "peer" not in r]  # the peers have a table of their own
    first_workers = min((r["workers"] for r in runs), default=1)
    saturated = {
        r["endpoint"]: r for r in runs if r["phase"] == "sweep" and r["rate"] == "inf" and r["workers"] == first_workers
    }
    offline = anchors.get("offline_engine", {}).get("output_throughput")
    if offline and saturated:
        ratios = {e: round(r["metrics"]["output_throughput"] / offline, 3) for e, r in saturated.items()}
        out["throughput_vs_offline_engine"] = {
            "ratios": ratios,
            "target": 0.9,
            "met": {e: v >= 0.9 for e, v in ratios.items()},
        }
    # The TTFT a path adds: the median over prompts of (path - offline engine) on the same prompt,
    # measured interleaved (bench/serve_low_load.py); the p50s' difference is kept beside it.
    paired = report.get("low_load_paired_ttft_added_ms", {})
    low = {r["endpoint"]: r["metrics"]["ttft_ms"]["p50"] for r in runs if r["phase"] == "low_load"}
    floor = anchors.get("offline_engine_low_load", {}).get("ttft_ms", {}).get("p50")
    added = {k: v["median"] for k, v in paired.items() if k.endswith(f"vs {OFFLINE}") and v["pairs"]}
    if added:
        out["p50_ttft_added_ms_at_low_load"] = {
            "added": added,
            "estimator": "median per-prompt TTFT difference, systems interleaved prompt by prompt",
            "p50_differences": {f"{e} vs {OFFLINE}": round(p50 - floor, 2) for e, p50 in low.items() if floor},
            "target": 15.0,
            "met": {k: v <= 15.0 for k, v in added.items() if not k.startswith("queue")},
        }
    scale = {r["workers"]: r["metrics"]["output_throughput"] for r in runs if r["phase"] == "scale"}
    if scale and saturated.get(runs[-1]["endpoint"]):
        base = saturated[runs[-1]["endpoint"]]["metrics"]["output_throughput"]
        out["workers_scaling"] = {f"{w} vs {first_workers}": round(v / base, 3) for w, v in scale.items()}
    return out


if __name__ == "__main__":
    main()
