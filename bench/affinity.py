"""``inflightq bench affinity``: prefix-affine pulling against plain pull, through the whole stack (issue 50).

One run, every system on the same seeded workloads, each on a fresh stack (``inflightq api`` and
``inflightq worker`` processes with their metrics ports, on a private Redis of the run's own so its
command counts are the stack's alone):

- multi-turn chat: ``--conversations`` conversations of ``--turns`` turns; each turn is sent when the
  previous answer has arrived and repeats the whole history (the answers as the server wrote them),
  so histories grow past 1,000 tokens with the defaults;
- shared prefixes: ``--prefixes`` distinct system prompts of ``--prefix-len`` tokens, ``--prefix-requests``
  requests over them (uniform, seeded) from ``--prefix-clients`` closed-loop clients, with a KV cache
  of ``--prefix-kv-blocks`` per worker: too small to hold every prompt on every worker.

Per workload: one worker (the single worker's prefix hit rate, the anchor of the hit-rate target),
then, for each of ``--workers``, plain pull (affinity off: the anchor of the other targets) and
affinity on, in alternating order. Each run reports the pool-wide prefix hit rate and the tokens
prefilled (the workers' counters), TTFT p50/p99 (all turns, and the follow-up turns alone),
throughput, the Redis commands and Redis CPU per request, the summaries' size, and the longest time a
worker held no sequence while work waited in Redis (sampled every ``--sample-every`` s).

Then bench/affinity_sim.py projects the effect to 16-64 workers from the per-token prefill and
decode costs fitted on this run's workers, and says where the design stops scaling. Writes
bench/results/affinity-<date>[-tag].{json,md,png}.

    INFLIGHTQ_TORCH_THREADS=1 python -m bench.affinity     # or: inflightq bench affinity
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import re
import shlex
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import redis

from bench.affinity_sim import fit_costs
from bench.results_files import machine
from bench.serve import ENGINE_KEYS, bench_settings, stop_on_sigterm
from bench.serve_clients import sse_data
from bench.serve_dataset import templated_ids, word_pool
from bench.serve_metrics import RequestResult, stats_ms, summarize
from bench.serve_stack import Stack
from shared.client import QueueClient
from shared.settings import Settings

MULTI_TURN, SHARED_PREFIX = "multi_turn", "shared_prefix"
PLAIN, AFFINITY, SINGLE = "plain", "affinity", "single"
HIT_RATE_TARGET = 0.9  # the pool's hit rate within 10% of a single worker's
AFFINITY_ENV = "INFLIGHTQ_AFFINITY"
SLOT_COMMANDS = ("sadd", "srem")  # besides the scripts: the workers' summary updates
READ_TIMEOUT_S = 300.0
QUICK = {"conversations": 16, "turns": 4, "prefixes": 8, "prefix_requests": 48}


@dataclass(frozen=True)
class Workloads:
    """The seeded text of both workloads: what each conversation's user says, and the prefix requests."""

    first: list[str]  # each conversation's first user message
    follow: list[list[str]]  # each conversation's later user messages, one per turn after the first
    answer_len: int
    prefixes: list[str]  # the shared system prompts
    requests: list[tuple[int, str]]  # (prefix index, user message), in send order
    prefix_answer_len: int


def words(rng: random.Random, pool: list[str], n: int) -> str:
    """About ``n`` tokens of text: ``pool`` holds words that stay one token each after a space."""
    return "".join(rng.choices(pool, k=max(1, n))).strip()


def make_workloads(tokenizer: Any, args: argparse.Namespace) -> Workloads:
    rng = random.Random(args.seed)
    pool = word_pool(tokenizer)
    first = [words(rng, pool, args.first_turn_len) for _ in range(args.conversations)]
    follow = [[words(rng, pool, args.turn_len) for _ in range(args.turns - 1)] for _ in range(args.conversations)]
    prefixes = [words(rng, pool, args.prefix_len) for _ in range(args.prefixes)]
    requests = [(rng.randrange(args.prefixes), words(rng, pool, args.suffix_len)) for _ in range(args.prefix_requests)]
    return Workloads(first, follow, args.answer_len, prefixes, requests, args.prefix_answer_len)


def prefix_shape(tokenizer: Any, w: Workloads) -> tuple[int, int]:
    """Tokens the requests of one system prompt share (the common head of two such templated prompts
    with different questions), and the prefix requests' mean prompt length."""
    ids = [templated_ids(tokenizer, messages(w, p, q))[1] for p, q in w.requests]
    a, b = (templated_ids(tokenizer, messages(w, 0, q))[1] for q in ("one question", "another question"))
    shared = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return shared, round(sum(map(len, ids)) / len(ids))


def messages(w: Workloads, prefix: int, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": w.prefixes[prefix]}, {"role": "user", "content": question}]


@dataclass
class Sent:
    """One request of a run: when it was sent, what came back, and its place in the workload."""

    result: RequestResult
    sent_s: float
    group: int  # the conversation, or the prefix
    turn: int  # the turn within the conversation (0 for the shared-prefix requests)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server reports it


async def chat_turn(
    http: httpx.AsyncClient, headers: dict[str, str], model: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[RequestResult, str, int | None]:
    """One streamed chat request, greedy and exactly ``max_tokens`` long: its timings, its text and the
    prompt tokens the server says it found cached."""
    result = RequestResult(0, max_tokens)
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text: list[str] = []
    cached: int | None = None
    started = last = time.perf_counter()
    opened = False
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result, "", None
            async for data in sse_data(response):
                if "error" in data:
                    result.error = f"{data['error'].get('type')}: {data['error'].get('message')}"
                    return result, "", None
                if usage := data.get("usage"):
                    result.reported_tokens = usage["completion_tokens"]
                    result.prompt_len = result.reported_prompt_tokens = usage["prompt_tokens"]
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                for choice in data.get("choices", []):
                    delta = choice.get("delta", {})
                    # The opening chunk (role, empty content) comes with the first token's: timed by order.
                    if "content" in delta and opened:
                        last = result.record_token(started, time.perf_counter(), last)
                        text.append(delta["content"] or "")
                    opened = True
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result, "", None
    result.latency = last - started
    result.success = result.reported_tokens is not None
    result.error = "" if result.success else "stream ended without usage"
    return result, "".join(text), cached


async def multi_turn(
    http: httpx.AsyncClient, headers: dict[str, str], model: str, w: Workloads, spread_s: float
) -> list[Sent]:
    """Every conversation at once (starts spread over ``spread_s``), each turn sent when the previous
    answer has arrived, with the whole history."""
    t0 = time.perf_counter()
    sent: list[Sent] = []

    async def conversation(c: int) -> None:
        await asyncio.sleep(spread_s * c / max(1, len(w.first)))
        history = [{"role": "user", "content": w.first[c]}]
        for turn in range(len(w.follow[c]) + 1):
            at = time.perf_counter() - t0
            result, text, cached = await chat_turn(http, headers, model, history, w.answer_len)
            sent.append(Sent(result, at, c, turn, cached))
            if not result.success:
                return
            if turn < len(w.follow[c]):
                history = [
                    *history,
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": w.follow[c][turn]},
                ]

    await asyncio.gather(*(conversation(c) for c in range(len(w.first))))
    return sent


async def shared_prefix(
    http: httpx.AsyncClient, headers: dict[str, str], model: str, w: Workloads, clients: int
) -> list[Sent]:
    """The prefix requests in order, from ``clients`` closed-loop clients (each sends its next when its
    last has finished)."""
    t0 = time.perf_counter()
    sent: list[Sent] = []
    todo = iter(w.requests)

    async def client() -> None:
        for p, question in todo:
            at = time.perf_counter() - t0
            result, _, cached = await chat_turn(http, headers, model, messages(w, p, question), w.prefix_answer_len)
            sent.append(Sent(result, at, p, 0, cached))

    await asyncio.gather(*(client() for _ in range(clients)))
    return sent


# --- the stack --------------------------------------------------------------------------------------


def scrape_text(text: str) -> dict[str, float]:
    """A worker's /metrics as {name less ``inflightq_worker_`` (with ``:label`` for a reason or priority): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")) or not s.name.startswith("inflightq_worker_"):
                continue
            name = s.name.removeprefix("inflightq_worker_")
            extra = [v for k, v in sorted(s.labels.items()) if k not in ("worker", "model")]
            out[":".join([name, *extra])] = s.value
    return out


_HELD = re.compile(rb"^inflightq_worker_(running|waiting)_requests\{[^}]*\} ([0-9.e+-]+)$", re.MULTILINE)


@dataclass
class Timeline:
    """Sampled every period: each worker's sequences held (running + waiting in its engine) and the queue depth."""

    t: list[float] = field(default_factory=list)
    held: list[list[float]] = field(default_factory=list)  # [sample][worker]
    queued: list[int] = field(default_factory=list)


async def sample(
    http: httpx.AsyncClient, urls: list[str], queue: QueueClient, model: str, period: float, into: Timeline
) -> None:
    """Every ``period`` until cancelled. The queue's depth is read on a thread with the blocking client,
    so a cancellation never lands inside a Redis command."""
    t0 = time.perf_counter()
    while True:
        started = time.perf_counter()
        try:
            texts = await asyncio.gather(*(http.get(u, timeout=5) for u in urls))
            depth = await asyncio.to_thread(queue.queue_depth, model)
        except (httpx.HTTPError, OSError, redis.RedisError):
            await asyncio.sleep(period)
            continue
        held = [sum(float(v) for _, v in _HELD.findall(r.content)) for r in texts]
        into.t.append(round(started - t0, 3))
        into.held.append(held)
        into.queued.append(sum(depth.values()))
        await asyncio.sleep(max(0.0, period - (time.perf_counter() - started)))


def idle_while_queued(tl: Timeline, period: float) -> dict[str, Any]:
    """The longest run of consecutive samples in which a worker held no sequence while entries waited
    in Redis (counted as samples x period), and each worker's share of samples with nothing held."""
    workers = len(tl.held[0]) if tl.held else 0
    longest, which = 0, None
    for w in range(workers):
        run = 0
        for held, queued in zip(tl.held, tl.queued, strict=True):
            run = run + 1 if held[w] == 0 and queued > 0 else 0
            if run > longest:
                longest, which = run, w
    return {
        "longest_s": round(longest * period, 3),
        "worker": which,
        "samples": len(tl.t),
        "period_s": period,
        "idle_share_by_worker": [
            round(sum(1 for h in tl.held if h[w] == 0) / len(tl.held), 3) if tl.held else None for w in range(workers)
        ],
        "samples_with_queue": sum(1 for q in tl.queued if q > 0),
    }


def redis_stats(client: redis.Redis) -> dict[str, Any]:
    """Commands served and CPU spent by the run's Redis since its last CONFIG RESETSTAT (CPU: absolute)."""
    stats = client.info("commandstats")
    cpu = client.info("cpu")
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    usec = {k.removeprefix("cmdstat_"): int(v["usec"]) for k, v in stats.items()}
    return {"calls": calls, "usec": usec, "cpu_s": cpu["used_cpu_sys"] + cpu["used_cpu_user"]}


def key_sizes(client: redis.Redis, settings: Settings) -> dict[str, dict[str, float]]:
    """The run's keys by kind (the name's part after the hash tag): count, bytes (MEMORY USAGE) and
    members where the key is a set (the workers' summaries are)."""
    from shared.keys import Keys

    out: dict[str, dict[str, float]] = {}
    for key in client.scan_iter(match=Keys.for_prefix(settings.key_prefix).pattern(), count=1000):
        kind = key.decode().split("}:", 1)[-1].split(":", 1)[0]
        row = out.setdefault(kind, {"keys": 0, "bytes": 0, "set_members": 0})
        row["keys"] += 1
        row["bytes"] += client.memory_usage(key) or 0
        if client.type(key) == b"set":
            row["set_members"] += client.scard(key)
    return out


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each of a worker's counters (``*_total``, and the histograms' ``_count`` / ``_sum``) gained."""
    keep = [k for k in after if k.split(":")[0].endswith(("_total", "_count", "_sum"))]
    return {k.replace("_total", ""): round(after[k] - before.get(k, 0.0), 6) for k in keep}


# --- one run ----------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    workload: str
    mode: str  # single, plain or affinity
    workers: int


def run_one(spec: RunSpec, settings: Settings, w: Workloads, args: argparse.Namespace) -> dict[str, Any]:
    """A fresh stack (API + ``spec.workers`` workers, empty caches), the workload through it, then the figures."""
    kv = args.prefix_kv_blocks if spec.workload == SHARED_PREFIX else settings.num_kv_blocks
    run_settings = settings.model_copy(update={"key_prefix": f"bench-aff-{uuid.uuid4().hex[:8]}", "num_kv_blocks": kv})
    key, warm_key = f"bench-{uuid.uuid4().hex[:12]}", f"bench-{uuid.uuid4().hex[:12]}"
    # The children inherit this process's environment (INFLIGHTQ_TORCH_THREADS...); the stack's own settings win.
    extra = {AFFINITY_ENV: "true" if spec.mode == AFFINITY else "false"}
    cwd = Path(args.checkout) if args.checkout else None
    stack = Stack(run_settings, [key, warm_key], worker_metrics=True, cwd=cwd, extra_env=extra)
    client = redis.Redis.from_url(settings.redis_url)
    try:
        stack.start(workers=spec.workers)
        load_before = os.getloadavg()[0]
        figures = asyncio.run(drive(spec, stack, run_settings, w, args, key, warm_key, client))
        # Others' processes share the cores: the load average says how much (runnable processes, 1 min).
        figures["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    finally:
        stack.stop()
        client.close()
    figures |= {"workload": spec.workload, "mode": spec.mode, "workers": spec.workers, "num_kv_blocks": kv}
    return figures


@contextlib.asynccontextmanager
async def http_client(base_url: str) -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # A stream silent for READ_TIMEOUT_S is recorded as failed instead of holding the run forever.
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=30)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as http:
        yield http


async def drive(
    spec: RunSpec,
    stack: Stack,
    settings: Settings,
    w: Workloads,
    args: argparse.Namespace,
    key: str,
    warm_key: str,
    client: redis.Redis,
) -> dict[str, Any]:
    model = settings.model
    queue = QueueClient(settings)
    async with http_client(stack.base_url) as http:
        warm = {"Authorization": f"Bearer {warm_key}"}
        # First-call costs out of the way, under another key (another cache tenant), on every worker.
        await asyncio.gather(
            *(
                chat_turn(http, warm, model, [{"role": "user", "content": f"warm up {i}"}], 4)
                for i in range(2 * spec.workers)
            )
        )
        urls = list(stack.metrics_urls)
        before = [scrape_text((await http.get(u)).text) for u in urls]
        client.config_resetstat()
        cpu0 = redis_stats(client)["cpu_s"]
        timeline = Timeline()
        sampler = asyncio.create_task(sample(http, urls, queue, model, args.sample_every, timeline))
        headers = {"Authorization": f"Bearer {key}"}
        t0 = time.perf_counter()
        try:
            if spec.workload == MULTI_TURN:
                sent = await multi_turn(http, headers, model, w, args.start_spread)
            else:
                sent = await shared_prefix(http, headers, model, w, args.prefix_clients)
            duration = time.perf_counter() - t0
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        rstats = redis_stats(client)
        after = [scrape_text((await http.get(u)).text) for u in urls]
    queue.close()
    rstats["cpu_s"] = round(rstats["cpu_s"] - cpu0, 3)
    per_worker = [counter_deltas(b, a) for b, a in zip(before, after, strict=True)]
    return figures(spec, sent, duration, per_worker, rstats, key_sizes(client, settings), timeline, args)


def figures(
    spec: RunSpec,
    sent: list[Sent],
    duration: float,
    per_worker: list[dict[str, float]],
    rstats: dict[str, Any],
    sizes: dict[str, dict[str, float]],
    timeline: Timeline,
    args: argparse.Namespace,
) -> dict[str, Any]:
    results = [s.result for s in sent]
    out: dict[str, Any] = {"all": summarize(results, duration)}
    follow = [s.result for s in sent if s.turn > 0 and s.result.success]
    if follow:
        out["follow_up_ttft_ms"] = stats_ms([r.ttft for r in follow])
    by_turn: dict[int, list[float]] = {}
    for s in sent:
        if s.result.success:
            by_turn.setdefault(s.turn, []).append(s.result.ttft)
    out["ttft_p50_ms_by_turn"] = {t: round(1000 * float(np.median(v)), 1) for t, v in sorted(by_turn.items())}
    prompts: dict[int, list[int]] = {}
    for s in sent:
        if s.result.success:
            prompts.setdefault(s.turn, []).append(s.result.prompt_len)
    out["prompt_tokens_by_turn"] = {t: round(float(np.mean(v)), 1) for t, v in sorted(prompts.items())}
    queries = sum(p.get("engine_prefix_cache_queries", 0) for p in per_worker)
    hits = sum(p.get("engine_prefix_cache_hits", 0) for p in per_worker)
    prompt = sum(r.prompt_len for r in results if r.success)
    cached = [s.cached_tokens for s in sent if s.result.success]
    out["prefix"] = {
        "prompt_tokens": prompt,
        "queried_tokens": queries,  # the engine looks a prompt up again after a preemption or a stopped admission
        "hit_tokens": hits,
        "hit_rate": round(hits / queries, 4) if queries else None,
        "prefilled_tokens": queries - hits,
        "hit_rate_by_worker": [
            round(p.get("engine_prefix_cache_hits", 0) / q, 4) if (q := p.get("engine_prefix_cache_queries")) else None
            for p in per_worker
        ],
        # The server's own per-request count, where usage reports it: prompt tokens less those found cached.
        "usage_cached_tokens": sum(cached) if cached and None not in cached else None,
    }
    if out["prefix"]["usage_cached_tokens"] is not None:
        out["prefix"]["usage_prefilled_tokens"] = prompt - out["prefix"]["usage_cached_tokens"]
    requests = max(1, len(results))
    calls = sum(rstats["calls"].values())
    # The model's slot serves the queue's scripts (enqueue, pull, the prefix lookup) and the workers'
    # summary updates; everything else (tokens, request hashes) spreads over the request shards.
    slot_usec = sum(v for k, v in rstats["usec"].items() if k in SLOT_COMMANDS or k.startswith(("eval", "fcall")))
    out["redis"] = {
        "commands": calls,
        "commands_per_request": round(calls / requests, 1),
        "cpu_ms_per_request": round(1000 * rstats["cpu_s"] / requests, 3),
        "model_slot_ms_per_request": round(slot_usec / 1000 / requests, 4),
        "cpu_share": round(rstats["cpu_s"] / duration, 4),
        "commands_per_request_by_name": {
            k: round(v / requests, 2) for k, v in sorted(rstats["calls"].items(), key=lambda kv: -kv[1])
        },
        "usec_per_request_by_name": {
            k: round(v / requests, 1) for k, v in sorted(rstats["usec"].items(), key=lambda kv: -kv[1])
        },
        "keys_after": sizes,
    }
    out["workers_counters"] = per_worker
    names = sorted({k for p in per_worker for k in p if k.startswith("affinity_")})
    out["affinity_counters"] = {k.removeprefix("affinity_"): sum(p.get(k, 0) for p in per_worker) for k in names}
    out["idle_while_queued"] = idle_while_queued(timeline, args.sample_every)
    out["timeline"] = {"t": timeline.t, "held": timeline.held, "queued": timeline.queued}
    return out


# --- costs, targets ---------------------------------------------------------------------------------


def targets(runs: list[dict[str, Any]], steal_after_ms: float | None, period: float) -> list[dict[str, Any]]:
    """For each workload and worker count: affinity against its anchors from this same run."""
    find = {(r["workload"], r["mode"], r["workers"]): r for r in runs}
    out = []
    for (workload, mode, n), aff in find.items():
        if mode != AFFINITY or (workload, PLAIN, n) not in find:
            continue
        plain, single = find[(workload, PLAIN, n)], find.get((workload, SINGLE, 1))
        row: dict[str, Any] = {"workload": workload, "workers": n}
        hr = aff["prefix"]["hit_rate"] or 0.0
        if single and single["prefix"]["hit_rate"]:
            ratio = hr / single["prefix"]["hit_rate"]
            row["hit_rate_vs_single"] = {
                "affinity": hr,
                "plain": plain["prefix"]["hit_rate"],
                "single": single["prefix"]["hit_rate"],
                "ratio": round(ratio, 3),
                "plain_ratio": round((plain["prefix"]["hit_rate"] or 0.0) / single["prefix"]["hit_rate"], 3),
                "met": ratio >= HIT_RATE_TARGET,
            }
        pre = aff["prefix"]["prefilled_tokens"] / max(1, plain["prefix"]["prefilled_tokens"])
        row["prefilled_vs_plain"] = {"ratio": round(pre, 3), "met": pre < 1.0}
        for p in ("p50", "p99"):
            a, b = aff["all"]["ttft_ms"][p], plain["all"]["ttft_ms"][p]
            row[f"ttft_{p}_vs_plain"] = {"affinity_ms": a, "plain_ms": b, "ratio": round(a / b, 3), "met": a < b}
        tput = aff["all"]["output_throughput"] / plain["all"]["output_throughput"]
        row["throughput_vs_plain"] = {"ratio": round(tput, 3), "met": tput >= 1.0}
        idle = aff["idle_while_queued"]["longest_s"]
        if steal_after_ms is not None:
            bound = steal_after_ms / 1000 + period  # the sampling resolution on top of the bound
            row["idle_while_queued"] = {
                "longest_s": idle,
                "plain_longest_s": plain["idle_while_queued"]["longest_s"],
                "bound_s": round(bound, 3),
                "met": idle <= bound,
            }
        out.append(row)
    return out


def steal_bound_ms(settings: Settings) -> float | None:
    """The steal bound the stack runs with: the setting, where the settings have one."""
    value = getattr(settings, "affinity_steal_after_ms", None)
    return float(value) if value is not None else None


# --- main -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="inflightq bench affinity", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: INFLIGHTQ_MODEL")
    p.add_argument("--dtype", default=None, help="auto, float32, bfloat16 (default: INFLIGHTQ_DTYPE)")
    p.add_argument("--quick", action="store_true", help=f"smaller workloads: {QUICK}")
    p.add_argument("--workers", default="2,4", help="worker counts (each against plain pull)")
    p.add_argument("--workloads", default=f"{MULTI_TURN},{SHARED_PREFIX}")
    p.add_argument("--modes", default=f"{PLAIN},{AFFINITY}", help="placements run at each worker count")
    p.add_argument("--max-num-seqs", type=int, default=8, help="per worker: the pool fills, so work waits in Redis")
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=3072,
        help="KV blocks per worker, multi-turn: one worker holds every history",
    )
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-turn-len", type=int, default=300, help="tokens of a conversation's first user message")
    p.add_argument("--turn-len", type=int, default=100, help="tokens of each later user message")
    p.add_argument("--answer-len", type=int, default=32, help="tokens of each answer")
    p.add_argument("--start-spread", type=float, default=4.0, help="seconds over which conversations start")
    p.add_argument("--prefixes", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=1000, help="tokens of each shared system prompt")
    p.add_argument("--prefix-requests", type=int, default=96)
    p.add_argument("--suffix-len", type=int, default=32, help="tokens of each prefix request's own user message")
    p.add_argument("--prefix-answer-len", type=int, default=16)
    p.add_argument("--prefix-clients", type=int, default=16, help="closed-loop clients of the prefix requests")
    p.add_argument(
        "--prefix-kv-blocks",
        type=int,
        default=768,
        help="KV blocks per worker, shared prefixes (16 prompts take ~1,000)",
    )
    p.add_argument("--sample-every", type=float, default=0.25, help="seconds between samples of the workers' state")
    p.add_argument("--sim-workers", default="2,4,16,32,64", help="worker counts the simulation projects to")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkout", default="", help="run the stack's processes from this source tree (default: here)")
    p.add_argument(
        "--single-from",
        default="",
        help="an earlier result JSON of this benchmark (same box and settings) whose one-worker runs are this "
        "run's hit-rate anchors, instead of running them again (a run split over several commands)",
    )
    p.add_argument("--shared-redis", action="store_true", help="INFLIGHTQ_REDIS_URL instead of a private Redis")
    p.add_argument("--out", default="bench/results", help="folder for affinity-<date>.*; '' to skip writing")
    p.add_argument("--tag", default="")
    p.add_argument("--note", default="", help="a line about the machine's state, copied into the results")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    args.base_url = None  # a stack of our own (bench.serve's settings read this)
    return args


def plan(args: argparse.Namespace, have_single: frozenset[str] = frozenset()) -> list[RunSpec]:
    """One worker on each workload first (unless ``have_single`` has it), then per worker count and
    workload plain pull and affinity, alternating which goes first: a run cut short still has both
    workloads at the first worker count."""
    workloads = [x for x in args.workloads.split(",") if x]
    specs = [RunSpec(workload, SINGLE, 1) for workload in workloads if workload not in have_single]
    i = 0
    for n in (int(x) for x in args.workers.split(",")):
        for workload in workloads:
            modes = (PLAIN, AFFINITY) if i % 2 == 0 else (AFFINITY, PLAIN)
            specs += [RunSpec(workload, m, n) for m in modes if m in args.modes.split(",")]
            i += 1
    return specs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    stop_on_sigterm()
    from inflightq_cli.redis_server import PrivateRedis
    from shared.model_source import load_tokenizer

    server = None if args.shared_redis else PrivateRedis().start()
    settings = bench_settings(args)
    update: dict[str, Any] = {"max_num_seqs": args.max_num_seqs}
    if server is not None:
        update |= {"redis_url": server.url, "redis_cluster": False}
    settings = settings.model_copy(update=update)
    tokenizer = load_tokenizer(settings.model)
    w = make_workloads(tokenizer, args)
    shared, mean_prompt = prefix_shape(tokenizer, w)
    report = head(argv, settings)
    report |= {
        "note": args.note,
        "redis": "private" if server is not None else "shared",
        "steal_after_ms": steal_bound_ms(settings),
        "workloads": {
            MULTI_TURN: {
                "conversations": args.conversations,
                "turns": args.turns,
                "first_turn_len": args.first_turn_len,
                "turn_len": args.turn_len,
                "answer_len": args.answer_len,
                "start_spread": args.start_spread,
                "num_kv_blocks": settings.num_kv_blocks,
            },
            SHARED_PREFIX: {
                "prefixes": args.prefixes,
                "shared_prefix_tokens": shared,
                "prompt_tokens": mean_prompt,
                "requests": args.prefix_requests,
                "suffix_len": args.suffix_len,
                "answer_len": args.prefix_answer_len,
                "clients": args.prefix_clients,
                "num_kv_blocks": args.prefix_kv_blocks,
                "blocks_for_every_prefix": args.prefixes * (shared // settings.block_size),
            },
        },
        "runs": [],
    }
    from bench.affinity_report import print_targets, write

    if args.single_from:
        earlier = json.loads(Path(args.single_from).read_text())
        for run in earlier["runs"]:
            if run["mode"] == SINGLE and run["workload"] in args.workloads.split(","):
                report["runs"].append(run | {"from": Path(args.single_from).name})
    have_single = frozenset(r["workload"] for r in report["runs"] if r["mode"] == SINGLE)
    try:
        for spec in plan(args, have_single):
            print(f"run: {spec.workload}, {spec.mode}, {spec.workers} worker(s)", flush=True)
            row = run_one(spec, settings, w, args)
            report["runs"].append(row)
            print_row(row)
            if args.out:  # the runs so far, in case the rest is cut short
                report["targets"] = targets(report["runs"], report["steal_after_ms"], args.sample_every)
                write(report, Path(args.out), tag=args.tag)
    finally:
        if server is not None:
            server.stop()
    report["costs"] = fit_costs(report["runs"], min(int(x) for x in args.workers.split(",")))
    report["targets"] = targets(report["runs"], report["steal_after_ms"], args.sample_every)
    from bench.affinity_sim import project

    report["projection"] = project(report, [int(x) for x in args.sim_workers.split(",")], seed=args.seed)
    print_targets(report)
    if args.out:
        write(report, Path(args.out), tag=args.tag)
    return report


def head(argv: list[str] | None, settings: Settings) -> dict[str, Any]:
    """The command (with the INFLIGHTQ_ settings the stack started with), when, where, model and engine."""
    args = argv if argv is not None else sys.argv[1:]
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("INFLIGHTQ_") and "URL" not in k)
    return {
        "command": f"{env} inflightq bench affinity {shlex.join(args)}".strip(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": settings.model,
        "dtype": settings.dtype,
        "engine": {k: getattr(settings, k) for k in (*ENGINE_KEYS, "torch_threads")},
    }


def print_row(row: dict[str, Any]) -> None:
    a, p = row["all"], row["prefix"]
    print(
        f"  {a['completed']}/{a['requests']} ok, {a['output_throughput']} tok/s, TTFT p50/p99 "
        f"{a['ttft_ms']['p50']:.0f}/{a['ttft_ms']['p99']:.0f} ms, hit rate {p['hit_rate']}, prefilled "
        f"{p['prefilled_tokens']:.0f}, redis {row['redis']['commands_per_request']} cmd/request, longest idle "
        f"while queued {row['idle_while_queued']['longest_s']} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
