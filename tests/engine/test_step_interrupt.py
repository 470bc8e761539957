"""An urgent arrival stops the step in progress between two layers (``worker/engine/core/step_interrupt.py``):
the stopped step keeps nothing, the arrival runs next, and every sequence's output stays exact."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine.conftest import reference
from tests.engine.test_engine_scheduling import prompt, step_all
from worker.engine import EngineEvent, SamplingParams
from worker.engine.core import step_interrupt
from worker.engine.core.step_interrupt import MAX_THROWN_AWAY_SHARE

PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


def arrive_mid_step(
    engine: Any,
    monkeypatch: pytest.MonkeyPatch,
    priority: int,
    at_layer: int = 0,
    *,
    budget: bool = False,
    tenant: str | None = None,
) -> list[bool]:
    """From the next step on, a request of ``priority`` 'arrives' (``interrupt_for``, as the worker's
    intake thread calls it) as each step reaches its layer ``at_layer``; returns what each call answered.
    Without ``budget`` the thrown-away time is not limited (the tiny model's steps are too short for
    it to mean anything; the limit has a test of its own)."""
    if not budget:
        monkeypatch.setattr(step_interrupt, "MAX_THROWN_AWAY_SHARE", 1.0)
    answers: list[bool] = []
    stop_if_requested = engine._interrupt.stop_if_requested

    def layer_starts(layer: int, num_layers: int) -> None:
        if layer == at_layer:
            answers.append(engine.interrupt_for(priority, tenant))
        stop_if_requested(layer, num_layers)

    monkeypatch.setattr(engine._interrupt, "stop_if_requested", layer_starts)
    return answers


def loaded_engine(make_engine: Any) -> tuple[Any, list[EngineEvent]]:
    """Three background requests decoding and a fourth whose prompt comes in 8-token chunks beside them."""
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_tokens_beside_decodes=8)
    for i in range(3):
        engine.add_request(f"background-{i}", prompt(20 + i), PARAMS, priority=3)
    events = engine.step()
    engine.add_request("long", prompt(23, 40), PARAMS, priority=2)
    events += engine.step()
    return engine, events


def test_an_urgent_arrival_stops_the_step_in_progress_and_runs_next_with_every_output_exact(
    make_engine: Any, tiny_ref: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, events = loaded_engine(make_engine)
    answers = arrive_mid_step(engine, monkeypatch, priority=0)
    before = {s.request_id: s.num_computed_tokens for s in engine.scheduler.running}
    assert engine.step() == [], "a stopped step sends nothing"
    assert answers == [True] and engine.stats.interrupted_steps == 1
    assert {s.request_id: s.num_computed_tokens for s in engine.scheduler.running} == before, "nothing was kept"
    # What the worker does next: the arrival reaches the engine, whose next step runs it first.
    engine.add_request("urgent", prompt(30), PARAMS, priority=0)
    urgent_step = engine.step()
    assert [e.request_id for e in urgent_step] == ["urgent"]
    assert engine.stats.interrupted_steps == 1, "the step after a stopped one runs to its end"
    monkeypatch.undo()
    events += urgent_step + step_all(engine)
    assert engine.stats.preemptions == 0
    for name, seed, length in (("background-0", 20, 12), ("long", 23, 40), ("urgent", 30, 12)):
        tokens = [e.token_id for e in events if e.request_id == name]
        assert tokens == reference(tiny_ref, prompt(seed, length), 12), name
        assert [e.index for e in events if e.request_id == name] == list(range(12))


@pytest.mark.parametrize("priority", [2, 3])
def test_an_arrival_less_than_a_level_more_urgent_than_the_step_lets_it_run(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch, priority: int
) -> None:
    # The step computes priority-2 and priority-3 work: only a priority-1 (or better) arrival would
    # pause its least urgent sequences, so only such an arrival stops it.
    engine, _ = loaded_engine(make_engine)
    answers = arrive_mid_step(engine, monkeypatch, priority=priority)
    events = engine.step()
    assert answers == [False] and engine.stats.interrupted_steps == 0
    assert {e.request_id for e in events} == {f"background-{i}" for i in range(3)}


@pytest.mark.parametrize("fair_share", [True, False])
def test_a_tenant_far_under_its_share_stops_the_step_of_the_tenant_it_outranks_and_its_own_tenant_does_not(
    make_engine: Any, tiny_ref: Any, monkeypatch: pytest.MonkeyPatch, fair_share: bool
) -> None:
    engine = make_engine(max_num_seqs=8, fair_share=fair_share)
    for i in range(4):
        engine.add_request(f"heavy-{i}", prompt(40 + i), PARAMS, priority=1, tenant="heavy", share=10.0 * i)
    events = engine.step()
    answers = arrive_mid_step(engine, monkeypatch, priority=1, tenant="heavy")
    events += engine.step()
    assert answers == [False], "another of its own tenant's stops nothing"
    monkeypatch.undo()
    answers = arrive_mid_step(engine, monkeypatch, priority=1, tenant="light")
    step = engine.step()
    assert answers == [fair_share] and engine.stats.interrupted_steps == int(fair_share)
    assert step == [] if fair_share else {e.request_id for e in step} == {f"heavy-{i}" for i in range(4)}
    monkeypatch.undo()
    engine.add_request("light", prompt(50), PARAMS, priority=1, tenant="light", share=0.0)
    light_step = engine.step()
    assert {e.request_id for e in light_step} == {"light", *(f"heavy-{i}" for i in range(4))}, "decodes beside it"
    events += step + light_step + step_all(engine)
    for name, seed in [("heavy-0", 40), ("heavy-3", 43), ("light", 50)]:
        assert [e.token_id for e in events if e.request_id == name] == reference(tiny_ref, prompt(seed), 12), name


def test_urgent_arrivals_at_every_step_still_let_every_other_step_finish(
    make_engine: Any, tiny_ref: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, events = loaded_engine(make_engine)
    answers = arrive_mid_step(engine, monkeypatch, priority=0)
    for _ in range(6):
        events += engine.step()
    assert answers == [True, False] * 3 and engine.stats.interrupted_steps == 3
    monkeypatch.undo()
    events += step_all(engine)
    tokens = [e.token_id for e in events if e.request_id == "long"]
    assert tokens == reference(tiny_ref, prompt(23, 40), 12)


def test_an_arrival_in_the_second_half_of_the_layers_waits_for_the_step(
    make_engine: Any, tiny_ref: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, events = loaded_engine(make_engine)
    assert len(engine.model.model.layers) == 2
    answers = arrive_mid_step(engine, monkeypatch, priority=0, at_layer=1)
    step = engine.step()  # asked to stop at its last layer: finishing costs the arrival less
    assert answers == [True] and engine.stats.interrupted_steps == 0
    assert {e.request_id for e in step} == {f"background-{i}" for i in range(3)}
    monkeypatch.undo()
    engine.add_request("urgent", prompt(30), PARAMS, priority=0)
    urgent_step = engine.step()
    assert [e.request_id for e in urgent_step] == ["urgent"]
    events += step + urgent_step + step_all(engine)
    assert [e.token_id for e in events if e.request_id == "long"] == reference(tiny_ref, prompt(23, 40), 12)


def test_a_step_between_steps_or_alone_is_not_stopped(make_engine: Any) -> None:
    engine = make_engine(max_num_seqs=8)
    assert engine.interrupt_for(0) is False, "no step in progress"
    engine.add_request("urgent", prompt(1), PARAMS, priority=0)
    engine.step()
    assert engine.interrupt_for(0) is False
    step_all(engine)
    assert engine.stats.interrupted_steps == 0


def test_stopped_steps_leave_seeded_sampling_and_grammars_exactly_where_they_were(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sampled (seeded) and constrained rows: a stopped step must not draw from a request's generator
    # or move its matcher, or the run with stops would diverge from the one without.
    def run(stops: bool) -> dict[str, list[int]]:
        engine = make_engine(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_tokens_beside_decodes=8)
        if stops:
            arrive_mid_step(engine, monkeypatch, priority=0)
        regex = {"type": "regex", "value": "[a-z]{3}-[0-9]{4}"}
        for i in range(3):
            params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=i, constraint=regex if i else None)
            engine.add_request(f"r{i}", prompt(50 + i, 10 + 9 * i), params, priority=3)
        tokens: dict[str, list[int]] = {}
        for event in step_all(engine):
            tokens.setdefault(event.request_id, []).append(event.token_id)
        monkeypatch.undo()
        assert (engine.stats.interrupted_steps > 0) is stops
        return tokens

    assert run(stops=True) == run(stops=False)


def test_steps_are_not_stopped_once_the_thrown_away_time_is_over_its_share(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _ = loaded_engine(make_engine)
    answers = arrive_mid_step(engine, monkeypatch, priority=0, budget=True)
    engine.stats.step_time_s = 10.0
    engine.stats.interrupted_time_s = 10.0 * MAX_THROWN_AWAY_SHARE + 0.01
    engine.step()
    assert answers == [False] and engine.stats.interrupted_steps == 0
    engine.stats.step_time_s = 20.0  # back under the share: the next arrival stops its step
    assert engine.step() == [] and answers == [False, True] and engine.stats.interrupted_steps == 1
