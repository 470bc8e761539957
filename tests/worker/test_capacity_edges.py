"""The capacity claim (``policy.Capacity``) at its edges: exact block boundaries, room below zero,
several urgent entries and several victims. Each case here killed a mutant that the broader tests let survive
(bench/results/mutation-2026-12-01.md)."""

from __future__ import annotations

from tests.worker.test_capacity import load
from worker.engine.core.policy import Capacity, Take

NONE = Capacity(prefetch=0)


def fit(spare: int, lengths: list[int]) -> int:
    return NONE.how_many_to_take(load(spare=spare), (), 1, lengths, idle=False).fit


def test_a_prompt_needs_blocks_for_itself_and_its_next_token() -> None:
    # 5 tokens + 1 = 6: two blocks of 4, not one; 7 + 1 = 8: exactly two.
    assert (fit(1, [5]), fit(2, [5])) == (0, 1)
    assert (fit(2, [7]), fit(2, [8])) == (1, 0)


def test_each_taken_prompt_counts_a_whole_block_of_waste() -> None:
    # 5 tokens (+4 waste) then 3: 5 + 4 + 3 + 1 = 13 tokens -> 4 blocks.
    assert (fit(3, [5, 3]), fit(4, [5, 3])) == (1, 2)


def test_no_room_at_all_takes_nothing_even_with_blocks_to_spare() -> None:
    # More sequences than slots (a smaller prefetch after a restart, starts in transit): room < 0.
    assert NONE.room(load(seqs=6), ()) == -2
    assert NONE.how_many_to_take(load(seqs=6, spare=1000), (), 1, [4], idle=True) == Take(0, 0)
    assert NONE.how_many_to_take(load(seqs=3, spare=1000), (1, 1), 1, [4], idle=True) == Take(0, 0)


def test_more_victims_than_urgent_entries_displace_one_per_entry() -> None:
    full = load(seqs=4, spare=0, running=((3, 10), (3, 10), (3, 10)))
    take = NONE.how_many_to_take(full, (), 0, [4], idle=False)
    assert take == Take(fit=0, displace=1) and take.total == 1


def test_entries_after_those_that_fit_are_sized_in_their_own_order() -> None:
    # One free slot takes the first entry; victims then serve the next ones, in order, each with
    # its own length: the third (80 tokens) does not fit the blocks two victims free.
    one_slot = load(seqs=3, spare=2, running=((3, 10), (3, 10)))
    take = NONE.how_many_to_take(one_slot, (), 0, [4, 4, 80], idle=False)
    assert take == Take(fit=1, displace=1) and take.total == 2
    # Two free slots, then the victims: the fourth entry (80) stops it, the fifth is never looked at.
    two_slots = load(seqs=2, spare=4, running=((3, 10), (3, 10)))
    assert NONE.how_many_to_take(two_slots, (), 0, [4, 4, 4, 80, 4], idle=False) == Take(fit=2, displace=1)


def test_an_urgent_entry_is_served_by_one_victim_not_by_several() -> None:
    # The least urgent victim frees 1 block, the entry needs 3: it is not taken on the strength of
    # the next victim's blocks too (each displaced sequence serves one entry).
    full = load(seqs=4, spare=0, running=((3, 1), (2, 10)))
    assert NONE.how_many_to_take(full, (), 0, [8], idle=False) == Take(0, 0)
    assert NONE.how_many_to_take(full, (), 0, [2], idle=False) == Take(0, 1)


def test_displaced_blocks_count_the_next_token_too() -> None:
    # A 4-token entry needs 2 blocks (4 + 1 tokens); a victim with exactly 1 block is not enough.
    assert NONE.how_many_to_take(load(seqs=4, spare=0, running=((3, 1),)), (), 0, [4], idle=False) == Take(0, 0)
    assert NONE.how_many_to_take(load(seqs=4, spare=0, running=((3, 2),)), (), 0, [4], idle=False) == Take(0, 1)
