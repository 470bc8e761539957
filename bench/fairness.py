"""``inflightq bench fairness``: does a tenant flooding the pool leave a light tenant its share? (issue 49)

One run, per setup (``--setups``: one worker, two workers, two workers on a private Redis Cluster), the
real stack (``inflightq api`` + workers with their metrics ports, under a key prefix of its own), the
serving benchmark's seeded chat prompts streamed through /v1/chat/completions, every request at the
same priority, each tenant an API key of its own (a fresh key per phase: the engine salts the prefix
cache by tenant, so no phase reuses another's KV blocks):

1. calibration: ``slots`` requests at once (every sequence the workers hold); the pool's saturation
   throughput in requests/s of this workload, as ``bench priority`` measures it;
2. idle: tenant B's requests, each alone on the idle stack (B's reference TTFT);
3. flood, fair share: tenant A keeps ``--flood-factor`` x ``slots`` requests in flight for
   ``--flood-s`` (as each ends it sends the next: a backlog of (factor - 1) x slots that never drains),
   tenant B sends Poisson arrivals at ``--light-share`` (0.2) x saturation after ``--warmup-s``;
4. flood, FCFS: the same load on a stack whose processes run with fair share off (``FCFS_ENV``; one
   stream per priority), A's and B's requests under one API key, so that neither the queue nor the
   engine's fair displacement tells them apart: today's first come, first served;
5. weights: tenants of weight 3 and 1 each keep ``--weights-factor`` x ``slots`` requests in flight for
   ``--weights-s``; tokens served (prompt + output, the counter fair share charges) from
   ``--weights-settle-s`` (past the pool's first fill) to the end.

With ``--rounds N`` the two floods take turns N times, each on a fresh stack, and each round's B arrivals
are its own (seed + round): B's TTFTs and the output throughput are pooled over the rounds, so a drift of the
machine over the run falls on both, and B's p99 comes from N times as many requests.

A phase's in-flight requests after its window are cancelled (the client closes its stream) once B's
have all had their first token; the next phase starts on an idle pool. Reported per setup: B's TTFT
p99 under flood / idle (fair and FCFS), all output tokens/s in the flood window (fair / FCFS), the
weighted tenants' tokens ratio. Writes bench/results/fairness-<date>[-tag].{json,md,png}.

    python -m bench.fairness --flood-s 10 --weights-s 10     # or: inflightq bench fairness ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.fairness_report import (
    HEAVY,
    LIGHT,
    TARGET_THROUGHPUT_RATIO,
    TARGET_TTFT_RATIO,
    TARGET_WEIGHT_ERROR,
    A,
    B,
)
from bench.priority import saturation
from bench.serve import ENGINE_KEYS, bench_settings, checkpoint, report_head, stop_on_sigterm
from bench.serve_clients import chat_sender
from bench.serve_dataset import ChatSample, synthetic_chat
from bench.serve_metrics import RequestResult, print_summary, summarize
from bench.serve_stack import Stack
from shared.settings import Settings

WEIGHTS = {HEAVY: 3.0, LIGHT: 1.0}
# The settings that turn fair share off for every process of a stack (today's FCFS pull: one stream per
# priority). Empty: the anchor's one tenant alone keeps its requests in one FIFO lane.
FCFS_ENV: dict[str, str] = {"INFLIGHTQ_FAIR_SHARE": "false"}
SETUPS = ("standalone:1", "standalone:2", "cluster:2")
PARTIAL = Path("/tmp/inflightq-bench-fairness-partial.json")
IDLE_WAIT_S = 180.0


def key_spec(secret: str, weight: float) -> str:
    """An INFLIGHTQ_API_KEYS entry: the key and its fair-share weight (no priority ceiling, no rate limit)."""
    return f"{secret}:weight={weight:g}"


@dataclass
class Sent:
    """One request of a phase: its tenant, when it was sent (s from the phase's start) and what came back."""

    tenant: str
    at: float
    result: RequestResult

    def token_times(self) -> list[float]:
        """When each token arrived, in s from the phase's start."""
        if not self.result.output_tokens:
            return []
        times = [self.at + self.result.ttft]
        for gap in self.result.itl:
            times.append(times[-1] + gap)
        return times


@dataclass
class Phase:
    sent: list[Sent] = field(default_factory=list)
    cancelled: int = 0  # requests in flight at the window's end, cancelled by closing their streams
    preemptions: dict[str, float] = field(default_factory=dict)  # the workers' preemptions by reason in the phase
    engine: dict[str, float] = field(default_factory=dict)  # the workers' engine counters' growth in the phase

    def of(self, tenant: str) -> list[RequestResult]:
        return [s.result for s in self.sent if s.tenant == tenant]


class TenantKeys:
    """A fresh API key per tenant and phase, all given to the stack at its start."""

    def __init__(self, phases: list[tuple[str, str, float]]) -> None:
        self.secrets = {(phase, tenant): f"fair-{uuid.uuid4().hex[:16]}" for phase, tenant, _ in phases}
        self.specs = [key_spec(self.secrets[(p, t)], w) for p, t, w in phases]

    def headers(self, phase: str, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secrets[(phase, tenant)]}"}


def phase_keys() -> list[tuple[str, str, float]]:
    out = [("warm", A, 1.0), ("calibration", A, 1.0), ("idle", B, 1.0), ("fair", A, 1.0), ("fair", B, 1.0)]
    out += [("fcfs", "one", 1.0)]
    out += [("weights", t, w) for t, w in WEIGHTS.items()]
    return out


class Samples:
    """Each tenant's seeded prompts, drawn in order (a fresh supply per tenant and phase)."""

    def __init__(self, tokenizer: Any, args: argparse.Namespace) -> None:
        self.tokenizer, self.args = tokenizer, args
        self.input_len = tuple(map(int, args.input_len.split(",")))
        self.output_len = tuple(map(int, args.output_len.split(",")))
        self.seeds = itertools.count(args.seed)

    def draw(self, n: int) -> list[ChatSample]:
        return synthetic_chat(
            self.tokenizer, n, input_len=self.input_len, output_len=self.output_len, seed=next(self.seeds)
        )  # type: ignore[arg-type]

    def endless(self, chunk: int) -> Iterator[ChatSample]:
        while True:
            yield from self.draw(chunk)


async def closed_loop(
    send: Any, tenant: str, samples: Iterator[ChatSample], in_flight: int, until: float, t0: float, into: Phase
) -> None:
    """``in_flight`` requests at a time: as one ends the next is sent, until ``until`` (perf_counter)."""

    async def lane() -> None:
        while time.perf_counter() < until:
            sample = next(samples)
            entry = Sent(tenant, time.perf_counter() - t0, RequestResult(sample.prompt_len, sample.output_len))
            into.sent.append(entry)
            try:
                await send(sample, entry.result)
            except asyncio.CancelledError:
                into.cancelled += 1
                raise

    await asyncio.gather(*(lane() for _ in range(in_flight)))


async def poisson(
    send: Any, tenant: str, samples: list[ChatSample], offsets: list[float], t0: float, into: Phase
) -> None:
    async def one(sample: ChatSample, offset: float) -> None:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        entry = Sent(tenant, time.perf_counter() - t0, RequestResult(sample.prompt_len, sample.output_len))
        into.sent.append(entry)
        await send(sample, entry.result)

    await asyncio.gather(*(one(s, o) for s, o in zip(samples, offsets, strict=True)))


def arrivals(rate: float, start: float, end: float, seed: int) -> list[float]:
    rng, out, t = random.Random(seed), [], start
    while (t := t + rng.expovariate(rate)) < end:
        out.append(t)
    return out or [start]


class Bench:
    """One setup's stack and its phases."""

    def __init__(
        self, args: argparse.Namespace, settings: Settings, stack: Stack, keys: TenantKeys, samples: Samples
    ) -> None:
        self.args, self.settings, self.stack, self.keys, self.samples = args, settings, stack, keys, samples

    @property
    def slots(self) -> int:
        return len(self.stack.workers) * self.settings.max_num_seqs

    @contextlib.asynccontextmanager
    async def http(self) -> Any:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(
            base_url=self.stack.base_url, limits=limits, timeout=httpx.Timeout(None, connect=30)
        ) as http:
            yield http

    def sender(self, http: httpx.AsyncClient, phase: str, tenant: str) -> Any:
        return chat_sender(http, self.keys.headers(phase, tenant), self.settings.model)

    async def at_once(self, phase: str, tenant: str, samples: list[ChatSample]) -> tuple[Phase, float]:
        out = Phase()
        async with self.http() as http:
            t0 = time.perf_counter()
            await poisson(self.sender(http, phase, tenant), tenant, samples, [0.0] * len(samples), t0, out)
        return out, time.perf_counter() - t0

    def restart(self, stack: Stack, extra_env: dict[str, str] | None = None) -> Stack:
        """The stack's processes stopped and started again (fair share off with ``FCFS_ENV``), warmed as the
        first was: every flood starts on a fresh, warm stack with nothing cached."""
        workers = len(stack.workers)
        stack.stop()
        self.stack = Stack(self.settings, self.keys.specs, worker_metrics=True, extra_env=extra_env or {})
        self.stack.start(workers=workers)
        asyncio.run(self.at_once("warm", A, self.samples.draw(4)))
        return self.stack

    async def one_at_a_time(self, samples: list[ChatSample]) -> tuple[list[RequestResult], float]:
        busy, results = 0.0, []
        async with self.http() as http:
            send = self.sender(http, "idle", B)
            for sample in samples:
                await asyncio.sleep(0.3)
                started = time.perf_counter()
                results.append(await send(sample))
                busy += time.perf_counter() - started
        return results, busy

    async def flood(self, phase: str, light: list[ChatSample], offsets: list[float]) -> Phase:
        """A's closed loop for ``flood_s``; B's Poisson arrivals; A's leftovers cancelled once B is done."""
        out, args = Phase(), self.args
        one_tenant = phase == "fcfs"
        before = await self.worker_counters()
        async with self.http() as http:
            send_a = self.sender(http, phase, "one" if one_tenant else A)
            send_b = self.sender(http, phase, "one" if one_tenant else B)
            t0 = time.perf_counter()
            heavy = asyncio.create_task(
                closed_loop(
                    send_a,
                    A,
                    self.samples.endless(256),
                    round(args.flood_factor * self.slots),
                    t0 + args.flood_s,
                    t0,
                    out,
                )
            )
            await poisson(send_b, B, light, offsets, t0, out)
            await asyncio.sleep(max(0.0, t0 + args.flood_s - time.perf_counter()))
            heavy.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heavy
        await self.wait_idle()
        out.preemptions, out.engine = counted(before, await self.worker_counters())
        return out

    async def weights(self) -> Phase:
        out, args = Phase(), self.args
        in_flight = round(args.weights_factor * self.slots)
        before = await self.worker_counters()
        async with self.http() as http:
            t0 = time.perf_counter()
            loops = [
                asyncio.create_task(
                    closed_loop(
                        self.sender(http, "weights", tenant),
                        tenant,
                        self.samples.endless(256),
                        in_flight,
                        t0 + args.weights_s,
                        t0,
                        out,
                    )
                )
                for tenant in WEIGHTS
            ]
            await asyncio.sleep(args.weights_s)
            for loop in loops:
                loop.cancel()
            for loop in loops:
                with contextlib.suppress(asyncio.CancelledError):
                    await loop
        await self.wait_idle()
        out.preemptions, out.engine = counted(before, await self.worker_counters())
        return out

    async def worker_counters(self) -> dict[str, float]:
        """The workers' counters, summed over workers: preemptions by reason (fair_share, urgency, kv_blocks)
        and what the engine spent (``ENGINE_COUNTERS``)."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        async with httpx.AsyncClient(timeout=10) as http:
            for url in self.stack.metrics_urls:
                for family in text_string_to_metric_families((await http.get(url)).text):
                    for s in family.samples:
                        name = s.name.removeprefix("inflightq_worker_").removesuffix("_total")
                        if name == "engine_preemptions_by_reason":
                            out[s.labels["reason"]] = out.get(s.labels["reason"], 0.0) + s.value
                        elif name in ENGINE_COUNTERS:
                            out[name] = out.get(name, 0.0) + s.value
        return out

    async def wait_idle(self) -> None:
        """Until nothing is queued in Redis and no worker's engine steps (a held sequence steps every
        turn; the running gauge keeps its last step's count when cancelled sequences leave)."""
        from prometheus_client.parser import text_string_to_metric_families

        from bench.serve import queue_redis
        from shared.async_client import AsyncQueueClient

        deadline, last = time.monotonic() + IDLE_WAIT_S, -1.0
        async with (
            httpx.AsyncClient(timeout=10) as http,
            AsyncQueueClient(self.settings, client=queue_redis(self.settings)) as queue,
        ):
            while time.monotonic() < deadline:
                queued = sum((await queue.queue_depth(self.settings.model)).values())
                steps = 0.0
                for url in self.stack.metrics_urls:
                    for family in text_string_to_metric_families((await http.get(url)).text):
                        steps += sum(s.value for s in family.samples if s.name == "inflightq_worker_engine_steps_total")
                if queued == 0 and steps == last:
                    return
                last = steps
                await asyncio.sleep(1.0)
        raise TimeoutError(f"the pool did not empty in {IDLE_WAIT_S:.0f} s after a phase; logs in {self.stack.logs}")


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in sorted(after)}


# What the fair share's mechanisms cost the engine in a phase: time in steps, the steps an arrival stopped and
# their forward time (thrown away), the tokens whose KV a preemption discarded (recomputed, less what the
# prefix cache kept), and the tokens generated over the sequence-steps that generated them.
ENGINE_COUNTERS = (
    "engine_steps",
    "engine_step_seconds",
    "engine_interrupted_steps",
    "engine_interrupted_seconds",
    "engine_recomputed_tokens",
    "engine_generated_tokens",
    "engine_token_steps",
)


def counted(before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """A phase's growth of ``worker_counters``: (preemptions by reason, engine counters)."""
    grown = counter_deltas(before, after)
    return {k: v for k, v in grown.items() if k not in ENGINE_COUNTERS}, {
        k: v for k, v in grown.items() if k in ENGINE_COUNTERS
    }


def merged(phases: list[Phase]) -> Phase:
    """Rounds of one phase as one: their requests (times from each round's own start) and counters summed."""
    out = Phase()
    for p in phases:
        out.sent += p.sent
        out.cancelled += p.cancelled
        for mine, theirs in ((out.preemptions, p.preemptions), (out.engine, p.engine)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0.0) + v
    return out


def flood_summary(phase: Phase, window: tuple[float, float], rounds: int = 1) -> dict[str, Any]:
    """Per tenant (every request sent, the cancelled ones counted apart), and all tokens in the window;
    ``rounds`` windows' worth when ``phase`` pools that many (``merged``)."""
    lo, hi = window
    out: dict[str, Any] = {"cancelled": phase.cancelled, "preemptions": phase.preemptions, "engine": phase.engine}
    for tenant in (A, B):
        mine = [s for s in phase.sent if s.tenant == tenant]
        done = [s.result for s in mine if s.result.success]
        out[tenant] = summarize(done, hi * rounds) | {"sent": len(mine)}
    tokens = sum(lo <= t <= hi for s in phase.sent for t in s.token_times())
    out["window_s"] = [lo, hi]
    out["rounds"] = rounds
    out["window_output_tokens"] = tokens
    out["window_output_tok_s"] = round(tokens / ((hi - lo) * rounds), 2)
    out["b_sent_s"] = [round(s.at, 2) for s in phase.sent if s.tenant == B]
    out["b_ttft_ms"] = [
        round(s.result.ttft * 1e3, 1) if s.result.success else None for s in phase.sent if s.tenant == B
    ]
    return out


def weights_summary(phase: Phase, window_s: float, settle_s: float = 0.0) -> dict[str, Any]:
    """Tokens each weighted tenant was served from ``settle_s`` to ``window_s``: its output tokens that
    arrived then, and the prompt tokens of its requests whose first token arrived then (prefilled then).
    The cumulative series covers the whole run."""
    out: dict[str, Any] = {
        "cancelled": phase.cancelled,
        "preemptions": phase.preemptions,
        "engine": phase.engine,
        "tenants": {},
    }
    out |= {"window_s": [settle_s, window_s], "series": {}}
    edges = [window_s * i / 20 for i in range(21)]
    for tenant, weight in WEIGHTS.items():
        mine = [s for s in phase.sent if s.tenant == tenant]
        output = prompt = 0
        cumulative = [0] * len(edges)
        for s in mine:
            times = s.token_times()
            counted = [t for t in times if settle_s <= t <= window_s]
            output += len(counted)
            prompt += s.result.prompt_len if times and settle_s <= times[0] <= window_s else 0
            for i, edge in enumerate(edges):
                cumulative[i] += sum(t <= edge for t in times)
        out["tenants"][tenant] = {
            "weight": weight,
            "sent": len(mine),
            "completed": sum(s.result.success for s in mine),
            "output_tokens": output,
            "prompt_tokens": prompt,
            "tokens": output + prompt,
        }
        out["series"][tenant] = cumulative
    out["series"]["t"] = [round(e, 2) for e in edges]
    heavy, light = out["tenants"][HEAVY], out["tenants"][LIGHT]
    target = WEIGHTS[HEAVY] / WEIGHTS[LIGHT]
    ratio = heavy["tokens"] / light["tokens"] if light["tokens"] else math.inf
    out["ratio"] = round(ratio, 3)
    out["output_ratio"] = round(heavy["output_tokens"] / light["output_tokens"], 3) if light["output_tokens"] else None
    out["target"] = target
    out["error"] = round(abs(ratio / target - 1), 3)
    out["met"] = out["error"] <= TARGET_WEIGHT_ERROR
    return out


def setup_targets(row: dict[str, Any]) -> dict[str, Any]:
    idle_p99 = row["idle"]["ttft_ms"]["p99"]
    out: dict[str, Any] = {"b_idle_p99_ms": idle_p99}
    for name in ("fair", "fcfs"):
        if name in row:
            p99 = row[name][B]["ttft_ms"]["p99"]
            out[f"b_{name}_p99_ms"] = p99
            out[f"b_{name}_vs_idle"] = round(p99 / idle_p99, 3)
    out["ttft_met"] = out.get("b_fair_vs_idle", math.inf) <= TARGET_TTFT_RATIO
    if "fair" in row and "fcfs" in row:
        fair, fcfs = row["fair"]["window_output_tok_s"], row["fcfs"]["window_output_tok_s"]
        out["throughput_fair_tok_s"], out["throughput_fcfs_tok_s"] = fair, fcfs
        out["throughput_ratio"] = round(fair / fcfs, 3)
        out["throughput_met"] = fair / fcfs >= TARGET_THROUGHPUT_RATIO
    if "weights" in row:
        w = row["weights"]
        out |= {"weights_ratio": w["ratio"], "weights_error": w["error"], "weights_met": w["met"]}
    return out


def run_setup(
    args: argparse.Namespace, settings: Settings, workers: int, samples: Samples, report: dict[str, Any], name: str
) -> dict[str, Any]:
    keys = TenantKeys(phase_keys())
    stack = Stack(settings, keys.specs, worker_metrics=True)
    row: dict[str, Any] = {"workers": workers, "cluster": settings.redis_cluster}
    load_before = os.getloadavg()[0]
    bench = Bench(args, settings, stack, keys, samples)
    try:
        stack.start(workers=workers)
        row["slots"] = bench.slots
        asyncio.run(bench.at_once("warm", A, samples.draw(4)))
        cal_samples = samples.draw(args.calibration_factor * bench.slots)
        cal, duration = asyncio.run(bench.at_once("calibration", A, cal_samples))
        results = [s.result for s in cal.sent]
        mean_output = sum(s.output_len for s in cal_samples) / len(cal_samples)
        row["calibration"] = summarize(results, duration)
        row["saturation"] = saturation(results, [s.at for s in cal.sent], mean_output)
        rate = args.light_share * row["saturation"]["requests_per_s"]
        # Each round's own arrivals and prompts: pooled, B's p99 is over rounds x as many requests.
        offsets = [arrivals(rate, args.warmup_s, args.flood_s - args.tail_s, args.seed + r) for r in range(args.rounds)]
        light = [samples.draw(len(o)) for o in offsets]
        row["light"] = {
            "rate_req_s": round(rate, 4),
            "requests": sum(map(len, light)),
            "offsets_s": [round(o, 2) for o in itertools.chain(*offsets)],
        }
        print(
            f"{name}: saturation {row['saturation']}; B at {rate:.3f} req/s, {row['light']['requests']} requests",
            flush=True,
        )

        idle, busy = asyncio.run(bench.one_at_a_time(list(itertools.chain(*light))))
        row["idle"] = summarize(idle, busy)
        print_summary(f"{name}: B alone on the idle stack", row["idle"])
        window = (args.warmup_s, args.flood_s)
        floods: dict[str, list[Phase]] = {"fair": [], "fcfs": []}
        for r in range(args.rounds):
            if r > 0:
                stack = bench.restart(stack)
            floods["fair"].append(asyncio.run(bench.flood("fair", light[r], offsets[r])))
            print_summary(
                f"{name}: B under A's flood, fair share, round {r + 1}", flood_summary(floods["fair"][-1], window)[B]
            )
            checkpoint(report, PARTIAL)
            if r == 0 and args.weights_s > 0:
                row["weights"] = weights_summary(asyncio.run(bench.weights()), args.weights_s, args.weights_settle_s)
                print(f"{name}: weights 3:1 served {row['weights']['ratio']} ({row['weights']['tenants']})", flush=True)
            if not args.skip_fcfs:
                if FCFS_ENV:  # the same stack's processes, started again with fair share off
                    stack = bench.restart(stack, FCFS_ENV)
                floods["fcfs"].append(asyncio.run(bench.flood("fcfs", light[r], offsets[r])))
                print_summary(
                    f"{name}: B under A's flood, FCFS, round {r + 1}", flood_summary(floods["fcfs"][-1], window)[B]
                )
        for run, phases in floods.items():
            if phases:
                row[run] = flood_summary(merged(phases), window, rounds=len(phases))
                row[run]["rounds_output_tok_s"] = [flood_summary(p, window)["window_output_tok_s"] for p in phases]
        if "fcfs" in row:
            row["fcfs"]["anchor"] = fcfs_anchor()
    finally:
        bench.stack.stop()  # the last one started (``Bench.restart`` stops the one before)
    # Others' processes share the cores: the 1-minute load average before and after the setup's phases.
    row["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    row["targets"] = setup_targets(row)
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="inflightq bench fairness", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: INFLIGHTQ_MODEL")
    p.add_argument("--dtype", default=None, help="auto, float32, bfloat16 (default: INFLIGHTQ_DTYPE)")
    p.add_argument(
        "--setups", default=",".join(SETUPS), help="standalone:<workers> or cluster:<workers>, comma-separated"
    )
    p.add_argument("--flood-s", type=float, default=30.0, help="seconds A floods and B sends")
    p.add_argument("--warmup-s", type=float, default=4.0, help="B's first arrival, and the throughput window's start")
    p.add_argument("--tail-s", type=float, default=2.0, help="B's last arrival is this long before the flood ends")
    p.add_argument("--flood-factor", type=float, default=3.0, help="A's requests in flight / the pool's slots")
    p.add_argument("--light-share", type=float, default=0.2, help="B's arrival rate / the pool's saturation")
    p.add_argument(
        "--weights-s", type=float, default=60.0, help="seconds both weighted tenants stay backlogged (0: skip)"
    )
    p.add_argument(
        "--weights-factor", type=float, default=1.5, help="each weighted tenant's requests in flight / slots"
    )
    p.add_argument(
        "--weights-settle-s", type=float, default=10.0, help="the weights window starts this long into the run"
    )
    p.add_argument("--calibration-factor", type=int, default=1, help="calibration requests / slots")
    p.add_argument("--input-len", default="50,300", help="prompt tokens, min,max (uniform)")
    p.add_argument("--output-len", default="10,100", help="new tokens, min,max (uniform; ignore_eos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=None, help="per worker (default INFLIGHTQ_MAX_NUM_SEQS)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per engine (default 3072)")
    p.add_argument("--skip-fcfs", action="store_true")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="fair and FCFS floods in turn, this many of each (each on a fresh stack): B's requests and the "
        "throughput pooled, so the stacks' drift over the run falls on both",
    )
    p.add_argument("--out", default="bench/results", help="folder for fairness-<date>.*; '' to skip writing")
    p.add_argument("--tag", default="", help="name files fairness-<date>-<tag>.*")
    p.add_argument("--note", default="", help="a line about the machine's state, copied into the results")
    p.set_defaults(base_url=None)  # always a stack of its own (bench.serve's settings read this)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    stop_on_sigterm()
    from inflightq_cli.redis_cluster import PrivateRedisCluster
    from shared.model_source import load_tokenizer

    settings = bench_settings(args)
    if args.max_num_seqs:
        settings = settings.model_copy(update={"max_num_seqs": args.max_num_seqs})
    settings = settings.model_copy(update={"max_queue_depth": max(settings.max_queue_depth, 16384)})
    samples = Samples(load_tokenizer(settings.model), args)
    report = report_head("inflightq bench fairness", argv, settings, samples.draw(1), args, ENGINE_KEYS)
    report["dataset"] = {
        "seed": args.seed,
        "input_len": list(samples.input_len),
        "output_len": list(samples.output_len),
    }
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("INFLIGHTQ_") and "URL" not in k)
    report["command"] = f"{env} {report['command']}".strip()
    report |= {
        "note": args.note,
        "fcfs_anchor": fcfs_anchor(),
        "phases": {k: getattr(args, k) for k in ("flood_s", "warmup_s", "tail_s", "flood_factor", "light_share")}
        | {
            k: getattr(args, k)
            for k in ("weights_s", "weights_settle_s", "weights_factor", "calibration_factor", "rounds")
        },
        "setups": {},
    }
    for name in args.setups.split(","):
        kind, _, count = name.partition(":")
        workers = int(count or 1)
        if kind == "cluster":
            cluster = PrivateRedisCluster(replicas_per_master=0).start()
            try:
                here = settings.model_copy(update={"redis_url": cluster.url, "redis_cluster": True})
                report["setups"][name] = run_setup(args, here, workers, samples, report, name)
            finally:
                cluster.stop()
        elif kind == "standalone":
            report["setups"][name] = run_setup(args, settings, workers, samples, report, name)
        else:
            raise SystemExit(f"--setups: {name!r} is not standalone:<workers> or cluster:<workers>")
        print_targets(name, report["setups"][name]["targets"])
        checkpoint(report, PARTIAL)
        if args.out:  # after each setup: a run cut short still leaves the setups it finished
            from bench.fairness_report import write

            write(report, Path(args.out), tag=args.tag)
    return report


def fcfs_anchor() -> str:
    off = "fair share off (" + " ".join(f"{k}={v}" for k, v in FCFS_ENV.items()) + "), " if FCFS_ENV else ""
    return off + "every request under one API key (one tenant)"


def print_targets(name: str, t: dict[str, Any]) -> None:
    print(
        f"{name}: B p99 TTFT fair {t.get('b_fair_vs_idle')}x idle (target <= {TARGET_TTFT_RATIO}), FCFS "
        f"{t.get('b_fcfs_vs_idle')}x; throughput fair/FCFS {t.get('throughput_ratio')} (target >= "
        f"{TARGET_THROUGHPUT_RATIO}); weights 3:1 served {t.get('weights_ratio')} (error {t.get('weights_error')}, "
        f"target <= {TARGET_WEIGHT_ERROR})",
        flush=True,
    )


if __name__ == "__main__":
    main()
