"""Prefix affinity at dispatch, against a real Redis: the lookup script (shared/affinity.py) finds the
live worker holding a request's longest prefix, and the dispatcher offers the request to it (the
entry lands on that worker's offer stream). Workers here are heartbeats and held sets written by
hand, so every case is exact; tests/worker/test_affinity_workers.py runs real workers. The same tests
run on a Redis Cluster in test_affinity_on_cluster.py."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import redis

from producer_api.dispatch import Dispatcher
from shared.adapters import AdapterRecord, register
from shared.affinity import LIVE, LONGEST_PREFIX, adapter_member, holder, lookup
from shared.async_client import AsyncQueueClient
from shared.keys import Keys
from shared.prefix_hash import chain, to_hex
from shared.request_builder import build_request
from shared.schemas import SamplingSpec, WorkerHeartbeat
from shared.settings import Settings
from tests.conftest import RedisBackend

MODEL = "m"
BLOCK = 16


def hold(client: redis.Redis, keys: Keys, worker: str, tokens: list[int], blocks: int) -> None:
    """``worker`` advertises the first ``blocks`` blocks of ``tokens`` (live, as a worker's set is)."""
    hashes = [to_hex(h) for h in chain(tokens, BLOCK)[:blocks]]
    client.sadd(keys.held(MODEL, worker), LIVE, *hashes)


def test_the_lookup_finds_the_longest_held_prefix(redis_client: redis.Redis, key_prefix: str) -> None:
    """Random pools: the script's answer (binary search per worker) equals a scan of every set."""
    keys = Keys.for_prefix(key_prefix)
    client = redis_client
    script = client.register_script(LONGEST_PREFIX)
    rng = random.Random(3)
    for case in range(40):
        tokens = [rng.randrange(50_000) for _ in range(BLOCK * rng.randrange(1, 40))]
        workers = [f"c{case}-w{i}" for i in range(rng.randrange(1, 6))]
        held = {w: rng.randrange(0, len(tokens) // BLOCK + 1) for w in workers}
        for w, blocks in held.items():
            if rng.random() < 0.8:  # the rest are gone: no set at all
                hold(client, keys, w, tokens, blocks)
            else:
                held[w] = 0
        best = max(held.values())
        args = lookup(keys, MODEL, workers, tokens, BLOCK)
        index, blocks, holders = script(keys=args[0], args=args[1])
        assert blocks == best
        if best:
            assert workers[index - 1] == next(w for w in workers if held[w] == best)  # the first of the longest
            assert holders == sum(1 for b in held.values() if b == best)
        else:
            assert index == 0


def test_no_offer_when_every_worker_holds_as_much_or_nobody_holds_the_first_block() -> None:
    assert holder([2, 5, 1], ["a", "b"]) == ("b", 5)
    assert holder([1, 5, 2], ["a", "b"]) == (None, 5)  # a prefix every worker holds says nothing
    assert holder([0, 0, 0], ["a", "b"]) == (None, 0)


def heartbeat(name: str, running: int = 0) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        name=name, model=MODEL, device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=100,
        running=running, waiting=0, free_kv_blocks=100, started_at=time.time(),
    )  # fmt: skip


async def advertise(client: AsyncQueueClient, *beats: WorkerHeartbeat) -> None:
    for beat in beats:
        await client.redis.set(client.keys.worker(beat.name), beat.model_dump_json())
        await client.redis.zadd(client.keys.workers(), {beat.name: time.time()})


@pytest.mark.parametrize("affinity", [True, False])
def test_a_request_is_offered_to_the_worker_holding_its_prefix(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str, affinity: bool
) -> None:
    settings = Settings(
        redis_url=redis_backend.url, redis_cluster=redis_backend.cluster, key_prefix=key_prefix, model=MODEL,
        affinity=affinity,
    )  # fmt: skip
    keys = Keys.for_prefix(key_prefix)
    history = list(range(100, 100 + 5 * BLOCK))
    sync = redis_client
    hold(sync, keys, "a", history, 1)  # the shared head only
    hold(sync, keys, "b", history, 5)  # the whole history
    document = list(range(3000, 3000 + 4 * BLOCK))
    hold(sync, keys, "a", document, 4)  # a worker holding a document

    async def scenario() -> None:
        async with AsyncQueueClient(settings) as client:
            await advertise(client, heartbeat("a"), heartbeat("b", running=3))
            dispatcher = Dispatcher(settings, client)
            follow_up = build_request(settings, MODEL, [*history, 7, 8, 9], SamplingSpec(max_new_tokens=4))
            await dispatcher.submit(follow_up)
            other = build_request(settings, MODEL, list(range(5000, 5040)), SamplingSpec(max_new_tokens=4))
            await dispatcher.submit(other)
            about_document = build_request(settings, MODEL, [*document, 1, 2], SamplingSpec(max_new_tokens=4))
            await dispatcher.submit(about_document)

    asyncio.run(scenario())
    offers = keys.offers(MODEL, settings.default_priority, "b")
    lane = keys.stream(MODEL, settings.default_priority)
    a_offers = keys.offers(MODEL, settings.default_priority, "a")
    if affinity:
        assert sync.xlen(offers) == 1  # the follow-up, although b is the busier worker
        assert sync.xlen(a_offers) == 1  # the question about a's document
        # Each offer carries what its worker holds of it: a busy taker would prefill that again.
        assert sync.xrange(offers)[0][1]["held"] == str(5 * BLOCK)
        assert sync.xrange(a_offers)[0][1]["held"] == str(4 * BLOCK)
        assert sync.xlen(lane) == 1  # the unrelated prompt: nobody holds its first block
        # An offer wakes its worker alone (nobody else may take it yet); the lane's entry whichever worker waits.
        assert sync.llen(keys.notify_worker(MODEL, "b")) == 1 and sync.llen(keys.notify_worker(MODEL, "a")) == 1
        assert sync.llen(keys.notify(MODEL)) == 1
    else:
        assert not sync.exists(offers) and not sync.exists(a_offers) and sync.xlen(lane) == 3
        assert sync.llen(keys.notify(MODEL)) == 3 and not sync.exists(keys.notify_worker(MODEL, "b"))


def test_an_adapter_request_is_offered_to_its_history_else_to_a_worker_holding_the_adapter(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """The chain of a request with an adapter is rooted in the adapter's key (as the engine roots it):
    the worker holding that history gets it, not one holding the same tokens without the adapter; with
    no history held, the least loaded worker advertising the adapter gets it, unless all or none do."""
    settings = Settings(
        redis_url=redis_backend.url, redis_cluster=redis_backend.cluster, key_prefix=key_prefix, model=MODEL
    )
    keys = Keys.for_prefix(key_prefix)
    sync = redis_client
    record = AdapterRecord(name="tone", base=MODEL, path="/adapters/tone")
    register(sync, keys, record)
    history = list(range(100, 100 + 3 * BLOCK))
    hold(sync, keys, "a", history, 3)  # the same tokens without the adapter
    with_adapter = [to_hex(h) for h in chain(history, BLOCK, adapter=record.key)]
    sync.sadd(keys.held(MODEL, "c"), LIVE, *with_adapter, adapter_member(record.key))
    sync.sadd(keys.held(MODEL, "b"), LIVE, adapter_member(record.key))

    async def scenario() -> list[str | None]:
        async with AsyncQueueClient(settings) as client:
            await advertise(client, heartbeat("a"), heartbeat("b", running=1), heartbeat("c", running=3))
            dispatcher = Dispatcher(settings, client)
            offers = []
            for prompt in ([*history, 7], list(range(5000, 5040)), [1, 2]):  # history, unheld, under a block
                request = build_request(settings, MODEL, prompt, SamplingSpec(max_new_tokens=4))
                request.adapter = "tone"
                offers.append(await dispatcher.offer_to(request, await client.live_workers(MODEL)))
            base = build_request(settings, MODEL, [*history, 7], SamplingSpec(max_new_tokens=4))
            offers.append(await dispatcher.offer_to(base, await client.live_workers(MODEL)))
            return offers

    # The history's holder c although busiest; b (less loaded than c) for the rest; a for the base model's.
    assert asyncio.run(scenario()) == ["c", "b", "b", "a"]

    script = sync.register_script(LONGEST_PREFIX)
    unheld = list(range(7000, 7000 + 2 * BLOCK))
    for holding, expected in (({"a", "b", "c"}, None), (set(), None), ({"b", "c"}, "b"), ({"a", "c"}, "a")):
        member = adapter_member(record.key)
        for w in "abc":
            if w in holding:
                sync.sadd(keys.held(MODEL, w), member)
            else:
                sync.srem(keys.held(MODEL, w), member)
        args = lookup(keys, MODEL, ["a", "b", "c"], unheld, BLOCK, adapter=record.key)
        assert holder(script(keys=args[0], args=args[1]), ["a", "b", "c"]) == (expected, 0)
