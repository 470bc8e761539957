"""``inflightq bench transport``: how fast one worker's publisher moves token events into Redis.

Three figures from one run on one Redis:

1. raw: pipelined PUBLISH of token-sized JSON, one pipeline per step of ``batch`` events
   (the anchor: the least a transport can do per token);
2. publisher: the worker's ``Publisher`` fed real engine events as fast as it takes them; per
   event it does more than the anchor (XADD to the replay log + PUBLISH + EXPIRE), all pipelined;
3. worker end to end: a real ``WorkerService`` with a tiny RANDOM model (gibberish output, chosen
   because it costs next to nothing to run) serving ``batch`` requests from Redis, against the
   same engine generating the same work with no Redis at all: the loop's cost of publishing.

With ``cluster=True`` (``inflightq bench transport --cluster``), also, in the same run: the
publisher through one Redis node (a private standalone server) against the same publisher on a
private 3-master Redis Cluster (``INFLIGHTQ_REDIS_CLUSTER``: one script call per slot, one pipelined
round trip per node, SPUBLISH), with each node's CPU time per million token events (INFO cpu):
the figure a capacity plan divides by.

Results go to ``bench/results/transport-<stamp>.json`` and ``.md``.

    python -m bench.transport --cluster      # or: inflightq bench transport --cluster
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from inflightq_cli.redis_cluster import PrivateRedisCluster
from inflightq_cli.redis_server import PrivateRedis, ensure_redis
from shared.client import QueueClient
from shared.keys import Keys
from shared.redis_connect import connect
from shared.schemas import SamplingSpec
from shared.settings import Settings, get_settings
from worker.publisher import Publisher, token_json

TOKENS_PER_REQUEST = 64
STEPS_AHEAD = 8


def record_steps(model_dir: str, batch: int, steps: int) -> list[list[Any]]:
    """Real engine events (text deltas, indexes) of ``batch`` sequences, step by step."""
    from worker.engine import LLMEngine, SamplingParams
    from worker.engine.llm import LLM

    engine: LLMEngine = LLM(model_dir, dtype="float32", device="cpu", max_num_seqs=batch).engine
    for i in range(batch):
        engine.add_request(f"r{i}", [1, 2, 3, 4 + i], SamplingParams(max_new_tokens=steps, ignore_eos=True))
    recorded = []
    while engine.has_unfinished():
        events = engine.step()
        if events:
            recorded.append(events)
    return recorded


def raw_publish(
    connection: redis.Redis, keys: Keys, steps: list[list[Any]], seconds: float, steps_per_pipeline: int
) -> dict[str, float]:
    """The anchor, given every advantage: JSON made once up front, ``steps_per_pipeline`` steps per round trip."""
    docs = [(keys.tokens_channel(e.request_id), token_json(e.request_id, e.index, e.token_id, e.text, e, 0))
            for step in steps for e in step]  # fmt: skip
    size = steps_per_pipeline * len(steps[0])
    payloads = [docs[i : i + size] for i in range(0, len(docs), size)]
    sent = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for step in payloads:
            pipe = connection.pipeline(transaction=False)
            for channel, doc in step:
                pipe.publish(channel, doc)
            pipe.execute()
            sent += len(step)
    elapsed = time.perf_counter() - started
    return {"events": sent, "seconds": elapsed, "events_per_s": sent / elapsed, "events_per_round_trip": size}


def publisher_alone(settings: Settings, connection: redis.Redis, steps: list[list[Any]], seconds: float) -> dict:
    publisher = Publisher(settings, connection, "bench")
    publisher.start()
    handed = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for step in steps:
            publisher.publish_tokens((event, 0) for event in step)
            handed += len(step)
            # At most STEPS_AHEAD steps ahead of what was sent: a publisher behind a live engine
            # coalesces what piled up since its last round trip, and no more.
            while publisher.events_sent < handed - STEPS_AHEAD * len(step):
                time.sleep(0.0005)
    publisher.flush(timeout=60)
    elapsed = time.perf_counter() - started
    publisher.stop()
    return {
        "events": publisher.events_sent,
        "seconds": elapsed,
        "events_per_s": publisher.events_sent / elapsed,
        "round_trips": publisher.round_trips,
        "events_per_round_trip": publisher.events_sent / max(1, publisher.round_trips),
    }


def node_cpu_s(urls: list[str]) -> list[float]:
    """CPU seconds (user + sys) each Redis node has used so far."""
    out = []
    for url in urls:
        client = redis.Redis.from_url(url)
        try:
            cpu = client.info("cpu")
            out.append(float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]))
        finally:
            client.close()
    return out


def publisher_on(settings: Settings, node_urls: list[str], steps: list[list[Any]], seconds: float) -> dict[str, Any]:
    """The publisher against the settings' Redis (one node, or a Cluster), with each node's CPU."""
    connection = connect(settings)
    try:
        before = node_cpu_s(node_urls)
        figures = publisher_alone(settings, connection, steps, seconds)  # type: ignore[arg-type]
        used = [after - b for after, b in zip(node_cpu_s(node_urls), before, strict=True)]
    finally:
        connection.close()
    per_million = [cpu / max(1, figures["events"]) * 1e6 for cpu in used]
    return {**figures, "nodes": len(node_urls), "node_cpu_s": used, "node_cpu_s_per_million_events": per_million}


def one_node_vs_cluster(base: Settings, steps: list[list[Any]], seconds: float) -> dict[str, Any]:
    """The publisher through one node vs a 3-master Cluster (no replicas: this measures the masters)."""
    prefix = f"bench-transport-{uuid.uuid4().hex[:8]}"
    single = PrivateRedis().start()
    try:
        one = publisher_on(base.model_copy(update={"redis_url": single.url, "key_prefix": prefix}), [single.url],
                           steps, seconds)  # fmt: skip
    finally:
        single.stop()
    cluster = PrivateRedisCluster(replicas_per_master=0).start()
    try:
        settings = base.model_copy(update={"redis_url": cluster.url, "redis_cluster": True, "key_prefix": prefix})
        three = publisher_on(settings, [n.url for n in cluster.nodes], steps, seconds)
    finally:
        cluster.stop()
    return {"one_node": one, "cluster": three, "cluster_vs_one_node": three["events_per_s"] / one["events_per_s"]}


def worker_end_to_end(settings: Settings, model_dir: str, batch: int) -> dict[str, float]:
    from worker.engine import SamplingParams
    from worker.engine.llm import LLM
    from worker.service import WorkerService

    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_seqs=batch)
    prompts = [[5, 6, 7, 8 + i] for i in range(batch)]
    llm.generate(prompts[:2], SamplingParams(max_new_tokens=4))  # first-call warm-up, not measured
    engine_alone = engine_rate(llm, prompts)

    service = WorkerService(settings, llm.engine, model="tiny", name="bench-worker")
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    with QueueClient(settings) as client:
        while not client.live_workers("tiny"):
            time.sleep(0.05)
        spec = SamplingSpec(max_new_tokens=TOKENS_PER_REQUEST, ignore_eos=True)
        started = time.perf_counter()
        ids = [client.submit("tiny", prompt, spec, check_depth=False) for prompt in prompts]
        for request_id in ids:
            client.result(request_id, timeout=600)
        elapsed = time.perf_counter() - started
    service.drain(0)
    thread.join(timeout=30)
    # The machine is shared and noisy: the engine alone is measured before and after, best kept.
    engine_alone = max(engine_alone, engine_rate(llm, prompts))
    served = batch * TOKENS_PER_REQUEST / elapsed
    return {
        "engine_alone_tokens_per_s": engine_alone,
        "worker_tokens_per_s": served,
        "worker_vs_engine_alone": served / engine_alone,
        "publisher_round_trips": service.publisher.round_trips,
    }


def engine_rate(llm: Any, prompts: list[list[int]]) -> float:
    """The engine alone on the same work, run on a helper thread like the worker's loop here:
    torch's intra-op thread pool behaves very differently on the main thread of a busy machine."""
    from worker.engine import SamplingParams

    rate: list[float] = []

    def run() -> None:
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_new_tokens=TOKENS_PER_REQUEST, ignore_eos=True))
        rate.append(len(prompts) * TOKENS_PER_REQUEST / (time.perf_counter() - started))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return rate[0]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="inflightq bench transport", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0, help="how long each measurement runs")
    p.add_argument("--batch", type=positive, default=64, help="token events per engine step (sequences in the batch)")
    p.add_argument("--out", default="bench/results", help="directory for transport-*.json and .md")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="also: the publisher through one node vs a private 3-master Redis Cluster",
    )
    args = p.parse_args(argv)
    return run(seconds=args.seconds, batch=args.batch, out_dir=args.out, cluster=args.cluster)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run(
    *, seconds: float = 5.0, batch: int = 64, out_dir: str = "bench/results", cluster: bool = False
) -> dict[str, Any]:
    from worker.engine.model.tiny_model import make_tiny_llama

    base = get_settings()
    url, private = ensure_redis(base.redis_url)
    prefix = f"bench-transport-{uuid.uuid4().hex[:8]}"
    settings = base.model_copy(update={"redis_url": url, "key_prefix": prefix})
    keys = Keys.for_prefix(prefix)
    connection = redis.Redis.from_url(url, decode_responses=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = str(make_tiny_llama(Path(tmp) / "tiny-random-llama"))
            steps = record_steps(model_dir, batch, steps=32)
            raw_per_step = raw_publish(connection, keys, steps, seconds, 1)
            ours = publisher_alone(settings, connection, steps, seconds)
            raw_coalesced = raw_publish(connection, keys, steps, seconds, STEPS_AHEAD)
            raw = max(raw_per_step, raw_coalesced, key=lambda r: r["events_per_s"])
            end_to_end = worker_end_to_end(settings, model_dir, batch)
            sharded = one_node_vs_cluster(base, steps, seconds) if cluster else None
    finally:
        for key in connection.scan_iter(match=keys.pattern(), count=1000):
            connection.delete(key)
        connection.close()
        if private is not None:
            private.stop()
    report = {
        "command": f"inflightq bench transport --seconds {seconds} --batch {batch}" + (" --cluster" if cluster else ""),
        "model": "tiny RANDOM Llama (hidden 64, 2 layers, SmolLM2 tokenizer), float32, CPU: costs next to nothing",
        "redis": connection_info(url),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "batch": batch,
        "raw_publish": raw,
        "raw_publish_one_step_per_round_trip": raw_per_step,
        "raw_publish_coalesced": raw_coalesced,
        "publisher": ours,
        "publisher_vs_raw": ours["events_per_s"] / raw["events_per_s"],
        "worker_end_to_end": end_to_end,
        "one_node_vs_cluster": sharded,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write(report, Path(out_dir))
    print(markdown(report))
    return report


def connection_info(url: str) -> str:
    client = redis.Redis.from_url(url)
    try:
        return f"Redis {client.info('server')['redis_version']} at {url}"
    finally:
        client.close()


def markdown(report: dict[str, Any]) -> str:
    ours, e2e = report["publisher"], report["worker_end_to_end"]
    one_step = report["raw_publish_one_step_per_round_trip"]["events_per_s"]
    sharded = report.get("one_node_vs_cluster")
    coalesced = report["raw_publish_coalesced"]["events_per_s"]
    return f"""# Transport benchmark ({report["at"]})

Command: `{report["command"]}`
Model: {report["model"]}
{report["redis"]}; {report["machine"]}; batch of {report["batch"]} sequences per step.

| what | token events/s |
|---|---|
| raw pipelined PUBLISH, one step ({report["batch"]} events) per round trip | {one_step:,.0f} |
| raw pipelined PUBLISH, {STEPS_AHEAD} steps per round trip | {coalesced:,.0f} |
| worker publisher: XADD replay log + PUBLISH + EXPIRE, pipelined | {ours["events_per_s"]:,.0f} |
| **publisher / best raw** | **{report["publisher_vs_raw"]:.0%}** (target >= 50%) |

Raw PUBLISH gets its JSON made up front; the publisher serialises every event itself. It was
fed at most {STEPS_AHEAD} steps ahead of what it had sent and coalesced
{ours["events_per_round_trip"]:.0f} events per round trip on average (one script call that
appends each event to its replay log, refreshes the log's TTL and publishes it).

End to end, one worker with the tiny random model serving {report["batch"]} requests of
{TOKENS_PER_REQUEST} tokens from Redis: {e2e["worker_tokens_per_s"]:,.0f} tokens/s, against
{e2e["engine_alone_tokens_per_s"]:,.0f} tokens/s for the same engine on the same work with no Redis
(`LLM.generate`, best of a run before and after): {e2e["worker_vs_engine_alone"]:.0%}. The worker
used about {e2e["worker_tokens_per_s"] / ours["events_per_s"]:.0%} of what its publisher can send:
the engine, not the transport, sets the pace.
""" + (cluster_markdown(sharded) if sharded else "")


def cluster_markdown(sharded: dict[str, Any]) -> str:
    one, three = sharded["one_node"], sharded["cluster"]

    def cpu(figures: dict[str, Any]) -> str:
        return " / ".join(f"{c:.1f}" for c in figures["node_cpu_s_per_million_events"])

    return f"""
## One node vs a 3-master Redis Cluster

The same publisher (one process, one thread), fed the same steps: through one Redis node
(standalone), and through a private 3-master Cluster (`INFLIGHTQ_REDIS_CLUSTER=true`: one script
call per slot of the step's requests, one pipelined round trip per node, SPUBLISH).

| where | token events/s | events per round trip | CPU s per 1M events, per node |
|---|---|---|---|
| one node | {one["events_per_s"]:,.0f} | {one["events_per_round_trip"]:.0f} | {cpu(one)} |
| 3-master Cluster | {three["events_per_s"]:,.0f} | {three["events_per_round_trip"]:.0f} | {cpu(three)} |
| **Cluster / one node** | **{sharded["cluster_vs_one_node"]:.2f}** | | |

On a Cluster each node carries about a third of the events, so a node's CPU per event (the
figure a capacity plan divides by) is what to compare; one publishing process on a 2-core
machine is bound by its own Python, not by the nodes.
"""


def write(report: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    (out_dir / f"transport-{stamp}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"transport-{stamp}.md").write_text(markdown(report))


if __name__ == "__main__":
    main()
