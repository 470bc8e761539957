"""A worker's held prefixes in Redis (worker/held_blocks.py) against its engine's prefix cache: a real
engine on the tiny model with a KV pool small enough that blocks are evicted all the time, the real
publisher and heartbeat, a real Redis. After every step the set in Redis is what the engine's cache
holds; a set that went missing is written again whole; drain and stop remove it."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from shared.affinity import LIVE, adapter_member
from shared.keys import Keys
from shared.prefix_hash import chain, to_hex
from shared.settings import Settings
from tests.engine.test_lora import ADAPTERS, make_adapter
from worker.engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from worker.engine.model.model_loader import load_model
from worker.heartbeat import Heartbeat
from worker.held_blocks import HeldBlocks
from worker.publisher import Publisher
from worker.run_state import RunState

BLOCK = 4
MODEL = "m"


@pytest.fixture
def parts(redis_url: str, key_prefix: str, tiny_model_dir: Path) -> Iterator[tuple[LLMEngine, HeldBlocks, Settings]]:
    settings = Settings(redis_url=redis_url, key_prefix=key_prefix, model=MODEL)
    model, tokenizer = load_model(str(tiny_model_dir), torch.float64, "cpu")
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=24, block_size=BLOCK, max_num_seqs=4))
    connection = redis.Redis.from_url(redis_url, decode_responses=True)
    publisher = Publisher(settings, connection, "w")
    publisher.start()
    state = RunState()
    held = HeldBlocks(
        settings, connection, publisher, engine,
        name="w", model=MODEL, draining=state.draining,
    )  # fmt: skip
    yield engine, held, settings
    publisher.stop(timeout=5)
    connection.close()


def in_redis(settings: Settings) -> set[str]:
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        return set(client.smembers(Keys.for_prefix(settings.key_prefix).held(MODEL, "w")))
    finally:
        client.close()


def cached(engine: LLMEngine) -> set[str]:
    """What the engine's prefix cache can match now: its hash -> block table."""
    return {to_hex(h) for h in engine.block_manager._cached}


def advertised(engine: LLMEngine) -> set[str]:
    """What the held set must be: the cache, and live."""
    return cached(engine) | {LIVE}


def step_and_sync(engine: LLMEngine, held: HeldBlocks) -> None:
    engine.step()
    held.sync()
    assert held.publisher.flush(timeout=10)


def test_the_set_follows_the_cache_through_evictions(parts: tuple[LLMEngine, HeldBlocks, Settings]) -> None:
    engine, held, settings = parts
    held.sync()  # the first sync creates the set, empty but live
    assert held.publisher.flush(timeout=10)
    assert in_redis(settings) == {LIVE}
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 200) for _ in range(12)] for _ in range(4)]
    evicted = 0
    for i in range(24):  # 24 requests of ~4-6 blocks each through a 24-block pool: most blocks are reused
        prompt = rng.choice(prefixes) + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 12))]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))
        if i % 3 == 2:
            while engine.has_unfinished():
                before = cached(engine)
                step_and_sync(engine, held)
                evicted += len(before - cached(engine))
                assert in_redis(settings) == advertised(engine)
    assert evicted > 10  # the pool was small enough to evict, many times
    assert held.rewrites == 1  # the first sync only: every other change went as a delta


def test_the_engine_and_the_api_name_blocks_alike(parts: tuple[LLMEngine, HeldBlocks, Settings]) -> None:
    engine, held, settings = parts
    prompt = list(range(10, 23))  # 3 full blocks and one token
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=1), tenant="acme")
    while engine.has_unfinished():
        step_and_sync(engine, held)
    expected = {to_hex(h) for h in chain(prompt, BLOCK, tenant="acme")}
    assert len(expected) == 3 and expected <= in_redis(settings)


def test_a_started_prompt_is_advertised_before_its_prefill_and_withdrawn_if_never_cached(
    parts: tuple[LLMEngine, HeldBlocks, Settings],
) -> None:
    engine, held, settings = parts
    held.block_size = BLOCK  # the engine's, as the API's setting must be
    prompt, lost = list(range(10, 23)), list(range(40, 53))  # 3 full blocks and one token each
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=2, ignore_eos=True), tenant="acme")
    held.promise("r", prompt, "acme")
    held.promise("gone", lost, None)  # started, then cancelled before any step computed it
    held.sync()
    assert held.publisher.flush(timeout=10)
    promised = {to_hex(h) for h in chain(prompt, BLOCK, tenant="acme")}
    never = {to_hex(h) for h in chain(lost, BLOCK)}
    assert not cached(engine) and promised | never <= in_redis(settings), "advertised before the prefill"
    held.settled("gone")
    while engine.has_unfinished():
        step_and_sync(engine, held)
    held.settled("r")
    held.sync()
    assert held.publisher.flush(timeout=10)
    assert promised <= cached(engine) and in_redis(settings) == advertised(engine), "what is cached stays"


def test_a_set_gone_missing_is_written_whole_after_the_next_heartbeat(
    parts: tuple[LLMEngine, HeldBlocks, Settings],
) -> None:
    engine, held, settings = parts
    engine.add_request("a", list(range(10, 30)), SamplingParams(max_new_tokens=2))
    while engine.has_unfinished():
        step_and_sync(engine, held)
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    key = Keys.for_prefix(settings.key_prefix).held(MODEL, "w")
    client.delete(key)  # as when it expired during an outage, or a recovery took this worker for dead
    engine.add_request("b", list(range(50, 62)), SamplingParams(max_new_tokens=2))
    step_and_sync(engine, held)
    assert LIVE not in in_redis(settings)  # a delta alone: part of the cache, not live
    beat = Heartbeat(settings, client, "w", lambda: _heartbeat(engine), threading.Event(), held)
    beat.beat()
    assert 0 < client.ttl(key) <= settings.heartbeat_ttl_s
    held.sync()
    assert held.publisher.flush(timeout=10)
    assert in_redis(settings) == advertised(engine)
    while engine.has_unfinished():
        step_and_sync(engine, held)
    client.close()


def test_drain_removes_the_set_and_nothing_writes_it_again(parts: tuple[LLMEngine, HeldBlocks, Settings]) -> None:
    engine, held, settings = parts
    engine.add_request("a", list(range(10, 30)), SamplingParams(max_new_tokens=4))
    step_and_sync(engine, held)
    assert LIVE in in_redis(settings)
    held.draining.set()
    while engine.has_unfinished():  # still running what it has, caching its blocks
        step_and_sync(engine, held)
    assert in_redis(settings) == set()
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    beat = Heartbeat(settings, client, "w", lambda: _heartbeat(engine), threading.Event(), held)
    beat.beat()
    held.sync()
    assert held.publisher.flush(timeout=10)
    assert in_redis(settings) == set()
    client.close()


def _heartbeat(engine: LLMEngine) -> object:
    from shared.schemas import WorkerHeartbeat

    return WorkerHeartbeat(
        name="w", model=MODEL, device="cpu", dtype="float64", threads=1, max_num_seqs=engine.max_num_seqs,
        num_kv_blocks=engine.num_total_blocks, running=0, waiting=0, free_kv_blocks=engine.num_free_blocks,
        engine_steps=0, preemptions=0, started_at=0.0, draining=False,
    )  # fmt: skip


def test_with_affinity_off_nothing_is_written(parts: tuple[LLMEngine, HeldBlocks, Settings]) -> None:
    engine, on, settings = parts
    off_settings = settings.model_copy(update={"affinity": False})
    held = HeldBlocks(
        off_settings, on.redis, on.publisher, engine,
        name="w", model=MODEL, draining=threading.Event(),
    )  # fmt: skip
    engine.add_request("a", list(range(10, 30)), SamplingParams(max_new_tokens=2))
    while engine.has_unfinished():
        step_and_sync(engine, held)
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    Heartbeat(off_settings, client, "w", lambda: _heartbeat(engine), threading.Event(), held).beat()
    assert not client.exists(Keys.for_prefix(settings.key_prefix).held(MODEL, "w"))
    client.close()


def test_loaded_adapters_are_advertised_and_their_blocks_rooted_in_them(
    redis_url: str, key_prefix: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The set names each LoRA adapter the engine holds (in step with loads and LRU evictions, and in a
    whole rewrite), and an adapter request's blocks are the chain the API computes from the adapter's key."""
    settings = Settings(redis_url=redis_url, key_prefix=key_prefix, model=MODEL)
    model, tokenizer = load_model(str(tiny_model_dir), torch.float64, "cpu")
    config = EngineConfig(num_kv_blocks=24, block_size=BLOCK, max_num_seqs=4, max_loras=1)
    engine = LLMEngine(model, tokenizer, config)
    loras = {
        name: LoRARequest(name, str(make_adapter(model, tmp_path / name, seed, *ADAPTERS[name])))
        for seed, name in enumerate(("attn", "mlp"))
    }
    connection = redis.Redis.from_url(redis_url, decode_responses=True)
    publisher = Publisher(settings, connection, "w")
    publisher.start()
    held = HeldBlocks(
        settings, connection, publisher, engine,
        name="w", model=MODEL, draining=threading.Event(),
    )  # fmt: skip
    try:
        held.sync()
        assert held.publisher.flush(timeout=10)
        assert in_redis(settings) == {LIVE}
        prompt = list(range(10, 23))  # 3 full blocks and one token
        for i, name in enumerate(("attn", "mlp")):  # max_loras 1: the second evicts the first
            engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=2), lora=loras[name])
            while engine.has_unfinished():
                step_and_sync(engine, held)
            assert in_redis(settings) == advertised(engine) | {adapter_member(loras[name].key)}
            blocks = {to_hex(h) for h in chain(prompt, BLOCK, adapter=loras[name].key)}
            assert len(blocks) == 3 and blocks <= in_redis(settings)
        connection.delete(Keys.for_prefix(key_prefix).held(MODEL, "w"))
        held._rewrite.set()  # as the heartbeat does when the set went missing
        held.sync()
        assert held.publisher.flush(timeout=10)
        assert in_redis(settings) == advertised(engine) | {adapter_member(loras["mlp"].key)}
    finally:
        publisher.stop(timeout=5)
        connection.close()
