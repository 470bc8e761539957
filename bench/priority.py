"""``inflightq bench priority``: do priorities act when the pool is full? (issue 21)

One run, one stack (``inflightq api`` + one ``inflightq worker`` with its metrics port, on Redis under
a key prefix of its own), the serving benchmark's seeded chat prompts, every request streamed through
the API (/v1/chat/completions by default):

1. calibration: ``--calibration-requests`` background requests at once; the pool's saturation
   throughput is the output token rate while the queue still held work, in requests/s of this
   workload (``--saturation-rps`` skips it);
2. idle: each urgent request alone on the idle stack, at priority 0 (the SLO's reference);
3. priority: the mixed load. The pool starts full (``max_num_seqs`` background requests at once),
   then Poisson arrivals at ``--overload`` (1.2) x saturation; ~5% of requests (``--urgent-share``)
   are the urgent class at priority 0, the rest background at priority 2 or 3;
4. fcfs: the same requests on the same schedule, every one at priority 3 (what TGI and vLLM do by
   default). Every request is background here, so it is also the all-background run the background
   throughput is compared with;
5. transformers' continuous batching (FCFS, in this process, no HTTP) on the first
   ``--transformers-requests`` requests of the same schedule: it is several times slower than the
   engine, so the full load would take it most of an hour.

Reported per class: TTFT p50/p90/p99, TPOT, SLO goodput (TTFT <= 2x and TPOT <= 2x the idle urgent
p99, both met, as ``vllm bench serve --goodput`` counts), output throughput; from the worker's
/metrics: engine steps, steps stopped for an urgent arrival (and the forward time they had spent),
preemptions by reason (per minute) and recomputed tokens; sampled each second:
running sequences and queue depth. Writes bench/results/priority-<date>[-tag].{json,md,png}.

    python -m bench.priority --quick            # or: inflightq bench priority --quick
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.serve import ENGINE_KEYS, Runner, bench_settings, checkpoint, quiet_policy, report_head, stop_on_sigterm
from bench.serve_clients import run_load
from bench.serve_dataset import ChatSample, synthetic_chat
from bench.serve_metrics import RequestResult, print_summary, summarize
from bench.serve_stack import Quiet, Stack, measure
from shared.async_client import AsyncQueueClient
from shared.settings import Settings

URGENT, BACKGROUND = "urgent", "background"
URGENT_PRIORITY, BACKGROUND_PRIORITIES, FCFS_PRIORITY = 0, (2, 3), 3
SLO_FACTOR = 2.0  # the SLO: TTFT and TPOT each within this factor of the idle urgent p99
TARGET_TTFT_RATIO, TARGET_THROUGHPUT_RATIO = 2.0, 0.9
QUICK = {"num_requests": 80, "calibration_requests": 80, "transformers_requests": 6}
PARTIAL = Path(tempfile.gettempdir()) / "inflightq-bench-priority-partial.json"
FULL = {"num_requests": 200, "calibration_requests": 96, "transformers_requests": 24}


@dataclass(frozen=True)
class Request:
    sample: ChatSample
    klass: str
    priority: int  # in the priority run; the FCFS runs send every request at FCFS_PRIORITY
    offset: float  # seconds from the start of the run


@dataclass
class Sampled:
    """The pool's state each second of a run: the worker's gauges and the model's queue depth."""

    t: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    queued: list[int] = field(default_factory=list)


def mixed_load(samples: list[ChatSample], *, burst: int, rate: float, urgent_share: float, seed: int) -> list[Request]:
    """``burst`` background requests at t=0 (the pool starts full), the rest on a Poisson clock at
    ``rate``; of those, ``urgent_share`` of all requests (at least one) are urgent, at random places."""
    rng = random.Random(seed)
    burst = min(burst, len(samples) - 1)
    later = list(range(burst, len(samples)))
    n_urgent = min(len(later), max(1, round(urgent_share * len(samples))))
    urgent = set(rng.sample(later, n_urgent))
    out, t = [], 0.0
    for i, sample in enumerate(samples):
        if i >= burst:
            t += rng.expovariate(rate)
        if i in urgent:
            out.append(Request(sample, URGENT, URGENT_PRIORITY, t))
        else:
            out.append(Request(sample, BACKGROUND, rng.choice(BACKGROUND_PRIORITIES), t))
    return out


class PoolWatch:
    """Scrapes the worker's /metrics (counters before and after a run, gauges each second) and the queue depth."""

    def __init__(self, metrics_url: str | None, settings: Settings) -> None:
        self.url, self.settings = metrics_url, settings

    async def scrape(self, http: httpx.AsyncClient) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        if self.url is None:
            return {}
        text = (await http.get(self.url, timeout=10)).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                name = s.name.removeprefix("inflightq_worker_")
                if name.endswith(("_bucket", "_created")):
                    continue
                label = s.labels.get("reason") or (f"p{s.labels['priority']}" if "priority" in s.labels else None)
                out[f"{name}:{label}" if label else name] = s.value
        return out

    async def sample(self, http: httpx.AsyncClient, queue: AsyncQueueClient, into: Sampled, t0: float) -> None:
        while True:
            try:
                gauges = await self.scrape(http)
                depth = await queue.queue_depth(self.settings.model)
            except (httpx.HTTPError, OSError):
                gauges, depth = {}, {}
            into.t.append(round(time.perf_counter() - t0, 2))
            into.running.append(gauges.get("running_requests", math.nan))
            into.waiting.append(gauges.get("waiting_requests", math.nan))
            into.queued.append(sum(depth.values()))
            await asyncio.sleep(1.0)


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    keys = (
        "engine_steps_total",
        "engine_preemptions_total",
        "engine_preemptions_by_reason_total:urgency",
        "engine_preemptions_by_reason_total:kv_blocks",
        "engine_recomputed_tokens_total",
        "generated_tokens_total",
        "engine_step_seconds_total",
        "engine_interrupted_steps_total",
        "engine_interrupted_seconds_total",
    )
    out = {k.removesuffix("_total").replace("_total:", ":"): after.get(k, 0) - before.get(k, 0) for k in keys}
    # The worker's own split of each priority's TTFT: waiting in Redis, then in the engine until the first token.
    for hist in ("time_in_queue_seconds", "time_to_first_token_seconds"):
        for key in sorted(k for k in after if k.startswith(f"{hist}_count:")):
            level = key.split(":")[1]
            count = after[key] - before.get(key, 0)
            total = after[f"{hist}_sum:{level}"] - before.get(f"{hist}_sum:{level}", 0)
            if count:
                out[f"mean_{hist.removesuffix('_seconds')}_ms:{level}"] = round(1000 * total / count, 1)
    return out


async def drive(
    runner: Runner, watch: PoolWatch, endpoint: str, load: list[Request], fcfs: bool
) -> tuple[list[RequestResult], list[float], float, dict[str, float], Sampled]:
    """One run of ``load`` through ``endpoint``: results and send times (in load order), wall time,
    the worker's counter deltas and the pool's state sampled each second."""
    async with runner._clients() as (http, queue):
        senders = {
            p: runner._sender(endpoint, http, queue, p)
            for p in ({FCFS_PRIORITY} if fcfs else {r.priority for r in load})
        }
        index = {id(r.sample): i for i, r in enumerate(load)}
        sent = [0.0] * len(load)
        t0 = time.perf_counter()

        async def send(sample: ChatSample) -> RequestResult:
            i = index[id(sample)]
            sent[i] = time.perf_counter() - t0
            return await senders[FCFS_PRIORITY if fcfs else load[i].priority](sample)

        before = await watch.scrape(http)
        sampled = Sampled()
        sampler = asyncio.create_task(watch.sample(http, queue, sampled, t0))
        try:
            results, duration = await run_load(send, [r.sample for r in load], offsets=[r.offset for r in load])
        finally:
            sampler.cancel()
        after = await watch.scrape(http)
    return results, sent, duration, counter_deltas(before, after), sampled


def tpot(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.success and r.output_tokens > 1 else None


def goodput(results: list[RequestResult], slo: dict[str, float]) -> dict[str, Any]:
    """vllm bench serve --goodput: the share of requests meeting every SLO (TTFT and TPOT, in ms)."""
    good = 0
    for r in results:
        t = tpot(r)
        if r.success and r.ttft * 1000 <= slo["ttft_ms"] and (t is None or t * 1000 <= slo["tpot_ms"]):
            good += 1
    return {"good": good, "requests": len(results), "share": round(good / len(results), 3) if results else math.nan}


def by_class(
    load: list[Request], results: list[RequestResult], duration: float, slo: dict[str, float] | None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for klass in (URGENT, BACKGROUND):
        mine = [res for req, res in zip(load, results, strict=True) if req.klass == klass]
        if not mine:
            continue
        out[klass] = summarize(mine, duration)
        if slo:
            out[klass]["goodput"] = goodput(mine, slo)
    return out


def pool_summary(sampled: Sampled, max_num_seqs: int) -> dict[str, Any]:
    running = [r for r in sampled.running if not math.isnan(r)]
    # The worker's slots are its engine's sequences, prefilling, decoding or waiting for a prefill
    # turn (the engine's waiting list): the pool is full when they number max_num_seqs, even while
    # the prefill cap keeps some of them out of the running list.
    held = [r + w for r, w in zip(sampled.running, sampled.waiting, strict=True) if not math.isnan(r + w)]
    return {
        "samples": len(sampled.t),
        "full_share": round(sum(1 for h in held if h >= max_num_seqs) / len(held), 3) if held else None,
        "mean_held": round(sum(held) / len(held), 1) if held else None,
        "mean_running": round(sum(running) / len(running), 1) if running else None,
        "mean_queued": round(sum(sampled.queued) / len(sampled.queued), 1) if sampled.queued else None,
        "max_queued": max(sampled.queued, default=None),
        "series": {"t": sampled.t, "running": sampled.running, "waiting": sampled.waiting, "queued": sampled.queued},
    }


def saturation(results: list[RequestResult], sent: list[float], mean_output: float) -> dict[str, Any]:
    """Output tokens per second while the queue still held work (from the first request's end to the
    last request's first token), and that rate in requests per second of this workload."""
    ends = [s + r.latency for s, r in zip(sent, results, strict=True) if r.success]
    firsts = [s + r.ttft for s, r in zip(sent, results, strict=True) if r.success]
    lo, hi = min(ends), max(firsts)
    tokens = 0
    for s, r in zip(sent, results, strict=True):
        t = s + r.ttft
        for gap in [0.0, *r.itl]:
            t += gap
            tokens += lo <= t <= hi
    if hi - lo < 5.0 or tokens < 50:  # too short a window: the whole run's rate instead
        total = sum(r.output_tokens for r in results)
        lo, hi, tokens = 0.0, max(ends), total
    tok_s = tokens / (hi - lo)
    return {
        "window_s": [round(lo, 2), round(hi, 2)],
        "output_tok_s": round(tok_s, 2),
        "requests_per_s": round(tok_s / mean_output, 4),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="inflightq bench priority", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: INFLIGHTQ_MODEL")
    p.add_argument("--dtype", default=None, help="auto, float32, bfloat16 (default: INFLIGHTQ_DTYPE)")
    p.add_argument("--quick", action="store_true", help="a few minutes: {num_requests} requests etc.".format(**QUICK))
    p.add_argument("--num-requests", type=int, default=None, help=f"mixed load (default {FULL['num_requests']})")
    p.add_argument("--calibration-requests", type=int, default=None, help=f"default {FULL['calibration_requests']}")
    p.add_argument("--saturation-rps", type=float, default=None, help="skip calibration: the pool's requests/s")
    p.add_argument("--overload", type=float, default=1.2, help="offered background load / saturation")
    p.add_argument("--urgent-share", type=float, default=0.05)
    p.add_argument("--input-len", default="50,500", help="prompt tokens, min,max (uniform)")
    p.add_argument("--output-len", default="10,200", help="new tokens, min,max (uniform; ignore_eos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--endpoint", default="chat", choices=("chat", "generate_stream", "queue"))
    p.add_argument("--max-num-seqs", type=int, default=None, help="per worker (default INFLIGHTQ_MAX_NUM_SEQS)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per engine (default 3072)")
    p.add_argument("--transformers-requests", type=int, default=None, help="0 = skip transformers' CB")
    p.add_argument("--skip-fcfs", action="store_true")
    p.add_argument("--no-wait", action="store_true", help="do not wait for other benchmarks to finish")
    p.add_argument("--max-wait", type=float, default=300.0, help="seconds to wait for other benchmarks, per run")
    p.add_argument("--retries", type=int, default=0, help="measure again when another benchmark ran alongside")
    p.add_argument("--out", default="bench/results", help="folder for priority-<date>.*; '' to skip writing")
    p.add_argument("--tag", default="", help="name files priority-<date>-<tag>.*")
    p.add_argument("--note", default="", help="a line about the machine's state, copied into the results")
    p.set_defaults(base_url=None)  # always a stack of its own (bench.serve's settings read this)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    stop_on_sigterm()
    from shared.model_source import load_tokenizer

    sizes = QUICK if args.quick else FULL
    num = args.num_requests or sizes["num_requests"]
    n_cal = args.calibration_requests or sizes["calibration_requests"]
    n_tf = sizes["transformers_requests"] if args.transformers_requests is None else args.transformers_requests
    settings = bench_settings(args)
    if args.max_num_seqs:
        settings = settings.model_copy(update={"max_num_seqs": args.max_num_seqs})
    lo_in, hi_in = map(int, args.input_len.split(","))
    lo_out, hi_out = map(int, args.output_len.split(","))
    tokenizer = load_tokenizer(settings.model)
    samples = synthetic_chat(tokenizer, num, input_len=(lo_in, hi_in), output_len=(lo_out, hi_out), seed=args.seed)
    # Calibration prompts are drawn apart (another seed), so the measured runs meet none of them in the cache.
    calibration = synthetic_chat(
        tokenizer, n_cal, input_len=(lo_in, hi_in), output_len=(lo_out, hi_out), seed=args.seed + 1000
    )
    warm = synthetic_chat(tokenizer, 4, input_len=(40, 60), output_len=(4, 4), seed=args.seed + 1)
    engine_keys = (*ENGINE_KEYS, "urgent_poll_s", "torch_threads")
    report = report_head("inflightq bench priority", argv, settings, samples, args, engine_keys)
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("INFLIGHTQ_") and "URL" not in k)
    report["command"] = f"{env} {report['command']}".strip()  # the settings the stack was started with, too
    report |= {"note": args.note, "endpoint": args.endpoint, "runs": {}}
    keys = [f"bench-{uuid.uuid4().hex[:12]}" for _ in range(64)]
    stack = Stack(settings, keys, worker_metrics=True)
    try:
        stack.start(workers=1)
        own = {c.pid for c in [stack.api, *stack.workers] if c is not None}
        policy = quiet_policy(args)
        runner = Runner(settings, stack.base_url, keys, policy.with_own(own) if policy else None)
        watch = PoolWatch(stack.metrics_urls[0] if stack.metrics_urls else None, settings)
        load = run_stack_phases(runner, watch, args, report, samples, calibration, warm, num)
    finally:
        stack.stop()
    if n_tf:
        report["runs"]["transformers_cb"] = run_transformers(settings, report, load[:n_tf], runner.quiet)
    report["targets"] = targets(report)
    print_targets(report)
    if args.out:
        from bench.priority_report import write

        write(report, Path(args.out), tag=args.tag)
    return report


def run_stack_phases(
    runner: Runner,
    watch: PoolWatch,
    args: argparse.Namespace,
    report: dict[str, Any],
    samples: list[ChatSample],
    calibration: list[ChatSample],
    warm: list[ChatSample],
    num: int,
) -> list[Request]:
    """Calibration, idle, priority and FCFS runs on the stack; returns the mixed load."""
    settings, runs = runner.settings, report["runs"]
    asyncio.run(runner.run(args.endpoint, warm))
    mean_output = sum(s.output_len for s in samples) / len(samples)
    if args.saturation_rps:
        report["saturation"] = {"requests_per_s": args.saturation_rps, "given": True}
    else:
        cal = [Request(s, BACKGROUND, FCFS_PRIORITY, 0.0) for s in calibration]
        (results, sent, duration, counters, sampled), _ = measure(
            lambda _: asyncio.run(drive(runner, watch, args.endpoint, cal, fcfs=True)), runner.quiet, "calibration"
        )
        runs["calibration"] = {"all": summarize(results, duration), "worker": counters}
        runs["calibration"]["pool"] = pool_summary(sampled, settings.max_num_seqs)
        report["saturation"] = saturation(results, sent, mean_output)
        print_summary("calibration: background requests all at once", runs["calibration"]["all"])
    rate = args.overload * report["saturation"]["requests_per_s"]
    load = mixed_load(samples, burst=settings.max_num_seqs, rate=rate, urgent_share=args.urgent_share, seed=args.seed)
    report["workload"] = {
        "requests": len(load),
        "urgent": sum(r.klass == URGENT for r in load),
        "background": sum(r.klass == BACKGROUND for r in load),
        "burst": min(settings.max_num_seqs, num - 1),
        "offered_rate_req_s": round(rate, 4),
        "overload": args.overload,
        "priorities": {URGENT: URGENT_PRIORITY, BACKGROUND: list(BACKGROUND_PRIORITIES), "fcfs": FCFS_PRIORITY},
        "urgent_offsets_s": [round(r.offset, 2) for r in load if r.klass == URGENT],
    }
    print(f"saturation {report['saturation']}; offered {rate:.3f} req/s; {report['workload']['urgent']} urgent")
    checkpoint(report, PARTIAL)

    urgent = [r for r in load if r.klass == URGENT]
    idle = [Request(r.sample, URGENT, URGENT_PRIORITY, 0.0) for r in urgent]

    async def one_at_a_time() -> tuple[list[RequestResult], float]:
        busy, results = 0.0, []
        async with runner._clients() as (http, queue):
            send = runner._sender(args.endpoint, http, queue, URGENT_PRIORITY)
            for r in idle:
                await asyncio.sleep(0.3)
                started = time.perf_counter()
                results.append(await send(r.sample))
                busy += time.perf_counter() - started
        return results, busy

    (results, busy), _ = measure(lambda _: asyncio.run(one_at_a_time()), runner.quiet, "idle")
    runs["idle"] = {"classes": {URGENT: summarize(results, busy)}}
    print_summary("urgent requests, each alone on the idle stack", runs["idle"]["classes"][URGENT])
    idle_m = runs["idle"]["classes"][URGENT]
    report["slo"] = {
        "ttft_ms": round(SLO_FACTOR * idle_m["ttft_ms"]["p99"], 1),
        "tpot_ms": round(SLO_FACTOR * idle_m["tpot_ms"]["p99"], 1),
        "definition": f"TTFT and TPOT each <= {SLO_FACTOR}x the idle urgent p99 (both met: good)",
    }
    report["idle_ttft_by_prompt_ms"] = [round(r.ttft * 1000, 1) for r in results]

    for name, fcfs in (("priority", False), ("fcfs", True)):
        if fcfs and args.skip_fcfs:
            continue
        load_before = os.getloadavg()[0]
        (results, sent, duration, counters, sampled), contended = measure(
            lambda _, fcfs=fcfs: asyncio.run(drive(runner, watch, args.endpoint, load, fcfs)), runner.quiet, name
        )
        row: dict[str, Any] = {
            "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "classes": by_class(load, results, duration, report["slo"]),
            "all": summarize(results, duration),
            "worker": counters,
            "pool": pool_summary(sampled, settings.max_num_seqs),
            "urgent_sent_s": [round(s, 2) for s, r in zip(sent, load, strict=True) if r.klass == URGENT],
            "urgent_ttft_ms": [round(x.ttft * 1e3, 1) for x, r in zip(results, load, strict=True) if r.klass == URGENT],
        }
        minutes = duration / 60
        row["worker"]["preemptions_per_min"] = round(row["worker"].get("engine_preemptions", 0) / minutes, 2)
        if contended:
            row["contended_by"] = contended
        runs[name] = row
        for klass, m in row["classes"].items():
            print_summary(f"{name}: {klass}", m)
        print(f"{name}: worker {row['worker']}; pool full {row['pool']['full_share']}", flush=True)
        checkpoint(report, PARTIAL)
    return load


def run_transformers(
    settings: Settings, report: dict[str, Any], load: list[Request], quiet: Quiet | None
) -> dict[str, Any]:
    """The first requests of the mixed load on the same schedule, through transformers' CB (FCFS)."""
    from bench.serve_anchors import transformers_cb_online
    from worker.engine_config import settings_dtype

    w = report["workload"]
    dtype = settings_dtype(settings)
    if settings.torch_threads:  # the threads the worker had (INFLIGHTQ_TORCH_THREADS), for a like-for-like anchor
        import torch

        torch.set_num_threads(settings.torch_threads)
    (results, duration), contended = measure(
        lambda _: transformers_cb_online(settings, dtype, [r.sample for r in load], [r.offset for r in load]),
        quiet,
        "transformers CB",
    )
    row: dict[str, Any] = {
        "variant": f"the first {len(load)} of the {w['requests']} requests, same schedule, FCFS, in process",
        "classes": by_class(load, results, duration, report.get("slo")),
        "all": summarize(results, duration),
        "dtype": str(dtype).replace("torch.", ""),
    }
    # FCFS: an urgent request is served as any other, so every request's TTFT estimates what an urgent one meets.
    row["all"]["goodput"] = goodput(results, report["slo"]) if report.get("slo") else None
    if contended:
        row["contended_by"] = contended
    print_summary("transformers CB (FCFS): all requests", row["all"])
    return row


def targets(report: dict[str, Any]) -> dict[str, Any]:
    runs, out = report["runs"], {}
    idle = runs.get("idle", {}).get("classes", {}).get(URGENT)
    prio = runs.get("priority", {}).get("classes", {})
    if idle and URGENT in prio:
        ratio = prio[URGENT]["ttft_ms"]["p99"] / idle["ttft_ms"]["p99"]
        out["urgent_p99_ttft_vs_idle_p99"] = {
            "loaded_ms": prio[URGENT]["ttft_ms"]["p99"],
            "idle_ms": idle["ttft_ms"]["p99"],
            "ratio": round(ratio, 3),
            "target": TARGET_TTFT_RATIO,
            "met": ratio <= TARGET_TTFT_RATIO,
            "pool_full_share": runs["priority"]["pool"]["full_share"],
        }
    if BACKGROUND in prio and "fcfs" in runs:
        bg = prio[BACKGROUND]["output_throughput"]
        all_bg = runs["fcfs"]["all"]["output_throughput"]
        out["background_throughput_vs_all_background"] = {
            "background_tok_s": bg,
            "all_background_tok_s": all_bg,
            "ratio": round(bg / all_bg, 3),
            "target": TARGET_THROUGHPUT_RATIO,
            "met": bg / all_bg >= TARGET_THROUGHPUT_RATIO,
            "total_tok_s_priority_vs_fcfs": round(runs["priority"]["all"]["output_throughput"] / all_bg, 3),
        }
    return out


def print_targets(report: dict[str, Any]) -> None:
    for name, t in report["targets"].items():
        print(f"{name}: ratio {t['ratio']} (target {t['target']}): {'met' if t['met'] else 'NOT met'}", flush=True)


if __name__ == "__main__":
    main()
