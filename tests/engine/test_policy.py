"""The rules of who runs next (``worker/engine/core/policy.py``), each on its own: aging, runs before,
displaces, runs first, the victim and stealing. The scheduler and the intake tests show them at work."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

from worker.engine.core.policy import (
    FAIR_DISPLACE_EVERY_STEPS,
    FAIR_MARGIN,
    EngineLoad,
    PassOver,
    Policy,
    RunningLoad,
    Urgency,
    after_waiting,
    arriving,
    displaces,
    fair_challenger,
    fair_displacement_due,
    fair_outranks,
    fair_victim,
    how_many_to_steal,
    joins_urgent_prefill,
    level,
    passed_over,
    preemption_order,
    prefills_first,
    runs_before,
    runs_first,
    tenant_load,
    victim,
)
from worker.engine.core.sequence import Sequence
from worker.engine.sampling.sampling_params import SamplingParams


def seq(priority: int, arrival: int, arrival_step: int) -> Sequence:
    s = Sequence(f"r{arrival}", [1, 2, 3], SamplingParams(), arrival=arrival, priority=priority)
    s.arrival_step = arrival_step
    return s


def test_aging_moves_an_old_request_ahead_of_newer_more_urgent_ones_and_the_order_never_flips() -> None:
    policy = Policy(aging_steps=4)
    old, early, late = seq(3, 0, arrival_step=0), seq(2, 1, arrival_step=2), seq(2, 2, arrival_step=8)
    assert policy.urgency(old, step=8) == Urgency(1.0, 0)  # two levels of credit for 8 steps
    for step in (8, 12, 400):
        assert runs_before(policy.urgency(old, step), policy.urgency(late, step))
        assert runs_before(policy.urgency(early, step), policy.urgency(old, step))  # a level ahead, 6 steps behind


def test_without_aging_priority_then_arrival_decide() -> None:
    policy = Policy(aging_steps=None)
    first, second = seq(1, arrival=0, arrival_step=0), seq(1, arrival=1, arrival_step=0)
    assert policy.urgency(first, step=10_000) == Urgency(1, 0)
    assert runs_before(policy.urgency(first, step=5), policy.urgency(second, step=5))


def test_an_arrival_ranks_behind_everything_of_its_priority_already_there() -> None:
    assert arriving(2) == Urgency(2, math.inf)
    assert runs_before(Urgency(2.0, 7), arriving(2)) and runs_before(arriving(2, order=0), arriving(2))
    assert runs_before(arriving(1), Urgency(1.5, 0))


def test_displacing_takes_strictly_more_urgent_and_running_first_a_whole_level() -> None:
    aged_background = Urgency(2.5, 0)
    assert displaces(arriving(2), aged_background) and not runs_first(arriving(2), aged_background)
    assert displaces(arriving(1), aged_background) and runs_first(arriving(1), aged_background)
    assert not displaces(arriving(2), Urgency(2.0, 0)), "as urgent is not enough to displace"
    assert not runs_first(Urgency(1.0, 0), Urgency(1.75, 5))


def test_the_urgent_prefill_admits_the_requests_as_urgent_as_its_head() -> None:
    head = Urgency(0.0, 4)
    assert joins_urgent_prefill(Urgency(0.0, 9), head)
    assert not joins_urgent_prefill(Urgency(0.25, 1), head)


def test_the_victim_is_the_least_urgent_and_the_newest_among_equals() -> None:
    running = [Urgency(3.0, 1), Urgency(0.0, 9), Urgency(3.0, 4), Urgency(2.5, 0)]
    assert victim(running, lambda u: u) == Urgency(3.0, 4)
    assert preemption_order(running, lambda u: u) == [
        Urgency(3.0, 4),
        Urgency(3.0, 1),
        Urgency(2.5, 0),
        Urgency(0.0, 9),
    ]


def test_an_entry_left_for_a_better_placed_worker_is_stolen_after_the_wait() -> None:
    assert how_many_to_steal([0.0, 0.4, 0.9], now=1.0, wait_s=0.5) == 2
    assert how_many_to_steal([0.9, 0.0], now=1.0, wait_s=0.5) == 0, "in order: the first not due stops it"
    read: list[float] = []

    def seen() -> Iterator[float]:
        for t in (0.0, 0.8, 0.1):
            read.append(t)
            yield t

    how_many_to_steal(seen(), now=1.0, wait_s=0.5)
    assert read == [0.0, 0.8], "entries after the first still left are not looked at (their clock has not started)"


def test_within_a_level_the_tenant_under_its_share_runs_first_and_levels_still_decide_first() -> None:
    light, heavy = arriving(2, share=10.0, tenant="l"), Urgency(1.5, 0, share=9000.0, tenant="h")
    assert level(heavy) == 2 and runs_before(light, heavy), "a request aged part of a level is still at its own"
    assert runs_before(Urgency(1.0, 5, share=9000.0, tenant="h"), light), "a whole level ahead wins whatever the share"
    assert runs_before(arriving(2, share=10.0), arriving(2, share=20.0, order=0))


def test_the_fair_clause_displaces_across_tenants_past_the_margin_once() -> None:
    running = Urgency(1.75, 0, share=5000.0, tenant="heavy", load=4.0)  # heavy runs 4 requests
    assert displaces(arriving(2, share=9000.0, tenant="light", load=1.0), running), "whatever the shares"
    assert not displaces(arriving(2, tenant="light", load=4.0 - FAIR_MARGIN + 0.5), running), "within the margin"
    assert not displaces(arriving(2, tenant="heavy", load=1.0), running), "never within one tenant"
    assert not displaces(arriving(2, tenant="light", load=1.0), running._replace(shielded=True)), "once per request"
    assert not displaces(arriving(1, tenant="light", load=1.0)._replace(effective_priority=3), running), "a level"
    # Once displaced, the heavy tenant runs no fewer than the light one: it never displaces back.
    assert not displaces(Urgency(1.5, 0, tenant="heavy", load=4.0), Urgency(1.9, 3, tenant="light", load=1.0))
    assert fair_displacement_due(10, None) and not fair_displacement_due(10, 10 - FAIR_DISPLACE_EVERY_STEPS + 1)
    assert fair_displacement_due(10, 10 - FAIR_DISPLACE_EVERY_STEPS)
    assert fair_displacement_due(10, 9, far_under=True) and not fair_displacement_due(10, 10, far_under=True)


def test_the_fair_victim_is_the_most_loaded_tenants_least_urgent_request() -> None:
    light = arriving(1, tenant="l", load=1.0)
    running = [
        Urgency(1.0, 0, share=10.0, tenant="a", load=3.0),
        Urgency(1.0, 1, share=20.0, tenant="a", load=3.0),
        Urgency(1.0, 2, share=90.0, tenant="b", load=2.0),
        Urgency(1.0, 3, share=0.0, tenant="l", load=1.0),
    ]
    assert fair_victim(light, running, lambda u: u) == running[1]
    assert tenant_load(["a", "a", "b"], "a", 2.0, counting_itself=True) == 1.5


def test_the_fair_challenger_is_the_first_waiting_request_past_the_head_that_displaces_one_at_its_level() -> None:
    running = [Urgency(1.0, n, share=10.0 * n, tenant="a", load=3.0) for n in range(3)]
    head = arriving(1, share=40.0, tenant="a", load=4.0)  # pulled before the others: the lowest share
    light = arriving(1, share=90.0, tenant="l", load=1.0)
    assert fair_challenger([head, arriving(1, share=50.0, tenant="a", load=4.0), light], running) == 2
    assert fair_challenger([head, light._replace(load=2.5)], running) is None, "within the margin"
    assert fair_challenger([head, light._replace(effective_priority=2)], running) is None, "never past a level"
    assert fair_challenger([head], running) is None and fair_challenger([], running) is None


def test_a_tenant_far_under_its_share_prefills_first_only_against_another_tenant_at_its_level() -> None:
    running = [Urgency(1.0, n, tenant="a", load=3.0) for n in range(3)]
    assert prefills_first(arriving(1, tenant="l", load=1.0), running)
    assert not prefills_first(arriving(1, tenant="l", load=2.5), running), "within the margin"
    assert not prefills_first(arriving(1, tenant="a", load=1.0), running), "never within one tenant"
    assert not prefills_first(arriving(2, tenant="l", load=1.0), running), "a level below"


def test_the_fair_clause_is_symmetric_about_the_weighted_share() -> None:
    # Weights 3:1 on 16 slots: the light tenant's share is 4. It displaces the heavy one below it, the
    # heavy one displaces it above it, and at 4 neither moves (a running request's load counts its own).
    def heavy(running: int) -> Urgency:
        return Urgency(1.0, 0, tenant="h", load=running / 3, weight=3.0)

    def light(running: int) -> Urgency:
        return Urgency(1.0, 0, tenant="l", load=float(running), weight=1.0)

    assert displaces(light(3 + 1), heavy(13)) and not displaces(light(4 + 1), heavy(12))
    assert displaces(heavy(11 + 1), light(5)) and not displaces(heavy(12 + 1), light(4))


def test_after_waiting_counts_the_engines_waiting_requests_as_they_will_start() -> None:
    """Weights 3:1 on 16 slots: a waiting light request takes a heavy one's place while light runs under its
    share of 4, takes a free slot when there is one, and otherwise waits (counted nowhere yet)."""

    def engine(heavy: int, light: int, waiting: int, slots: int = 16) -> EngineLoad:
        running = [Urgency(1.0, n, tenant="h", load=heavy / 3, weight=3.0) for n in range(heavy)]
        running += [Urgency(1.0, 100 + n, tenant="l", load=float(light)) for n in range(light)]
        queued = tuple(Urgency(1.0, 200 + n, tenant="l") for n in range(waiting))
        return EngineLoad(16, 4, heavy + light + waiting, 0, tuple(RunningLoad(u, 1) for u in running), queued)

    settled, counts = after_waiting(engine(13, 3, 1))
    assert counts == {"h": 12, "l": 4}, "displaces one heavy request: light at its share"
    assert {r.urgency.tenant: r.urgency.load for r in settled.running} == {"h": 4.0, "l": 4.0}
    assert after_waiting(engine(13, 3, 2))[1] == {"h": 12, "l": 4}, "the second waits: 5 is over the share"
    assert after_waiting(engine(12, 3, 1))[1] == {"h": 12, "l": 4}, "a free slot"
    unchanged = engine(12, 4, 0)
    assert after_waiting(unchanged) == (unchanged, {"h": 12, "l": 4})


def test_a_full_workers_pick_tells_the_tenants_that_displace_nothing_from_those_at_the_edge_of_their_share() -> None:
    """Weights 3:1 on 16 slots with heavy 12 and light 4 (the share): neither's next entry displaces the other's;
    with heavy at 13 a light entry displaces one (light 4 of 12) but light is not far under heavy (4 is over
    half of 13 / 3): at the edge. Amid a flood (a: 13, b: 2) b's next is far under. A tenant with nothing running
    here is never named, and a more urgent level displaces whatever runs at a less urgent one."""

    def engine(counts: dict[str, int], weights: dict[str, float], priority: int = 1) -> EngineLoad:
        running = [
            Urgency(float(priority), n, tenant=t, load=c / weights[t], weight=weights[t])
            for t, c in counts.items()
            for n in range(c)
        ]
        return EngineLoad(16, 4, len(running), 0, tuple(RunningLoad(u, 1) for u in running))

    weights = {"h": 3.0, "l": 1.0, "a": 1.0, "b": 1.0}
    at_share = engine({"h": 12, "l": 4}, weights)
    assert passed_over(at_share, Counter({"h": 12, "l": 4}), 1) == PassOver(frozenset({"h", "l"}), frozenset())
    assert passed_over(at_share, Counter({"h": 12, "l": 4}), 0) == PassOver(frozenset(), frozenset({"h", "l"})), (
        "an urgent entry displaces either, by priority: at the edge, never far under another level's tenant"
    )
    light_under = engine({"h": 13, "l": 3}, weights)
    assert passed_over(light_under, Counter({"h": 13, "l": 3}), 1) == PassOver(frozenset({"h"}), frozenset({"l"}))
    flood = engine({"a": 13, "b": 2}, weights)
    assert passed_over(flood, Counter({"a": 13, "b": 2}), 1) == PassOver(frozenset({"a"}), frozenset())
    assert passed_over(flood, Counter({"a": 13, "b": 2, "new": 1}), 1) == PassOver(frozenset({"a"}), frozenset())
    assert not PassOver() and PassOver(frozenset(), frozenset({"x"}))


def test_a_tenant_outranks_another_only_far_under_its_share() -> None:
    """A light tenant amid a flood (its 3rd request beside the flood's 13) is far under the flood's share;
    weights 3:1 at their share (light's 4th beside heavy's 12 over 3) are not."""
    flood = Urgency(1.0, 0, tenant="a", load=13.0)
    assert fair_outranks(arriving(1, tenant="b", load=3.0), flood)
    assert not fair_outranks(arriving(1, tenant="b", load=7.0), flood), "7 is over half of 13"
    assert not fair_outranks(arriving(1, tenant="a", load=1.0), flood), "never within one tenant"
    assert not fair_outranks(arriving(0, tenant="b", load=1.0), flood), "another level: runs_first decides"
    heavy = Urgency(1.0, 0, tenant="h", load=12 / 3, weight=3.0)
    assert not fair_outranks(arriving(1, tenant="l", load=4.0), heavy)
    assert fair_outranks(arriving(1, tenant="l", load=2.0), heavy)
