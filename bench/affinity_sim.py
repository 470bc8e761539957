"""A simulation of the pool, to project ``inflightq bench affinity`` past the workers one box can run.

Each worker is an engine of ``max_num_seqs`` slots stepping its batch: a step prefills up to
``max_num_batched_tokens`` prompt tokens and decodes one token per decoding sequence, and lasts
``prefill_s`` x tokens prefilled + ``decode_s`` x tokens decoded, the per-token costs fitted on the
benchmark's own workers. Its KV cache is an LRU of block hashes (``num_kv_blocks``, the blocks of running
sequences pinned); a request reuses the longest cached run of its prompt's blocks. Placement:

- plain pull: one FIFO; a worker with a free slot takes the oldest entry (which of several such workers
  pulls a new entry first is drawn at random: a race between them);
- affinity: a request goes to the offer lane of the worker whose cache holds the longest prefix of it
  (ties: the least loaded; the shared lane when no worker holds more than the others, as the API
  decides; a worker holds the prompts it has taken from the moment it takes them, as it advertises
  them); a worker with a free slot takes what waited past the steal bound first, then its own offers,
  then the oldest of the shared lane and of other workers' offers that have waited longer than its own
  oldest work by the steal bound plus its time to prefill what their worker holds (when it runs nothing:
  that have waited that prefill time, the bound at most), as the queue's pull script does for one tenant.
  An idle worker looks again whenever any worker ends a step.

The workloads are the benchmark's, scaled with the pool (conversations, prefixes and clients per
worker held as measured). Redis is projected apart (``redis_projection``): commands, affinity's own
commands and the model slot's Redis time per request, fitted linearly in the worker count on the
benchmark's runs, and the summaries' size from the members and bytes per member measured there.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MULTI_TURN, SHARED_PREFIX = "multi_turn", "shared_prefix"


@dataclass(frozen=True)
class Costs:
    prefill_s: float  # per prompt token prefilled
    decode_s: float  # per token generated


@dataclass(frozen=True)
class Engine:
    max_num_seqs: int
    max_batched_tokens: int
    max_prefill_beside_decodes: int  # 0: up to max_batched_tokens
    num_kv_blocks: int
    block_size: int


@dataclass
class Req:
    client: int  # the conversation, or the closed-loop client
    blocks: list[tuple[Any, ...]]  # the full blocks' keys of prompt and answer, in order
    prompt: int
    answer: int
    turn: int = 0
    enqueued: float = 0.0
    first_token: float = math.nan
    prefill_left: int = 0
    decode_left: int = 0
    hit_blocks: int = 0
    private: int = 0  # blocks it holds that are not (yet) in the cache
    offered: int = 0  # prompt tokens the worker it is offered to holds
    pinned: list[tuple[Any, ...]] = field(default_factory=list)


class Worker:
    """An engine: slots, a batch stepped at the fitted per-token costs, and a paged KV cache whose
    free blocks keep their contents (an LRU of block keys), as the engine's BlockManager does."""

    def __init__(self, index: int, engine: Engine, costs: Costs) -> None:
        self.index, self.engine, self.costs = index, engine, costs
        self.cache: OrderedDict[tuple[Any, ...], int] = OrderedDict()  # block key -> pins; LRU first
        self.pinned = 0  # cache entries with pins
        self.private = 0  # blocks running requests hold outside the cache
        self.running: list[Req] = []
        self.waiting: deque[Req] = deque()  # taken from Redis, waiting for KV blocks
        self.stepping = False
        self.queries = self.hits = self.prefilled = self.generated = 0
        self.promised: Counter[tuple[Any, ...]] = Counter()  # prompt blocks of the requests taken, advertised at once

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def held_prefix(self, blocks: list[tuple[Any, ...]], *, advertised: bool = False) -> int:
        """Leading blocks of ``blocks`` the cache holds (``advertised``: or that a request taken here promised)."""
        n = 0
        for b in blocks:
            if b not in self.cache and not (advertised and self.promised[b]):
                break
            n += 1
        return n

    def _pin(self, b: tuple[Any, ...]) -> None:
        pins = self.cache.get(b, 0)
        self.pinned += pins == 0
        self.cache[b] = pins + 1
        self.cache.move_to_end(b)

    def _unpin(self, b: tuple[Any, ...]) -> None:
        self.cache[b] -= 1
        self.pinned -= self.cache[b] == 0

    def _evict(self) -> None:
        excess = len(self.cache) + self.private - self.engine.num_kv_blocks
        for key in [k for k, pins in self.cache.items() if pins == 0][: max(0, excess)]:
            del self.cache[key]

    def admit(self, req: Req) -> bool:
        """Starts ``req`` when its blocks fit beside the pinned and private ones (free cached blocks
        are reused, least recently used first); a lone request always starts."""
        bs = self.engine.block_size
        hit = self.held_prefix(req.blocks[: (req.prompt - 1) // bs])  # one token is always computed
        need = math.ceil((req.prompt + req.answer) / bs) - hit
        if self.pinned + self.private + need > self.engine.num_kv_blocks and self.running:
            return False
        self.queries += req.prompt
        self.hits += hit * bs
        req.hit_blocks, req.private = hit, need
        req.prefill_left, req.decode_left = req.prompt - hit * bs, req.answer
        req.pinned = list(req.blocks[:hit])
        for b in req.pinned:
            self._pin(b)
        self.private += need
        self.running.append(req)
        self._evict()
        return True

    def _publish(self, req: Req, upto: int) -> None:
        """The request's full blocks up to ``upto`` join the cache (pinned while it runs)."""
        for b in req.blocks[len(req.pinned) : upto]:
            self._pin(b)
            req.pinned.append(b)
            req.private -= 1
            self.private -= 1
        self._evict()

    def finish(self, req: Req) -> None:
        self._publish(req, len(req.blocks))
        for b in req.pinned:
            self._unpin(b)
        self.private -= req.private
        self.running.remove(req)
        self.promised.subtract(req.blocks[: req.prompt // self.engine.block_size])

    def step(self) -> tuple[float, list[Req], list[Req]]:
        """One engine step: its duration, the requests whose first token it sampled, those it finished."""
        decoding = [r for r in self.running if r.prefill_left == 0]
        cap = self.engine.max_prefill_beside_decodes if decoding else 0
        budget = min(self.engine.max_batched_tokens - len(decoding), cap or self.engine.max_batched_tokens)
        prefill, first = 0, []
        for r in self.running:
            if r.prefill_left > 0 and budget > 0:
                n = min(r.prefill_left, budget)
                r.prefill_left -= n
                budget -= n
                prefill += n
                if r.prefill_left == 0:
                    first.append(r)  # the step that ends a prompt samples its first token
                    self._publish(r, r.prompt // self.engine.block_size)
        for r in decoding + first:
            r.decode_left -= 1
        done = [r for r in self.running if r.prefill_left == 0 and r.decode_left <= 0]
        self.prefilled += prefill
        sampled = len(decoding) + len(first)
        self.generated += sampled
        return prefill * self.costs.prefill_s + sampled * self.costs.decode_s, first, done


class Pool:
    def __init__(self, workers: int, engine: Engine, costs: Costs, affinity: bool, steal_after_s: float) -> None:
        self.workers = [Worker(i, engine, costs) for i in range(workers)]
        self.affinity, self.steal_after_s = affinity, steal_after_s
        self.lane: deque[Req] = deque()
        self.offers: list[deque[Req]] = [deque() for _ in range(workers)]
        self.steals = 0

    def enqueue(self, req: Req, now: float) -> None:
        req.enqueued = now
        if self.affinity:
            held = [
                w.held_prefix(req.blocks[: req.prompt // w.engine.block_size], advertised=True) for w in self.workers
            ]
            best = max(held)
            # No offer when every worker holds as much (a template's system prompt): the lane balances those.
            if best and min(held) < best:
                target = min((w for w, h in zip(self.workers, held, strict=True) if h == best), key=lambda w: w.load)
                req.offered = best * target.engine.block_size
                self.offers[target.index].append(req)
                return
        self.lane.append(req)

    def pull(self, w: Worker, now: float) -> list[Req]:
        taken = []
        while w.load < w.engine.max_num_seqs:
            # (rank, age, whose): what waited past the steal bound, then its own offers, then the oldest of
            # the lane and stealable offers (policy.fair_pick for one tenant).
            def rank(v: int, q: deque[Req]) -> int:
                return 0 if now - q[0].enqueued >= self.steal_after_s else 1 if v == w.index else 2

            heads = [(rank(-1, self.lane), self.lane[0].enqueued, -1, self.lane)] if self.lane else []
            mine = self.offers[w.index]
            # The oldest work it may take without stealing (policy.offer_stealable's own wait).
            own = min([q[0].enqueued for q in (self.lane, mine) if q], default=now)
            for v, q in enumerate(self.offers):
                if not q:
                    continue
                # A busy worker steals once the offer waited longer than its own work by the bound plus the time
                # it would take to prefill what the holder holds; an idle one once it waited that prefill time,
                # the bound at most.
                refill = q[0].offered * w.costs.prefill_s
                busy_steal = own - q[0].enqueued >= self.steal_after_s + refill
                idle_steal = not w.load and now - q[0].enqueued >= min(self.steal_after_s, refill)
                if v == w.index or busy_steal or idle_steal:
                    heads.append((rank(v, q), q[0].enqueued, v, q))
            if not heads:
                break
            _, _, v, q = min(heads, key=lambda h: h[:3])
            self.steals += v not in (-1, w.index)
            taken.append(q.popleft())
        return taken

    def idle_steal_at(self, w: Worker) -> float | None:
        """When the first of the other workers' offers becomes one an idle ``w`` takes (``pull``)."""
        times = [
            q[0].enqueued + min(self.steal_after_s, q[0].offered * w.costs.prefill_s)
            for v, q in enumerate(self.offers)
            if q and v != w.index
        ]
        return min(times, default=None)

    @property
    def queued(self) -> int:
        return len(self.lane) + sum(len(q) for q in self.offers)


def fit_costs(runs: list[dict[str, Any]], workers: int) -> dict[str, Any]:
    """Per-token forward costs from this run: each worker of each ``workers``-worker run is one point,
    forward seconds = prefill_s x tokens prefilled + decode_s x tokens generated (least squares)."""
    rows, ys = [], []
    for run in runs:
        if run["workers"] != workers:
            continue
        for c in run["workers_counters"]:
            prefilled = c.get("engine_prefix_cache_queries", 0) - c.get("engine_prefix_cache_hits", 0)
            rows.append([prefilled, c.get("generated_tokens", 0)])
            ys.append(c.get("engine_forward_seconds", 0))
    if len(rows) < 2:
        return {}
    coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(ys, dtype=float), rcond=None)
    prefill_s, decode_s = (max(float(c), 1e-7) for c in coef)
    fitted = np.asarray(rows) @ np.asarray([prefill_s, decode_s])
    resid = np.asarray(ys) - fitted
    return {
        "prefill_ms_per_token": round(1000 * prefill_s, 4),
        "decode_ms_per_token": round(1000 * decode_s, 4),
        "points": len(rows),
        "from_runs_with_workers": workers,
        "max_relative_residual": round(float(np.max(np.abs(resid) / np.maximum(ys, 1e-9))), 3),
    }


def multi_turn_requests(
    conversations: int, prompt_by_turn: list[int], answer: int, block_size: int
) -> list[list[tuple[int, list[tuple[Any, ...]]]]]:
    """Per conversation, per turn: the prompt length and the full blocks of prompt and answer. A turn's
    prompt is the previous turn's prompt and answer and more, so block i of a conversation has one key
    in every turn; block 0 is the chat template's default system prompt, the same in every conversation."""
    return [
        [(p, [("sys", 0)] + [("c", c, i) for i in range(1, (p + answer) // block_size)]) for p in prompt_by_turn]
        for c in range(conversations)
    ]


def simulate(
    kind: str,
    workers: int,
    affinity: bool,
    costs: Costs,
    engine: Engine,
    wl: dict[str, Any],
    steal_after_s: float,
    seed: int = 0,
) -> dict[str, Any]:
    """One simulated run; the figures the benchmark reports for a real one."""
    rng = random.Random(seed)
    pool = Pool(workers, engine, costs, affinity, steal_after_s)
    bs = engine.block_size
    events: list[tuple[float, int, str, Any]] = []  # (time, seq, kind, payload)
    seq = 0

    def push(t: float, what: str, payload: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, what, payload))

    finished: list[Req] = []
    if kind == MULTI_TURN:
        convs = multi_turn_requests(wl["conversations"], wl["prompt_by_turn"], wl["answer_len"], bs)
        spread = wl.get("start_spread", 0.0)
        for c, turns in enumerate(convs):
            p, blocks = turns[0]
            push(spread * c / len(convs), "submit", Req(c, blocks, p, wl["answer_len"], 0))
    else:
        shared, prompt = wl["shared_prefix_tokens"], wl["prompt_tokens"]
        order = [rng.randrange(wl["prefixes"]) for _ in range(wl["requests"])]
        counter = iter(range(len(order)))

        def next_request(client: int) -> Req | None:
            i = next(counter, None)
            if i is None:
                return None
            own = range(shared // bs, (prompt + wl["answer_len"]) // bs)
            blocks = [("p", order[i], j) for j in range(shared // bs)] + [("u", i, j) for j in own]
            return Req(client, blocks, prompt, wl["answer_len"])

        for client in range(wl["clients"]):
            if (r := next_request(client)) is not None:
                push(0.0, "submit", r)

    def kick(w: Worker, now: float) -> None:
        for r in pool.pull(w, now):
            w.waiting.append(r)
            w.promised.update(r.blocks[: r.prompt // engine.block_size])
        while w.waiting and w.admit(w.waiting[0]):
            w.waiting.popleft()
        if not w.stepping and w.running:
            w.stepping = True
            push(now, "step", w.index)

    recheck: dict[int, float] = {}  # an idle worker's next look, by worker
    now = 0.0
    while events:
        now, _, what, payload = heapq.heappop(events)
        if what == "submit":
            pool.enqueue(payload, now)
            # Which worker with a free slot pulls first is a race: a random order stands for it.
            for w in rng.sample(pool.workers, len(pool.workers)):
                kick(w, now)
        elif what == "step":
            w = pool.workers[payload]
            dt, first, done = w.step()
            for r in first:
                r.first_token = now + dt
            push(now + dt, "stepped", (w.index, done))
        elif what == "recheck":
            recheck.pop(payload, None)
            kick(pool.workers[payload], now)
        else:  # stepped
            index, done = payload
            w = pool.workers[index]
            w.stepping = False
            for r in done:
                w.finish(r)
                finished.append(r)
                if kind == MULTI_TURN and r.turn + 1 < len(wl["prompt_by_turn"]):
                    p, blocks = convs[r.client][r.turn + 1]
                    push(now, "submit", Req(r.client, blocks, p, wl["answer_len"], r.turn + 1))
                elif kind == SHARED_PREFIX and (nxt := next_request(r.client)) is not None:
                    push(now, "submit", nxt)
            kick(w, now)
        if pool.queued:  # a stealable offer may be waiting for an idle worker
            for v in pool.workers:
                if not v.running:
                    kick(v, now)
                    # an idle worker looks again as the offers it leaves to their holders become its to take
                    at = pool.idle_steal_at(v) if not v.running else None
                    if at is not None and at > now and recheck.get(v.index, math.inf) > at:
                        recheck[v.index] = at
                        push(at + 1e-9, "recheck", v.index)  # past it, whatever the rounding
    return summary(pool, finished, now)


def summary(pool: Pool, finished: list[Req], duration: float) -> dict[str, Any]:
    queries = sum(w.queries for w in pool.workers)
    hits = sum(w.hits for w in pool.workers)
    ttft = sorted(r.first_token - r.enqueued for r in finished)
    generated = sum(w.generated for w in pool.workers)

    def pct(p: float) -> float:
        return round(1000 * ttft[min(len(ttft) - 1, int(p / 100 * len(ttft)))], 1) if ttft else math.nan

    return {
        "requests": len(finished),
        "hit_rate": round(hits / queries, 4) if queries else None,
        "prefilled_tokens": sum(w.prefilled for w in pool.workers),
        "ttft_ms": {"p50": pct(50), "p99": pct(99)},
        "output_throughput": round(generated / duration, 2) if duration else math.nan,
        "steals": pool.steals,
        "duration_s": round(duration, 2),
    }


def linear_in_workers(points: dict[int, float]) -> tuple[float, float] | None:
    """(intercept, slope) through the measured (workers, value) points; None with fewer than two."""
    if len(points) < 2:
        return None
    xs, ys = list(points), list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def redis_projection(report: dict[str, Any], sim_workers: list[int]) -> dict[str, Any]:
    """Redis per request at each worker count, fitted linearly in the worker count on the measured
    affinity runs (INFO commandstats over the run, divided by its requests): all commands, the commands
    affinity adds over plain pull at the same pool size (the lookup's SISMEMBERs, the pull's scan of the
    offer streams, the summaries' SADD/SREM; polls and heartbeats, which both run, cancel out), and the
    model slot's Redis time (its scripts and the summary updates). All of a model's queue keys and
    summaries share one slot, so one shard's core serves them: ``max_requests_per_s_one_redis_core`` is
    what that core sustains, and ``max_requests_per_s_per_worker`` the rate per worker at which the pool
    saturates it. The summaries' size: members per worker as measured (at most its KV blocks) times the
    bytes a member took."""
    out: dict[str, Any] = {}
    for workload in (MULTI_TURN, SHARED_PREFIX):
        runs = [r for r in report["runs"] if r["workload"] == workload and r["mode"] == "affinity"]
        plain = {r["workers"]: r for r in report["runs"] if r["workload"] == workload and r["mode"] == "plain"}
        if not runs:
            continue
        cmds = linear_in_workers({r["workers"]: r["redis"]["commands_per_request"] for r in runs})
        if cmds and cmds[1] < 0:  # polls per request outweigh the growth: held flat at the largest measured
            cmds = (max(r["redis"]["commands_per_request"] for r in runs), 0.0)
        added = linear_in_workers(
            {
                r["workers"]: r["redis"]["commands_per_request"] - plain[r["workers"]]["redis"]["commands_per_request"]
                for r in runs
                if r["workers"] in plain
            }
        )
        cpu = linear_in_workers({r["workers"]: r["redis"]["model_slot_ms_per_request"] for r in runs})
        if cpu and cpu[1] < 0:
            # Fewer ms per request with more workers: polls per request (a slower run polls more per request)
            # outweigh the growth; held flat at the largest measured value instead of projected to zero.
            cpu = (max(r["redis"]["model_slot_ms_per_request"] for r in runs), 0.0)
        summary_bytes = held_member_bytes(runs)
        members = held_members_per_worker(runs)
        kv_blocks = report["workloads"][workload]["num_kv_blocks"]
        rows = []
        for n in sim_workers:
            row: dict[str, Any] = {"workers": n}
            if cmds:
                row["commands_per_request"] = round(cmds[0] + cmds[1] * n, 1)
            if added:
                row["affinity_commands_per_request"] = round(added[0] + added[1] * n, 1)
            if cpu:
                ms = max(1e-6, cpu[0] + cpu[1] * n)
                row["model_slot_ms_per_request"] = round(ms, 4)
                row["max_requests_per_s_one_redis_core"] = round(1000 / ms)
                row["max_requests_per_s_per_worker"] = round(1000 / ms / n, 1)
            if summary_bytes:
                held = min(kv_blocks, members) if members else kv_blocks
                row["summaries_mb"] = round(n * held * summary_bytes / 1e6, 2)
                row["summaries_mb_full_caches"] = round(n * kv_blocks * summary_bytes / 1e6, 1)
            rows.append(row)
        out[workload] = {
            "fit_commands": cmds,
            "fit_affinity_commands": added,
            "fit_model_slot_ms": cpu,
            "plain_commands_per_request": {n: r["redis"]["commands_per_request"] for n, r in plain.items()},
            "per_request_by_name": {
                r["workers"]: {
                    k: v
                    for k, v in r["redis"]["commands_per_request_by_name"].items()
                    if k in ("sismember", "sadd", "srem", "exists", "xinfo|groups", "xrange", "evalsha")
                }
                for r in runs
            },
            "bytes_per_summary_member": summary_bytes,
            "summary_members_per_worker": members,
            "kv_blocks_per_worker": kv_blocks,
            "rows": rows,
        }
    return out


def held_members_per_worker(runs: list[dict[str, Any]]) -> float | None:
    """Members of a worker's summary at the end of the measured affinity runs, on average."""
    members = keys = 0.0
    for r in runs:
        for kind, row in r["redis"]["keys_after"].items():
            if "held" in kind:
                members += row["set_members"]
                keys += row["keys"]
    return round(members / keys, 1) if keys else None


def held_member_bytes(runs: list[dict[str, Any]]) -> float | None:
    """Bytes a summary member took in Redis: the set-typed keys named for what a worker holds."""
    total_bytes = total_members = 0.0
    for r in runs:
        for kind, row in r["redis"]["keys_after"].items():
            if "held" in kind and row["set_members"]:
                total_bytes += row["bytes"]
                total_members += row["set_members"]
    return round(total_bytes / total_members, 1) if total_members else None


def project(report: dict[str, Any], sim_workers: list[int], seed: int = 0) -> dict[str, Any]:
    """The simulation at each worker count, both placements, on the benchmark's workloads scaled with the
    pool; beside it the simulation of the measured worker counts, to compare with the measurements."""
    c = report.get("costs") or {}
    if not c:
        return {"skipped": "no per-token costs were fitted"}
    costs = Costs(c["prefill_ms_per_token"] / 1000, c["decode_ms_per_token"] / 1000)
    e = report["engine"]
    base_workers = c["from_runs_with_workers"]
    steal = (report.get("steal_after_ms") or 0.0) / 1000
    out: dict[str, Any] = {"costs": c, "steal_after_s": steal, "workloads": {}}
    for kind, wl in report["workloads"].items():
        measured = [r for r in report["runs"] if r["workload"] == kind and r["mode"] == "plain"]
        if not measured:
            continue
        wl = dict(wl)
        scale_keys = ("conversations",) if kind == MULTI_TURN else ("prefixes", "requests", "clients")
        if kind == MULTI_TURN:
            wl["prompt_by_turn"] = [int(v) for v in measured[0]["prompt_tokens_by_turn"].values()]
        engine = Engine(
            e["max_num_seqs"],
            e["max_num_batched_tokens"],
            e["max_prefill_tokens_beside_decodes"],
            wl["num_kv_blocks"],
            e["block_size"],
        )
        rows = []
        for n in sorted(set(sim_workers)):
            scaled = dict(wl)
            for k in scale_keys:
                scaled[k] = max(1, round(wl[k] * n / base_workers))
            row: dict[str, Any] = {"workers": n}
            for mode in ("plain", "affinity"):
                row[mode] = simulate(kind, n, mode == "affinity", costs, engine, scaled, steal, seed)
            p, a = row["plain"], row["affinity"]
            row["affinity_vs_plain"] = {
                "prefilled": round(a["prefilled_tokens"] / max(1, p["prefilled_tokens"]), 3),
                "ttft_p50": round(a["ttft_ms"]["p50"] / p["ttft_ms"]["p50"], 3) if p["ttft_ms"]["p50"] else None,
                "ttft_p99": round(a["ttft_ms"]["p99"] / p["ttft_ms"]["p99"], 3) if p["ttft_ms"]["p99"] else None,
                "throughput": round(a["output_throughput"] / p["output_throughput"], 3),
            }
            rows.append(row)
            print(
                f"sim {kind}, {n} workers: hit rate plain {p['hit_rate']} / affinity {a['hit_rate']}, "
                f"affinity/plain: {row['affinity_vs_plain']}",
                flush=True,
            )
        out["workloads"][kind] = {
            "scaled_with_workers": list(scale_keys),
            "per_worker_base": base_workers,
            "rows": rows,
        }
    out["redis"] = redis_projection(report, sim_workers)
    out["limits"] = limits(out)
    return out


def limits(projection: dict[str, Any]) -> list[str]:
    """Where the design stops scaling, in sentences built from the projection's own figures."""
    lines = []
    for kind, r in projection.get("redis", {}).items():
        rows = r["rows"]
        if r.get("fit_commands"):
            c0, c1 = r["fit_commands"]
            lines.append(
                f"{kind}: Redis commands per request = {c0:.1f} + {c1:.2f} x workers (fit on the measured affinity "
                f"runs, polls and heartbeats included); {rows[-1].get('commands_per_request')} at "
                f"{rows[-1]['workers']} workers."
            )
        if r.get("fit_affinity_commands"):
            a0, a1 = r["fit_affinity_commands"]
            lines.append(
                f"{kind}: affinity's own commands per request (over plain pull at the same pool size) = {a0:.1f} + "
                f"{a1:.2f} x workers: the lookup reads every live worker's summary and each pull scans every "
                f"worker's offer stream, so both grow with the pool; {rows[-1].get('affinity_commands_per_request')} "
                f"at {rows[-1]['workers']} workers."
            )
        if r.get("fit_model_slot_ms") and rows[-1].get("max_requests_per_s_one_redis_core"):
            s0, s1 = r["fit_model_slot_ms"]
            if not s1:
                lines.append(
                    f"{kind}: the model slot's Redis time per request did not grow with the pool between the "
                    "measured sizes (polls per request, which grow with a run's length, dominate it); held flat at "
                    f"{s0:.3f} ms, one Redis core serves at most {rows[-1]['max_requests_per_s_one_redis_core']} "
                    f"requests/s: {rows[-1].get('max_requests_per_s_per_worker')} per worker at {rows[-1]['workers']} "
                    "workers."
                )
            else:
                lines.append(
                    f"{kind}: the model slot's Redis time per request (queue scripts, summary updates) = {s0:.3f} + "
                    f"{s1:.4f} x workers ms; one Redis core (the model's queue keys share one slot) serves at most "
                    f"{rows[0]['max_requests_per_s_one_redis_core']} requests/s at {rows[0]['workers']} workers and "
                    f"{rows[-1]['max_requests_per_s_one_redis_core']} at {rows[-1]['workers']}: the pool saturates it "
                    f"once each worker finishes more than {rows[-1].get('max_requests_per_s_per_worker')} requests/s "
                    f"at {rows[-1]['workers']} workers."
                )
        if r.get("bytes_per_summary_member"):
            lines.append(
                f"{kind}: a summary member takes {r['bytes_per_summary_member']} bytes; a worker's summary held "
                f"{r.get('summary_members_per_worker')} members at the run's end ({r['kv_blocks_per_worker']} KV "
                f"blocks per worker); at {rows[-1]['workers']} workers the summaries take "
                f"{rows[-1].get('summaries_mb')} MB ({rows[-1].get('summaries_mb_full_caches')} MB with every cache "
                "full), all in the model's one slot."
            )
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Projects a saved ``inflightq bench affinity`` result (its JSON) and rewrites its files with the projection."""
    import argparse
    import json
    from pathlib import Path

    from bench.affinity_report import markdown, plot
    from bench.results_files import save

    p = argparse.ArgumentParser(prog="python -m bench.affinity_sim", description=main.__doc__)
    p.add_argument("results", help="bench/results/affinity-<date>[-tag].json")
    p.add_argument("--sim-workers", default="2,4,16,32,64")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    path = Path(args.results)
    report = json.loads(path.read_text())
    workers = sorted({r["workers"] for r in report["runs"] if r["mode"] != "single"})
    report["costs"] = report.get("costs") or fit_costs(report["runs"], workers[0])
    report["projection"] = project(report, [int(x) for x in args.sim_workers.split(",")], seed=args.seed)
    save(path.with_suffix(""), report, markdown(report), plot)
    return report


if __name__ == "__main__":
    main()
