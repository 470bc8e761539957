"""BlockManager on its own: blocks handed out and given back, ref counts of shared prefix blocks,
the chained hash of a prefix (rooted in the tenant), and eviction when a cached block is reused."""

from __future__ import annotations

import itertools

import pytest

from shared.prefix_hash import chain
from worker.engine import SamplingParams
from worker.engine.core.block_manager import BlockManager
from worker.engine.core.sequence import Sequence

_ids = itertools.count()


def seq(tokens: list[int], tenant: str | None = None) -> Sequence:
    return Sequence(f"r{next(_ids)}", tokens, SamplingParams(max_new_tokens=4), arrival=0, tenant=tenant)


def compute(bm: BlockManager, s: Sequence, n: int | None = None) -> None:
    """What a step does for ``s``: blocks for ``n`` more tokens (all of them by default), then publish."""
    n = s.num_tokens - s.num_computed_tokens if n is None else n
    assert bm.allocate(s, n)
    s.num_computed_tokens += n
    bm.register_computed(s)


PROMPT = list(range(100, 110))  # 2 full blocks of 4 and a partial one


def test_allocate_takes_blocks_for_the_tokens_and_free_returns_them() -> None:
    bm = BlockManager(8, 4)
    s = seq(PROMPT)
    assert bm.blocks_needed(s, 10) == 3
    assert bm.allocate(s, 10)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert all(bm.ref_counts[b] == 1 for b in s.block_table)
    bm.free(s)
    assert bm.num_free_blocks == 8 and not any(bm.ref_counts)
    assert s.block_table == [] and s.num_computed_tokens == 0


def test_allocate_short_of_blocks_changes_nothing() -> None:
    bm = BlockManager(2, 4)
    s = seq(PROMPT)
    assert not bm.allocate(s, 10)
    assert s.block_table == [] and bm.num_free_blocks == 2 and not any(bm.ref_counts)


def test_allocate_only_adds_what_the_new_tokens_need() -> None:
    bm = BlockManager(8, 4)
    s = seq(PROMPT)
    compute(bm, s, 6)  # 2 blocks
    assert len(s.block_table) == 2
    assert bm.blocks_needed(s, 2) == 0 and bm.allocate(s, 2)
    assert len(s.block_table) == 2
    assert bm.blocks_needed(s, 3) == 1


def test_freeing_twice_is_caught() -> None:
    bm = BlockManager(4, 4)
    s = seq(PROMPT)
    compute(bm, s)
    table = list(s.block_table)
    bm.free(s)
    s.block_table = table
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(s)


def test_full_blocks_are_shared_by_a_later_sequence_with_the_same_prefix() -> None:
    bm = BlockManager(8, 4)
    first = seq(PROMPT)
    compute(bm, first)
    second = seq([*PROMPT[:8], 999, 998])
    assert bm.match_prefix(second) == 8
    assert second.block_table == first.block_table[:2]
    assert [bm.ref_counts[b] for b in first.block_table] == [2, 2, 1]
    bm.free(first)
    assert [bm.ref_counts[b] for b in second.block_table] == [1, 1]
    bm.free(second)
    assert bm.num_free_blocks == 8 and not any(bm.ref_counts)


def test_freed_blocks_stay_cached_until_reused() -> None:
    bm = BlockManager(8, 4)
    first = seq(PROMPT)
    compute(bm, first)
    head = first.block_table[:2]
    bm.free(first)
    again = seq(PROMPT)
    assert bm.match_prefix(again) == 8
    assert again.block_table == head
    assert bm.num_free_blocks == 6  # taken back off the free list


def test_match_leaves_the_last_token_to_compute() -> None:
    bm = BlockManager(8, 4)
    compute(bm, seq(PROMPT[:8]))
    exact = seq(PROMPT[:8])  # both blocks cached, but the step needs the last token's logits
    assert bm.match_prefix(exact) == 4


def test_the_hash_chain_covers_everything_before_a_block() -> None:
    bm = BlockManager(8, 4)
    compute(bm, seq(PROMPT))
    # Same second block, different first one: the second block's hash differs, nothing matches.
    other = seq([1, 2, 3, 4, *PROMPT[4:]])
    assert bm.match_prefix(other) == 0
    assert bm._block_hash(other, 1) != bm._block_hash(seq(PROMPT), 1)


def test_tenants_never_share_blocks() -> None:
    bm = BlockManager(8, 4)
    compute(bm, seq(PROMPT, tenant="acme"))
    assert bm.match_prefix(seq(PROMPT, tenant="globex")) == 0
    assert bm.match_prefix(seq(PROMPT)) == 0
    assert bm.match_prefix(seq(PROMPT, tenant="acme")) == 8


def test_blocks_without_a_hash_are_reused_before_cached_ones() -> None:
    bm = BlockManager(4, 4)
    cached = seq(PROMPT[:8])
    compute(bm, cached)  # 2 full blocks, cached
    blocks = list(cached.block_table)
    bm.free(cached)
    newcomer = seq([7] * 8)
    assert bm.allocate(newcomer, 8)
    assert not set(newcomer.block_table) & set(blocks)
    assert bm.match_prefix(seq(PROMPT)) == 8  # still there


def test_reusing_a_cached_block_evicts_its_hash_and_tokens() -> None:
    bm = BlockManager(2, 4)
    old = seq(PROMPT[:8])
    compute(bm, old)
    bm.free(old)
    new = seq([7, 7, 7, 7, 6, 6, 6, 6, 5])
    compute(bm, new, 8)  # takes both cached blocks and overwrites them
    assert set(new.block_table) == {0, 1}
    for i, block in enumerate(new.block_table):
        assert bm._tokens_of[block] == tuple(new.token_ids[4 * i : 4 * i + 4])
    assert bm.match_prefix(seq(PROMPT)) == 0  # the old prefix is gone
    bm.free(new)
    assert bm.match_prefix(seq([7, 7, 7, 7, 6, 6, 6, 6, 1])) == 8  # the new one is cached in its place


def test_evicting_an_unfinished_reuse_leaves_no_stale_entry() -> None:
    """A reused block that is overwritten only partly never gets a hash: nothing may find the old prefix in it."""
    bm = BlockManager(1, 4)
    old = seq([1, 2, 3, 4, 5])
    compute(bm, old, 4)
    bm.free(old)
    partial = seq([9, 9, 9])
    compute(bm, partial)
    assert bm._hash_of[partial.block_table[0]] is None
    bm.free(partial)
    assert bm.match_prefix(seq([1, 2, 3, 4, 5])) == 0


def test_prefix_caching_off_registers_nothing() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    compute(bm, seq(PROMPT))
    assert bm.match_prefix(seq(PROMPT)) == 0
    assert not any(h is not None for h in bm._hash_of)


def test_the_block_hashes_are_the_shared_chain() -> None:
    """The API computes a request's chain with ``shared.prefix_hash``: the engine registers its blocks under it."""
    bm = BlockManager(8, 4)
    s = seq(PROMPT, tenant="acme")
    compute(bm, s)
    expected = chain(PROMPT, 4, tenant="acme")
    assert len(expected) == 2
    assert [bm._hash_of[b] for b in s.block_table[:2]] == expected
    assert sorted(bm.drain_changes(full=True).cached) == sorted(expected)


def test_drained_changes_follow_caching_and_eviction() -> None:
    bm = BlockManager(2, 4)
    old = seq(PROMPT[:8])
    compute(bm, old)
    first = bm.drain_changes()
    assert sorted(first.cached) == sorted(chain(PROMPT[:8], 4)) and first.evicted == [] and not first.full
    assert bm.drain_changes().cached == []  # drained once
    bm.free(old)
    new = seq([7, 7, 7, 7, 6, 6, 6, 6, 5])
    compute(bm, new, 8)  # overwrites both cached blocks
    changes = bm.drain_changes()
    assert sorted(changes.evicted) == sorted(chain(PROMPT[:8], 4))
    assert sorted(changes.cached) == sorted(chain(new.token_ids, 4))
    assert sorted(bm.drain_changes(full=True).cached) == sorted(changes.cached)


def test_a_hash_evicted_and_cached_again_between_drains_counts_as_cached() -> None:
    bm = BlockManager(1, 4)
    a = seq([1, 2, 3, 4, 5])
    compute(bm, a, 4)
    bm.free(a)
    b = seq([9, 9, 9, 9, 9])
    compute(bm, b, 4)  # evicts a's block
    bm.free(b)
    again = seq([1, 2, 3, 4, 5])
    compute(bm, again, 4)  # evicts b's, caches a's again
    changes = bm.drain_changes()
    assert changes.cached == chain([1, 2, 3, 4], 4) and changes.evicted == chain([9, 9, 9, 9], 4)


def test_undrained_changes_past_the_bound_become_a_full_drain() -> None:
    bm = BlockManager(1, 4)
    for i in range(1100):  # each caches one hash and evicts the one before
        s = seq([i] * 4 + [0])
        compute(bm, s, 4)
        bm.free(s)
    changes = bm.drain_changes()
    assert changes.full and changes.cached == chain([1099] * 4, 4) and changes.evicted == []
    assert not bm.drain_changes().full
