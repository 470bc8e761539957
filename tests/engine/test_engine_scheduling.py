"""The streaming core: priorities, preemption, aging, deadlines, abort, resume, the load report."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest

from tests.engine.conftest import reference, run_to_end
from worker.engine import EngineEvent, SamplingParams
from worker.engine.core.policy import FAIR_DISPLACE_EVERY_STEPS

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def prompt(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 40_000) for _ in range(n)]


def finish_order(events: list[EngineEvent]) -> list[str]:
    return [e.request_id for e in events if e.finish_reason is not None]


def step_all(engine: Any, max_steps: int = 1000) -> list[EngineEvent]:
    out: list[EngineEvent] = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        out += engine.step()
    return out


def test_urgent_request_overtakes_earlier_less_urgent_ones(make_engine: Any) -> None:
    engine = make_engine(max_num_seqs=1)
    engine.add_request("late-1", prompt(1), GREEDY, priority=5)
    engine.add_request("late-2", prompt(2), GREEDY, priority=5)
    engine.add_request("urgent", prompt(3), GREEDY, priority=0)
    assert finish_order(step_all(engine)) == ["urgent", "late-1", "late-2"]


def test_urgent_request_preempts_a_less_urgent_running_one(make_engine: Any, tiny_ref: Any) -> None:
    engine = make_engine(max_num_seqs=1)
    params = SamplingParams(max_new_tokens=10)
    engine.add_request("background", prompt(4), params, priority=5)
    events = [e for _ in range(4) for e in engine.step()]
    assert [e.request_id for e in events] == ["background"] * 4
    engine.add_request("urgent", prompt(5), params, priority=0)
    events += step_all(engine)
    assert engine.stats.preemptions == 1
    assert finish_order(events) == ["urgent", "background"]
    tokens = [e.token_id for e in events if e.request_id == "background"]
    assert tokens == reference(tiny_ref, prompt(4), 10)  # recomputed after preemption, same continuation
    assert [e.index for e in events if e.request_id == "background"] == list(range(10))


def test_an_urgent_arrival_is_prefilled_beside_urgent_decodes_while_background_sits_one_step_out(
    make_engine: Any, tiny_ref: Any
) -> None:
    engine = make_engine(max_num_seqs=8)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"background-{i}", prompt(20 + i), params, priority=3)
    engine.add_request("urgent-old", prompt(30), params, priority=0)
    events = [e for _ in range(3) for e in engine.step()]  # all four prefilled and decoding
    assert {e.request_id for e in events[-4:]} == {"background-0", "background-1", "background-2", "urgent-old"}
    engine.add_request("urgent-new", prompt(31), params, priority=0)
    # One step: the new urgent request's prefill (its first token) and its peer's decode, nothing else.
    urgent_step = engine.step()
    assert sorted(e.request_id for e in urgent_step) == ["urgent-new", "urgent-old"]
    # Then everyone again; nothing was preempted and every sequence continues exactly.
    next_step = engine.step()
    assert {e.request_id for e in next_step} == {f"background-{i}" for i in range(3)} | {"urgent-old", "urgent-new"}
    events += urgent_step + next_step + step_all(engine)
    assert engine.stats.preemptions == 0
    assert [e.token_id for e in events if e.request_id == "background-0"] == reference(tiny_ref, prompt(20), 12)


def test_a_step_that_decodes_takes_a_capped_prompt_chunk_but_an_urgent_prompt_whole(
    make_engine: Any, tiny_ref: Any
) -> None:
    # The cap is what bounds a loaded step's time: without it the background prompt below takes
    # the whole 64-token budget in one step beside the decodes, and an urgent arrival waits for it.
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_tokens_beside_decodes=8)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine.add_request("lone", prompt(40, 40), params, priority=3)
    events = engine.step()  # nothing decodes yet: the whole 40-token prompt in one step
    assert [e.request_id for e in events] == ["lone"]
    engine.add_request("background", prompt(41, 40), params, priority=3)
    for step in range(1, 4):
        events += engine.step()
        computed = {s.request_id: s.num_computed_tokens for s in engine.scheduler.running}
        assert computed["background"] == 8 * step  # 8 prompt tokens a step beside the lone request's decode
    engine.add_request("urgent", prompt(42, 40), params, priority=0)
    urgent_step = engine.step()  # an urgent step: its whole prompt, and its first token
    assert "urgent" in {e.request_id for e in urgent_step}
    events += urgent_step + step_all(engine)
    for name, seed in (("lone", 40), ("background", 41), ("urgent", 42)):
        assert [e.token_id for e in events if e.request_id == name] == reference(tiny_ref, prompt(seed, 40), 12)


@pytest.mark.slow
def test_aging_stops_starvation(make_engine: Any) -> None:
    def first_token_step(aging_steps: int | None) -> int | None:
        engine = make_engine(max_num_seqs=1, aging_steps=aging_steps)
        engine.add_request("patient", prompt(6), GREEDY, priority=3)
        for step in range(80):
            # A steady stream of urgent work that alone would keep the engine busy forever.
            engine.add_request(f"hot-{step}", prompt(100 + step), SamplingParams(max_new_tokens=1), priority=0)
            if any(e.request_id == "patient" for e in engine.step()):
                return step
        return None

    assert first_token_step(aging_steps=None) is None
    started = first_token_step(aging_steps=4)
    assert started is not None and started < 30


def test_blocks_running_short_preempt_the_least_urgent_newest(make_engine: Any, tiny_ref: Any) -> None:
    engine = make_engine(num_kv_blocks=12, block_size=4, enable_prefix_caching=False)
    params = SamplingParams(max_new_tokens=12)
    engine.add_request("a", prompt(7, 10), params, priority=1)
    engine.add_request("b", prompt(8, 10), params, priority=1)
    engine.add_request("c", prompt(9, 10), params, priority=2)
    preempted: list[str] = []
    events: list[EngineEvent] = []
    while engine.has_unfinished():
        before = {s.request_id for s in engine.scheduler.running}
        events += engine.step()
        after = {s.request_id for s in engine.scheduler.running} | set(finish_order(events))
        preempted += sorted(before - after)
    assert engine.stats.preemptions > 0
    assert preempted[0] == "c"  # least urgent goes first
    for rid, seed in (("a", 7), ("b", 8), ("c", 9)):
        assert [e.token_id for e in events if e.request_id == rid] == reference(tiny_ref, prompt(seed, 10), 12)


def test_requests_past_their_deadline_expire(make_engine: Any) -> None:
    now = [1000.0]
    engine = make_engine(max_num_seqs=1, clock=lambda: now[0])
    engine.add_request("running", prompt(10), SamplingParams(max_new_tokens=50), deadline=1010.0)
    engine.add_request("waiting", prompt(11), SamplingParams(max_new_tokens=50), deadline=1005.0)
    engine.step()
    engine.step()
    now[0] = 1006.0
    events = engine.step()
    expired = [e for e in events if e.finish_reason == "expired"]
    assert [(e.request_id, e.token_id, e.index) for e in expired] == [("waiting", -1, 0)]
    now[0] = 1011.0
    events = engine.step()
    assert [(e.request_id, e.finish_reason, e.index) for e in events] == [("running", "expired", 3)]
    assert not engine.has_unfinished()
    assert engine.num_free_blocks == engine.num_total_blocks
    assert engine.stats.expired == 2


def test_abort_frees_every_block(make_engine: Any) -> None:
    engine = make_engine(block_size=4)
    for i in range(5):
        engine.add_request(f"r{i}", prompt(20 + i, 30), SamplingParams(max_new_tokens=100))
    engine.step()
    engine.step()
    assert engine.num_free_blocks < engine.num_total_blocks
    assert all(engine.abort(f"r{i}") for i in range(5))
    assert not engine.abort("r0") and not engine.abort("never-added")
    assert engine.num_free_blocks == engine.num_total_blocks
    assert not engine.has_unfinished() and engine.step() == []


def test_resume_with_prior_output_continues_identically(make_engine: Any) -> None:
    for params in (SamplingParams(max_new_tokens=16), SamplingParams(max_new_tokens=16, temperature=1.0, seed=7)):
        engine = make_engine()
        engine.add_request("full", prompt(30), params)
        full = run_to_end(engine)["full"]
        tokens = [e.token_id for e in full]
        engine.add_request("resumed", prompt(30), params, prior_output_token_ids=tokens[:6])
        resumed = run_to_end(engine)["resumed"]
        assert [e.index for e in resumed] == list(range(6, len(tokens)))
        assert [e.token_id for e in resumed] == tokens[6:]
        assert "".join(e.text for e in resumed) == "".join(e.text for e in full[6:])
        assert resumed[-1].finish_reason == full[-1].finish_reason


def test_events_stream_every_token_with_text(make_engine: Any) -> None:
    engine = make_engine()
    engine.add_request("r", prompt(31), SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2))
    events = run_to_end(engine)["r"]
    assert [e.index for e in events] == list(range(8))
    assert [e.finish_reason for e in events] == [None] * 7 + ["length"]
    text = engine.tokenizer.decode([e.token_id for e in events], skip_special_tokens=True)
    assert "".join(e.text for e in events) == text
    assert all(e.logprob is not None and e.top_logprobs is not None and len(e.top_logprobs) == 2 for e in events)


def test_unseeded_requests_get_a_seed_so_a_resume_can_replay(make_engine: Any) -> None:
    engine = make_engine()
    engine.add_request("r", prompt(32), SamplingParams(max_new_tokens=2, temperature=1.0))
    assert engine._seqs["r"].params.seed is not None
    run_to_end(engine)


def test_the_load_report_counts_sequences_and_the_blocks_waiting_ones_will_claim(make_engine: Any) -> None:
    engine = make_engine(max_num_seqs=2, num_kv_blocks=10, block_size=4)
    assert engine.load.num_seqs == 0 and engine.load.spare_blocks == 10 and engine.load.max_num_seqs == 2
    engine.add_request("a", prompt(40, 20), GREEDY, priority=3)
    assert engine.load.num_seqs == 1
    assert engine.load.spare_blocks == 5  # a's 20 prompt tokens claim 5 of the 10 blocks before it runs
    assert [u.effective_priority for u in engine.load.waiting] == [3.0] and engine.load.running == ()
    engine.step()
    (running,) = engine.load.running
    assert running.num_blocks == 5 and running.urgency.effective_priority < 3  # aging credit: one step
    assert engine.load.waiting == () and engine.load.spare_blocks == 5
    run_to_end(engine)
    assert engine.load.num_seqs == 0 and engine.load.spare_blocks == 10


def test_preemptions_are_counted_by_reason_with_the_tokens_thrown_away(make_engine: Any) -> None:
    engine = make_engine(max_num_seqs=1)
    engine.add_request("background", prompt(4), SamplingParams(max_new_tokens=10), priority=5)
    for _ in range(3):
        engine.step()
    engine.add_request("urgent", prompt(5), GREEDY, priority=0)
    engine.step()
    stats = engine.stats
    assert stats.preemptions_by_reason == {"kv_blocks": 0, "urgency": 1, "fair_share": 0}
    assert stats.recomputed_tokens == len(prompt(4)) + 2  # the prompt and all but the last sampled token
    run_to_end(engine)


def test_the_load_report_answers_while_a_step_runs(make_engine: Any) -> None:
    """The worker's intake reads it between its Redis reads; a step holding the engine for hundreds of
    ms must not make it wait (a freed slot would be refilled a step late)."""
    engine = make_engine(max_num_seqs=2, num_kv_blocks=10, block_size=4)
    engine.add_request("a", prompt(40, 20), GREEDY)
    stepping, release = threading.Event(), threading.Event()

    def hold_the_engine() -> None:
        with engine._lock:  # what step() holds for its whole forward
            stepping.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_engine)
    holder.start()
    try:
        assert stepping.wait(10)
        done = threading.Event()
        reader = threading.Thread(target=lambda: (engine.load, done.set()))
        reader.start()
        assert done.wait(5), "reading the load waited for the engine's lock"
        reader.join()
    finally:
        release.set()
        holder.join()


def test_stats_count_steps_and_time(make_engine: Any) -> None:
    engine = make_engine()
    engine.add_request("r", prompt(50), GREEDY)
    run_to_end(engine)
    stats = engine.stats
    assert stats.steps == 6 and stats.generated_tokens == 6
    assert 0 < stats.forward_time_s <= stats.step_time_s
    assert stats.num_running == 1 and stats.batch_tokens == 1  # as scheduled in the last step


def test_seeded_request_gives_the_same_tokens_alone_or_in_a_batch(make_engine: Any) -> None:
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = make_engine()
    alone.add_request("x", prompt(60), params)
    expected = [e.token_id for e in run_to_end(alone)["x"]]
    crowded = make_engine()
    for i in range(6):
        crowded.add_request(f"other-{i}", prompt(61 + i), SamplingParams(max_new_tokens=8, temperature=1.0))
    crowded.add_request("x", prompt(60), params)
    assert [e.token_id for e in run_to_end(crowded)["x"]] == expected


@pytest.mark.parametrize("bad", [-1, 10**9])
def test_token_ids_outside_the_vocabulary_are_refused_before_they_reach_the_batch(make_engine: Any, bad: int) -> None:
    engine = make_engine()
    engine.add_request("fine", [5, 6, 7], SamplingParams(max_new_tokens=3))
    with pytest.raises(ValueError, match=f"token id {bad} is outside the model's vocabulary"):
        engine.add_request("bad", [5, bad, 7], SamplingParams(max_new_tokens=3))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.add_request("bad-resume", [5, 6], SamplingParams(max_new_tokens=3), prior_output_token_ids=[bad])
    while engine.has_unfinished():  # the batch it would have joined runs on untouched
        engine.step()
    assert engine.stats.steps > 0


def test_a_tenant_under_its_share_displaces_one_over_it_once_and_never_thrashes(make_engine: Any) -> None:
    engine = make_engine(max_num_seqs=2)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine.add_request("heavy-1", prompt(6), params, priority=1, tenant="heavy", share=4000.0)
    engine.add_request("heavy-2", prompt(15), params, priority=1, tenant="heavy", share=5000.0)
    for _ in range(3):
        engine.step()
    engine.add_request("light", prompt(7), GREEDY, priority=1, tenant="light", share=9000.0)
    events = engine.step()
    assert engine.stats.preemptions_by_reason["fair_share"] == 1, "the light tenant takes one of the heavy one's slots"
    assert {s.request_id for s in engine.scheduler.running} == {"heavy-1", "light"}, "the least urgent of the heavy"
    # Another light request takes heavy-1's place once heavy-2 is back (light runs none then), and
    # that is all: each heavy request is displaced once at most.
    engine.add_request("light-2", prompt(8), GREEDY, priority=1, tenant="light", share=9100.0)
    displaced = []
    while engine.has_unfinished():
        events += engine.step()
        displaced += [
            s.request_id for s in engine.scheduler.waiting if s.fair_displaced and s.request_id not in displaced
        ]
    assert sorted(displaced) == ["heavy-1", "heavy-2"]
    assert finish_order(events).index("light") < finish_order(events).index("heavy-2")
    assert engine.stats.preemptions_by_reason == {"kv_blocks": 0, "urgency": 0, "fair_share": 2}


def test_a_tenant_under_its_share_displaces_past_the_over_share_tenants_waiting_entries(make_engine: Any) -> None:
    # heavy-3 waits in the engine (pulled before light: a lower share), and displaces nobody (its own
    # tenant runs both slots); light, behind it, still takes a heavy slot in the next step.
    engine = make_engine(max_num_seqs=2)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for n in range(3):
        engine.add_request(f"heavy-{n}", prompt(20 + n), params, priority=1, tenant="heavy", share=1000.0 * n)
    engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["heavy-2"]
    engine.add_request("light", prompt(7), GREEDY, priority=1, tenant="light", share=3000.0)
    engine.step()
    assert engine.stats.preemptions_by_reason["fair_share"] == 1
    assert {s.request_id for s in engine.scheduler.running} == {"heavy-0", "light"}, "heavy's least urgent displaced"
    assert sorted(s.request_id for s in engine.scheduler.waiting) == ["heavy-1", "heavy-2"]
    run_to_end(engine)
    assert engine.stats.preemptions_by_reason == {"kv_blocks": 0, "urgency": 0, "fair_share": 1}


def test_a_tenant_under_its_share_has_its_prompt_prefilled_whole_before_the_over_share_tenants_chunks(
    make_engine: Any, tiny_ref: Any
) -> None:
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_tokens_beside_decodes=8)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    for n in range(2):
        engine.add_request(f"heavy-{n}", prompt(50 + n, 8), params, priority=1, tenant="heavy", share=10.0 * n)
    engine.step()
    engine.add_request("heavy-2", prompt(52, 40), params, priority=1, tenant="heavy", share=20.0)
    engine.step()  # heavy-2's prompt in 8-token chunks beside heavy-0's and heavy-1's decodes
    engine.add_request("light", prompt(53, 40), params, priority=1, tenant="light", share=30.0)
    events = engine.step()  # light runs none, heavy 3: light's whole prompt, and its first token
    assert "light" in {e.request_id for e in events}
    computed = {s.request_id: s.num_computed_tokens for s in engine.scheduler.running}
    assert computed["heavy-2"] == 8, "the over-share tenant's chunk sits this step out"
    assert engine.stats.preemptions_by_reason["fair_share"] == 0, "a free slot: nobody displaced"
    events += step_all(engine)
    assert [e.token_id for e in events if e.request_id == "light"] == reference(tiny_ref, prompt(53, 40), 12)


def test_a_light_tenants_prompt_starts_at_once_with_the_over_share_tenants_decodes_beside_it(
    make_engine: Any, tiny_ref: Any
) -> None:
    engine = make_engine(max_num_seqs=6)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    for n in range(4):
        engine.add_request(f"heavy-{n}", prompt(60 + n), params, priority=1, tenant="heavy", share=10.0 * n)
    engine.step()
    engine.step()

    def computed() -> dict[str, int]:
        return {s.request_id: s.num_computed_tokens for s in engine.scheduler.running}

    before = computed()
    engine.add_request("light-0", prompt(70), params, priority=1, tenant="light", share=40.0)
    events = engine.step()
    heavy = {f"heavy-{n}" for n in range(4)}
    assert {e.request_id for e in events} == {"light-0", *heavy}, "its first token, the heavy decodes beside it"
    assert all(computed()[k] == v + 1 for k, v in before.items()), "each heavy decode advanced a token"
    engine.add_request("light-1", prompt(71), params, priority=1, tenant="light", share=50.0)
    events += (second := engine.step())
    assert {e.request_id for e in second} == {"light-0", "light-1", *heavy}
    events += step_all(engine)
    for n, seed in [(0, 60), (1, 61), (2, 62), (3, 63)]:
        assert [e.token_id for e in events if e.request_id == f"heavy-{n}"][-8:] == reference(
            tiny_ref, prompt(seed), 10
        )[-8:]
    for n, seed in [(0, 70), (1, 71)]:
        assert [e.token_id for e in events if e.request_id == f"light-{n}"] == reference(tiny_ref, prompt(seed), 10)
    assert engine.stats.preemptions_by_reason["fair_share"] == 0, "free slots: nobody displaced"


def test_with_fair_share_off_tenants_are_not_told_apart(make_engine: Any) -> None:
    engine = make_engine(max_num_seqs=2, fair_share=False)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine.add_request("heavy-1", prompt(6), params, priority=1, tenant="heavy", share=4000.0)
    engine.add_request("heavy-2", prompt(15), params, priority=1, tenant="heavy", share=5000.0)
    for _ in range(3):
        engine.step()
    engine.add_request("light", prompt(7), GREEDY, priority=1, tenant="light", share=0.0)
    engine.step()
    assert engine.stats.preemptions_by_reason["fair_share"] == 0, "first come, first served: the light one waits"
    assert {s.request_id for s in engine.scheduler.running} == {"heavy-1", "heavy-2"}


def test_fair_displacement_needs_a_margin_and_a_few_steps_between(make_engine: Any) -> None:
    engine = make_engine(max_num_seqs=3)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for n in range(3):
        engine.add_request(f"a-{n}", prompt(9 + n), params, priority=1, tenant="a", share=1000.0 * n)
    engine.step()
    engine.add_request(
        "b-1", prompt(12), GREEDY, priority=1, tenant="b", share=500.0, weight=0.4
    )  # 1 running / 0.4: 2.5
    engine.step()
    assert engine.stats.preemptions_by_reason["fair_share"] == 0, "2.5 + the margin is over a's 3"
    engine.add_request("c-1", prompt(13), GREEDY, priority=1, tenant="c")
    engine.add_request("d-1", prompt(14), GREEDY, priority=1, tenant="d")
    engine.step()
    assert engine.stats.preemptions_by_reason["fair_share"] == 1, "one displacement in a step"
    assert "a-2" not in {s.request_id for s in engine.scheduler.running}, "the victim: a's least urgent"
    engine.step()
    assert engine.stats.preemptions_by_reason["fair_share"] == 2, "d is far under a (1 to 2): the next step"
    run_to_end(engine)


def test_fair_displacement_at_the_edge_of_the_shares_waits_a_few_steps_after_the_last(make_engine: Any) -> None:
    """Weights 2:1:1 on 12 slots, a running 8 (4 per weight), e and g 2 each: e's third (3 beside a's 4 less one)
    and g's third are each under their share after the swap, but neither far under it (3 is over half of 4)."""
    engine = make_engine(max_num_seqs=12, max_num_batched_tokens=1024)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for n in range(8):
        engine.add_request(f"a-{n}", prompt(70 + n), params, priority=1, tenant="a", share=10.0 * n, weight=2.0)
    for t in ("e", "g"):
        for n in range(2):
            engine.add_request(f"{t}-{n}", prompt(80 + n), params, priority=1, tenant=t, share=100.0 + n)
    engine.step()
    engine.add_request("e-2", prompt(90), params, priority=1, tenant="e", share=200.0)
    engine.add_request("g-2", prompt(91), params, priority=1, tenant="g", share=201.0)
    engine.step()
    assert engine.stats.preemptions_by_reason["fair_share"] == 1, "e's third takes one of a's places"
    for _ in range(FAIR_DISPLACE_EVERY_STEPS - 1):
        engine.step()
        assert engine.stats.preemptions_by_reason["fair_share"] == 1, "g's waits: at the edge, the pace holds"
    engine.step()
    assert engine.stats.preemptions_by_reason["fair_share"] == 2
    assert {s.request_id for s in engine.scheduler.running} >= {"e-2", "g-2"}
    run_to_end(engine)
