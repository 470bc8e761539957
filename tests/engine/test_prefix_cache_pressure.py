"""The prefix cache under block pressure: seeded random request mixes (shared prefixes, tenants,
priorities, requests arriving mid-run) through an engine whose block pool is small enough that
blocks are evicted, reused and shared all the time, with preemption and chunked prefill. Every
output equals transformers' ``generate`` token for token (float64), and after every step the block
manager's books agree with what the KV cache physically holds."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.engine.conftest import reference, run_to_end
from worker.engine import LLMEngine, SamplingParams

pytestmark = pytest.mark.slow

BLOCK = 4
TENANTS = (None, "acme", "globex")


@dataclass
class KVWrites:
    """What each block's slots hold, as the forward writes them: (tenant, token id) per slot. Recorded
    from the model runner's own arguments (sequence, block table, positions) before each forward."""

    slots: list[list[tuple[str | None, int] | None]]
    overwritten: int = 0  # writes into a full block that held other tokens: a cached block reused
    chunks: int = 0  # prompt chunks that left part of their prompt for a later step
    seen: set[str] = field(default_factory=set)

    @classmethod
    def watch(cls, engine: LLMEngine) -> KVWrites:
        writes = cls([[None] * BLOCK for _ in range(engine.num_total_blocks)])
        forward = engine.runner.run

        def run(seqs: list[Any], num_new_tokens: list[int], *args: Any) -> Any:
            for seq, n in zip(seqs, num_new_tokens, strict=True):
                writes.record(seq, n)
            return forward(seqs, num_new_tokens, *args)

        engine.runner.run = run  # type: ignore[method-assign]
        return writes

    def record(self, seq: Any, n: int) -> None:
        start = seq.num_computed_tokens
        if start + n < seq.num_tokens and n > 1:
            self.chunks += 1
        for pos in range(start, start + n):
            slots = self.slots[seq.block_table[pos // BLOCK]]
            entry = (seq.tenant, seq.token_ids[pos])
            if pos % BLOCK == 0 and all(slots) and slots[0] != entry:
                self.overwritten += 1
            slots[pos % BLOCK] = entry


def check_books(engine: LLMEngine, writes: KVWrites) -> None:
    """The block manager's invariants, checked against the sequences it serves and the KV written."""
    bm = engine.block_manager
    seqs = list(engine._seqs.values())
    holders = Counter(b for s in seqs for b in s.block_table)
    assert bm.ref_counts == [holders[b] for b in range(bm.num_blocks)], "ref counts differ from the block tables"
    used = sum(1 for c in bm.ref_counts if c)
    assert bm.num_free_blocks + used == bm.num_blocks, "free + used != total"
    assert all((b in bm._free) == (bm.ref_counts[b] == 0) for b in range(bm.num_blocks))
    for b, count in holders.items():
        assert count == 1 or bm._hash_of[b] is not None, f"block {b} is shared but not a cached prefix block"
    for s in seqs:
        assert len(set(s.block_table)) == len(s.block_table)
        assert len(s.block_table) >= bm.blocks_for(s.num_computed_tokens)
        for pos in range(s.num_computed_tokens):  # what this sequence attends to is its own tokens
            held = writes.slots[s.block_table[pos // BLOCK]][pos % BLOCK]
            assert held == (s.tenant, s.token_ids[pos]), f"{s.request_id} reads another request's KV at {pos}"
    for h, b in bm._cached.items():
        assert bm._hash_of[b] == h
        held = writes.slots[b]
        assert bm._tokens_of[b] == tuple(t for _, t in held), f"cached block {b} no longer holds its tokens"


@dataclass(frozen=True)
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    tenant: str | None
    priority: int
    max_new_tokens: int


def request_mix(rng: random.Random, count: int, max_len: int) -> list[Arrival]:
    """Prompts made of a few shared prefixes and short tails; some repeat an earlier prompt exactly
    (after its blocks may have been reused); arrivals spread over the first steps."""
    prefixes = [[rng.randrange(3, 40_000) for _ in range(rng.randrange(4, 18))] for _ in range(3)]
    arrivals: list[Arrival] = []
    for i in range(count):
        max_new = rng.randrange(1, 7)
        if arrivals and rng.random() < 0.25:
            prompt = rng.choice(arrivals).prompt
        else:
            tail = [rng.randrange(3, 40_000) for _ in range(rng.randrange(0, 9))]
            prompt = (rng.choice(prefixes) + tail) or [rng.randrange(3, 40_000)]
        prompt = prompt[: max_len - max_new]
        arrival = Arrival(
            rng.randrange(0, 3 * count), f"r{i}", prompt, rng.choice(TENANTS), rng.randrange(0, 3), max_new
        )
        arrivals.append(arrival)
    return sorted(arrivals, key=lambda a: a.step)


def drive(engine: LLMEngine, arrivals: list[Arrival], writes: KVWrites) -> dict[str, list[int]]:
    """Adds each request at its step, steps the engine until idle, checking the books after every step."""
    out: dict[str, list[int]] = {a.request_id: [] for a in arrivals}
    pending = list(arrivals)
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            params = SamplingParams(max_new_tokens=a.max_new_tokens)
            engine.add_request(a.request_id, a.prompt, params, priority=a.priority, tenant=a.tenant)
        for event in engine.step():
            if event.token_id >= 0:
                out[event.request_id].append(event.token_id)
        check_books(engine, writes)
        step += 1
        assert step < 5_000, "engine did not finish"
    return out


@pytest.fixture(scope="module")
def references() -> dict[tuple[int, ...], list[int]]:
    return {}


def expected(tiny_ref: Any, refs: dict[tuple[int, ...], list[int]], prompt: list[int], n: int) -> list[int]:
    key = tuple(prompt)
    if len(refs.get(key, ())) < n:
        refs[key] = reference(tiny_ref, prompt, 6)
    return refs[key][:n]


@pytest.mark.parametrize("seed", range(6))
def test_random_mixes_under_block_pressure_match_generate(
    make_engine: Any, tiny_ref: Any, references: dict[tuple[int, ...], list[int]], seed: int
) -> None:
    rng = random.Random(seed)
    engine = make_engine(
        num_kv_blocks=rng.choice([10, 12, 16]),
        block_size=BLOCK,
        max_num_batched_tokens=rng.choice([6, 8, 12]),  # under the longest prompts: chunked
        max_num_seqs=rng.choice([2, 3, 4]),
        aging_steps=None,
    )
    writes = KVWrites.watch(engine)
    arrivals = request_mix(rng, 20, engine.max_model_len)
    out = drive(engine, arrivals, writes)
    for a in arrivals:
        assert out[a.request_id] == expected(tiny_ref, references, a.prompt, a.max_new_tokens), (
            f"seed {seed}: {a.request_id} ({len(a.prompt)} tokens, tenant {a.tenant}) diverged from generate"
        )
    # The mix did what it is for: blocks came from the cache, cached blocks were reused, prompts were
    # chunked and sequences preempted.
    stats = engine.stats
    assert stats.prefix_cache_hits > 0 and writes.overwritten > 0
    assert writes.chunks > 0 and stats.preemptions > 0


def test_a_prompt_run_again_after_its_blocks_were_reused_matches_generate(make_engine: Any, tiny_ref: Any) -> None:
    """A, then B (which takes A's freed blocks), then A again: only what is still A's may be found."""
    rng = random.Random(11)
    a, b = ([rng.randrange(3, 40_000) for _ in range(40)] for _ in range(2))
    engine = make_engine(num_kv_blocks=16, block_size=BLOCK)
    writes = KVWrites.watch(engine)
    for request_id, prompt in (("a1", a), ("b", b), ("a2", a)):
        hits = engine.stats.prefix_cache_hits
        engine.add_request(request_id, prompt, SamplingParams(max_new_tokens=6))
        events = run_to_end(engine)[request_id]
        assert [e.token_id for e in events] == reference(tiny_ref, prompt, 6)
        check_books(engine, writes)
    # B's 12 blocks overwrote A's least recently freed ones: A's run again finds only the 4 left of its head.
    assert engine.stats.prefix_cache_hits - hits == 4 * BLOCK
