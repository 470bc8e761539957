"""What a worker takes from Redis next (``policy.Capacity``), from the engine's load report alone."""

from __future__ import annotations

from worker.engine.core.policy import Capacity, EngineLoad, RunningLoad, Take, Urgency


def load(
    *, seqs: int = 0, spare: int = 100, running: tuple[tuple[float, int], ...] = (), waiting: tuple[float, ...] = ()
) -> EngineLoad:
    return EngineLoad(
        max_num_seqs=4,
        block_size=4,
        num_seqs=seqs,
        spare_blocks=spare,
        running=tuple(RunningLoad(Urgency(p, arrival), b) for arrival, (p, b) in enumerate(running)),
        waiting=tuple(Urgency(p, len(running) + arrival) for arrival, p in enumerate(waiting)),
    )


def test_free_slots_include_the_prefetch_and_exclude_starts_on_their_way() -> None:
    capacity = Capacity(prefetch=2)
    assert capacity.room(load(seqs=3), in_transit=()) == 3
    assert capacity.room(load(seqs=3), in_transit=(3, 3)) == 1
    assert capacity.room(load(seqs=6), in_transit=()) == 0


def test_entries_are_taken_while_slots_and_blocks_last() -> None:
    capacity = Capacity(prefetch=0)
    # 10 blocks of 4 tokens: two 12-token prompts (4 blocks each with the next token, plus waste) fit, not three.
    take = capacity.how_many_to_take(load(spare=10), (), 1, [12, 12, 12], idle=False)
    assert (take.fit, take.displace) == (2, 0)
    assert capacity.how_many_to_take(load(seqs=3), (), 1, [4, 4], idle=False).fit == 1  # one slot left


def test_an_idle_engine_takes_the_first_entry_whatever_its_size() -> None:
    capacity = Capacity(prefetch=0)
    assert capacity.how_many_to_take(load(spare=2), (), 1, [400, 4], idle=True).fit == 1
    assert capacity.how_many_to_take(load(spare=2), (), 1, [400, 4], idle=False).fit == 0


def test_a_full_worker_takes_urgent_entries_one_per_less_urgent_running_sequence() -> None:
    capacity = Capacity(prefetch=0)
    full = load(seqs=4, spare=0, running=((3.0, 8), (3.0, 8), (0.0, 8), (2.5, 8)))
    take = capacity.how_many_to_take(full, (), 0, [8, 8, 8, 8], idle=False)
    assert (take.fit, take.displace) == (0, 3)  # the priority-0 sequence is not less urgent than a new p0
    assert capacity.how_many_to_take(full, (), 3, [8], idle=False).total == 0  # nothing to displace for p3
    # For a p2 entry: the two p3 and the aged p3 (2.5 still ranks below 2), not the p0.
    assert capacity.how_many_to_take(full, (), 2, [8, 8, 8, 8], idle=False).displace == 3


def test_waiting_sequences_as_urgent_claim_victims_first() -> None:
    capacity = Capacity(prefetch=0)
    full = load(seqs=4, spare=0, running=((3.0, 8), (3.0, 8)), waiting=(0.0,))
    assert capacity.how_many_to_take(full, (), 0, [8, 8], idle=False).displace == 1


def test_an_urgent_entry_needs_the_blocks_its_victim_frees() -> None:
    capacity = Capacity(prefetch=0)
    full = load(seqs=4, spare=0, running=((3.0, 2),))
    assert capacity.how_many_to_take(full, (), 0, [40], idle=False).displace == 0  # 11 blocks > 2 freed
    assert capacity.how_many_to_take(full, (), 0, [4], idle=False).displace == 1


def test_urgent_starts_on_their_way_claim_victims_and_background_ones_do_not() -> None:
    capacity = Capacity(prefetch=0)
    full = load(seqs=4, spare=0, running=((3.0, 8),))
    # An urgent start already on its way will preempt the one p3 sequence: nothing left for a second.
    assert capacity.how_many_to_take(full, (0,), 0, [4], idle=False).total == 0
    assert capacity.how_many_to_take(full, (1,), 1, [4], idle=False).total == 0
    # A background refill on its way (the common case at saturation) does not hold the urgent entry
    # back: the scheduler admits the urgent one first.
    assert capacity.how_many_to_take(full, (3,), 0, [4], idle=False) == Take(fit=0, displace=1)
    assert capacity.how_many_to_take(full, (2, 3), 1, [4], idle=False) == Take(fit=0, displace=1)


def test_only_streams_more_urgent_than_the_least_urgent_running_sequence_are_worth_a_look() -> None:
    capacity = Capacity(prefetch=0)
    # Of 5 priorities, 0, 1 and 2 rank above 2.5 (the least urgent running); with nothing running, none.
    assert capacity.displacing_levels(load(running=((0.0, 1), (2.5, 1))), levels=5) == 3
    assert capacity.displacing_levels(load(), levels=5) == 0
