"""Speculative decoding (worker/engine/core/speculation.py): proposals from the sequence's own
n-grams, checked in the ragged step. Greedy output equals transformers' ``generate`` token for
token (float64), a sampled one keeps its distribution and its seeded draws, and everything else
(chunked prefill, preemption, grammar, stop strings, max tokens, logprobs) holds per kept token.

The tiny random model never repeats its input, so n-grams propose nothing for it: most tests give
the engine's speculator drafts from the reference continuation (right, or wrong at chosen places)
and check what the step keeps; the default model's copying prompts exercise the n-gram proposer.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
import torch

from tests.engine.conftest import reference, run_to_end
from worker.engine import LLM, SamplingParams
from worker.engine.core.speculation import SpeculationConfig, Speculator

MAX_NEW = 16


def prompts_of(n: int, seed: int, low: int = 3, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 40_000) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def propose_from(engine: Any, continuations: dict[tuple[int, ...], list[int]], wrong_every: int = 0) -> None:
    """The engine's speculator proposes each sequence's known continuation, every ``wrong_every``-th
    proposed position (counted over the whole run) replaced by a token that is not it."""
    counter = iter(range(1, 1 << 30))

    def propose(state: Any, tokens: list[int], limit: int) -> list[int]:
        prompt = next(p for p in continuations if tuple(tokens[: len(p)]) == p)
        done = len(tokens) - len(prompt)
        draft = list(continuations[prompt][done : done + min(limit, 4)])
        for j in range(len(draft)):
            if wrong_every and next(counter) % wrong_every == 0:
                draft[j] = (draft[j] + 1) % 40_000
        return draft

    engine.speculator.propose = propose


def make_llm(make_engine: Any, **kwargs: Any) -> LLM:
    engine = make_engine(**({"speculate_by_default": True} | kwargs))
    llm = LLM.__new__(LLM)
    llm.engine, llm._next_id = engine, 0
    return llm


# --- proposals -----------------------------------------------------------------------------------
def test_the_longest_latest_ngram_match_proposes_what_followed_it() -> None:
    speculator = Speculator(SpeculationConfig(num_tokens=3, ngram_max=3, ngram_min=1))
    state = speculator.new_state()
    tokens = [7, 1, 2, 9, 1, 2, 3, 4, 5, 6, 1, 2]
    # (1, 2) last occurred before 3, 4, 5; the bigram wins over the unigram (2) everywhere.
    assert speculator.propose(state, tokens, 8) == [3, 4, 5]
    assert speculator.propose(state, [*tokens, 3], 2) == [4, 5]  # the index grows with the sequence
    assert speculator.propose(state, [*tokens, 3, 8], 4) == []  # 8 never occurred before


def test_a_match_shorter_than_ngram_min_proposes_nothing() -> None:
    speculator = Speculator(SpeculationConfig(num_tokens=4, ngram_max=3, ngram_min=2))
    assert speculator.propose(speculator.new_state(), [5, 6, 7, 1, 9, 1], 4) == []
    assert speculator.propose(speculator.new_state(), [5, 6, 7, 1, 9, 6, 7], 4) == [1, 9, 6, 7]


def test_a_proposal_is_as_long_as_the_runs_recently_kept_and_worth_their_rows() -> None:
    speculator = Speculator(SpeculationConfig(num_tokens=4, ngram_max=2, ngram_min=1, min_acceptance=0.0))
    state = speculator.new_state()
    tokens = [1, 2, 3, 4, 5, 6, 7, 1]
    lengths = []
    for kept in (0, 0, 0, *[4] * 8):  # rejected three times, then kept whole
        lengths.append(len(speculator.propose(state, tokens, speculator.length(state, 1))))
        speculator.record(state, max(lengths[-1], 1), min(kept, lengths[-1]))
    assert lengths[0] == 4 and lengths[3] < 4  # one stream: proposes in full, less after rejections
    assert lengths[3:] == sorted(lengths[3:]) and lengths[-1] == 4
    # A fresh record is worth fewer rows in a larger step, and none in a large enough one.
    fresh = speculator.new_state()
    assert [speculator.length(fresh, decodes) for decodes in (1, 8, 32)] == [4, 1, 0]


def test_low_acceptance_pauses_proposals_for_longer_each_time() -> None:
    speculator = Speculator(SpeculationConfig(num_tokens=2, ngram_max=2, ngram_min=1, min_acceptance=0.6))
    state = speculator.new_state()
    tokens = [1, 2, 1]
    speculator.record(state, 2, 2)
    assert speculator.propose(state, tokens, 2) == [2, 1]
    pauses = []
    for _ in range(3):
        speculator.record(state, 2, 0)  # rejected: pause, then one probe decides
        steps = 0
        while not speculator.propose(state, tokens, 2):
            steps += 1
        pauses.append(steps)
    assert pauses[0] > 0 and pauses[1] == 2 * pauses[0] and pauses[2] == 2 * pauses[1]
    speculator.record(state, 2, 2)  # a good probe: proposing every step again
    assert speculator.propose(state, tokens, 2) == [2, 1]


# --- greedy: token for token -------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("wrong_every", [0, 3])
def test_greedy_output_with_drafts_matches_generate(
    make_engine: Any, tiny_ref: Any, backend: str, wrong_every: int
) -> None:
    llm = make_llm(make_engine, attention_backend=backend)
    prompts = prompts_of(6, seed=11)
    refs = {tuple(p): reference(tiny_ref, p, MAX_NEW) for p in prompts}
    propose_from(llm.engine, refs, wrong_every)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == refs[tuple(prompt)]
    stats = llm.engine.stats
    assert stats.draft_accepted_tokens > 0
    assert stats.generated_tokens == sum(len(o.token_ids) for o in outs)
    assert stats.generated_tokens > stats.token_steps  # several tokens per sequence per step
    if wrong_every:
        assert stats.draft_accepted_tokens < stats.draft_tokens


@pytest.mark.slow
def test_drafts_beside_chunked_prefill_and_preemption_match_generate(make_engine: Any, tiny_ref: Any) -> None:
    # Few blocks and a small step budget: prompts are chunked beside drafted decodes, sequences are
    # preempted and recomputed, and drafts are cut to the budget or dropped for want of blocks.
    llm = make_llm(make_engine, num_kv_blocks=24, block_size=4, max_num_batched_tokens=12, enable_prefix_caching=False)
    prompts = prompts_of(10, seed=12, low=15, high=40)
    refs = {tuple(p): reference(tiny_ref, p, MAX_NEW) for p in prompts}
    propose_from(llm.engine, refs, wrong_every=4)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == refs[tuple(prompt)]
    assert llm.engine.stats.preemptions > 0
    assert llm.engine.stats.draft_accepted_tokens > 0


def test_drafts_fill_the_prefix_cache_with_kept_tokens_only(make_engine: Any, tiny_ref: Any) -> None:
    llm = make_llm(make_engine, block_size=4)
    prompt = prompts_of(1, seed=13, low=21, high=22)[0]
    ref = reference(tiny_ref, prompt, MAX_NEW)
    propose_from(llm.engine, {tuple(prompt): ref}, wrong_every=2)
    assert llm.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW))[0].token_ids == ref
    # The whole first answer is cached: a prompt that extends it hits every full block of it.
    longer = prompt + ref
    llm.engine.speculator.propose = lambda state, tokens, limit: []
    hits = llm.engine.stats.prefix_cache_hits
    llm.generate([longer], SamplingParams(max_new_tokens=2))
    assert llm.engine.stats.prefix_cache_hits - hits == (len(longer) - 1) // 4 * 4


def test_max_tokens_stop_strings_and_logprobs_count_each_kept_token(make_engine: Any, tiny_ref: Any) -> None:
    prompts = prompts_of(4, seed=14)
    refs = {tuple(p): reference(tiny_ref, p, 40) for p in prompts}
    plain = make_llm(make_engine, speculative_tokens=0)
    tokenizer = plain.engine.tokenizer
    stop = tokenizer.decode(refs[tuple(prompts[0])][5:7])
    for params in (
        SamplingParams(max_new_tokens=7, logprobs=2),
        SamplingParams(max_new_tokens=30, stop=[stop]),
    ):
        drafted = make_llm(make_engine)
        propose_from(drafted.engine, refs)
        want, got = plain.generate(prompts, params), drafted.generate(prompts, params)
        for a, b in zip(want, got, strict=True):
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
            if params.logprobs is not None:
                assert b.logprobs == pytest.approx(a.logprobs, abs=1e-9)
                assert [[t for t, _, _ in top] for top in b.top_logprobs or []] == [
                    [t for t, _, _ in top] for top in a.top_logprobs or []
                ]
        assert drafted.engine.stats.draft_accepted_tokens > 0


def test_events_deliver_several_tokens_of_a_sequence_in_order(make_engine: Any, tiny_ref: Any) -> None:
    engine = make_engine(speculate_by_default=True)
    prompt = prompts_of(1, seed=15)[0]
    ref = reference(tiny_ref, prompt, MAX_NEW)
    propose_from(engine, {tuple(prompt): ref})
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=MAX_NEW))
    per_step = []
    while engine.has_unfinished():
        per_step.append([e for e in engine.step() if e.request_id == "r"])
    events = [e for step in per_step for e in step]
    assert [e.index for e in events] == list(range(MAX_NEW))
    assert [e.token_id for e in events] == ref
    assert max(len(step) for step in per_step) == 5  # the decode's token and 4 kept draft tokens
    assert [e.finish_reason for e in events][-1] == "length"


def test_a_request_can_opt_out_and_penalties_never_speculate(make_engine: Any, tiny_ref: Any) -> None:
    engine = make_engine(speculate_by_default=True)
    prompt = prompts_of(1, seed=16)[0]
    propose_from(engine, {tuple(prompt): reference(tiny_ref, prompt, MAX_NEW)})
    engine.add_request("off", prompt, SamplingParams(max_new_tokens=MAX_NEW, speculate=False))
    engine.add_request("penalised", prompt, SamplingParams(max_new_tokens=MAX_NEW, repetition_penalty=1.2))
    run_to_end(engine)
    assert engine.stats.draft_steps == 0


# --- structured output ---------------------------------------------------------------------------
def test_the_grammar_checks_drafts_and_never_keeps_a_forbidden_token(make_engine: Any) -> None:
    pattern = "[0-9]{3}-[a-z]{4}"
    params = SamplingParams(max_new_tokens=30, constraint={"type": "regex", "value": pattern})
    plain = make_engine(speculative_tokens=0)
    tokenizer = plain.tokenizer
    prompt = tokenizer.encode("code:")
    plain.add_request("r", prompt, params)
    want = [e.token_id for e in run_to_end(plain)["r"] if e.token_id >= 0]
    # Drafts from the right answer with every third token wrong: the wrong ones the grammar
    # forbids are cut before the step, the others rejected by the draw.
    drafted = make_engine(speculate_by_default=True)
    propose_from(drafted, {tuple(prompt): want}, wrong_every=3)
    drafted.add_request("r", prompt, params)
    events = run_to_end(drafted)["r"]
    assert [e.token_id for e in events if e.token_id >= 0] == want
    assert drafted.stats.draft_accepted_tokens > 0
    # Drafts the grammar forbids outright never reach the step.
    forbidding = make_engine(speculate_by_default=True)
    forbidding.speculator.propose = lambda state, tokens, limit: tokenizer.encode("!?!?")[:limit]
    forbidding.add_request("r", prompt, params)
    assert [e.token_id for e in run_to_end(forbidding)["r"] if e.token_id >= 0] == want
    assert forbidding.stats.draft_tokens == 0


# --- sampling ------------------------------------------------------------------------------------
def test_seeded_sampling_draws_the_same_tokens_with_and_without_drafts(make_engine: Any, tiny_ref: Any) -> None:
    prompts = prompts_of(4, seed=17)
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_k=4, seed=100 + i) for i in range(4)]
    plain = make_llm(make_engine, speculative_tokens=0)
    want = plain.generate(prompts, params)
    drafted = make_llm(make_engine)
    propose_from(drafted.engine, {tuple(p): w.token_ids for p, w in zip(prompts, want, strict=True)}, wrong_every=3)
    got = drafted.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert 0 < drafted.engine.stats.draft_accepted_tokens < drafted.engine.stats.draft_tokens


@pytest.mark.slow
def test_sampled_tokens_after_a_draft_keep_the_model_distribution(make_engine: Any, tiny_ref: Any) -> None:
    """Three tokens drawn after a fixed context, the second checked as a draft (the likeliest token
    after the first) and the third drawn from the draft's row when it is kept: the empirical joint
    distribution of the three over many seeds matches the model's (top_k 3 at temperature 1: 27
    outcomes), by a chi-square test at the 0.001 level."""
    prompt = prompts_of(1, seed=18, low=8, high=9)[0]
    first = reference(tiny_ref, prompt, 1)  # a fixed token before the drawn ones
    context = prompt + first

    def top3(tail: tuple[int, ...]) -> dict[int, float]:
        with torch.no_grad():
            logits = tiny_ref(torch.tensor([context + list(tail)])).logits[0, -1]
        values, ids = logits.topk(3)
        return dict(zip(ids.tolist(), torch.softmax(values, -1).tolist(), strict=True))

    p2 = top3(())
    p3 = {a: top3((a,)) for a in p2}
    p4 = {(a, b): top3((a, b)) for a in p2 for b in p3[a]}
    expected = {(a, b, c): p2[a] * p3[a][b] * p4[a, b][c] for a in p2 for b in p3[a] for c in p4[a, b]}
    likeliest = {a: max(p, key=p.__getitem__) for a, p in p3.items()}

    engine = make_engine(max_num_seqs=512, num_kv_blocks=4096, max_num_batched_tokens=8192, speculate_by_default=True)

    def propose(state: Any, tokens: list[int], limit: int) -> list[int]:
        return [likeliest[tokens[-1]]][:limit] if len(tokens) == len(context) + 1 else []

    engine.speculator.propose = propose
    engine.speculator.length = lambda state, decodes: 1  # in a step of hundreds of decodes too
    n = 3000
    for i in range(n):
        params = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=3, seed=i)
        engine.add_request(f"s{i}", prompt, params, prior_output_token_ids=first)
    events = run_to_end(engine)
    drawn = Counter(tuple(e.token_id for e in evs if e.token_id >= 0) for evs in events.values())
    assert engine.stats.draft_steps == n and 0 < engine.stats.draft_accepted_tokens < n
    assert sum(drawn.values()) == n and set(drawn) <= set(expected)
    chi2 = sum((drawn.get(k, 0) - n * p) ** 2 / (n * p) for k, p in expected.items())
    assert chi2 < 54.05  # chi-square, 26 degrees of freedom, p = 0.001


# --- the n-gram proposer on a model that copies ------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_model_copying_prompts_speculate_and_match_generate(default_model_name: str) -> None:
    from worker.engine.model.model_loader import load_model

    llm = LLM(default_model_name, dtype="float64", num_kv_blocks=256, speculate_by_default=True)
    ref, tokenizer = load_model(default_model_name, torch.float64, "cpu")
    questions = [
        "Copy this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
        "Extract the email address from this text: Contact John Smith at john.smith@example.com or call 555-0100.",
        "What is the capital of France?",
    ]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in questions
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=32))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference(ref, prompt, 32)
    stats = llm.engine.stats
    assert stats.draft_accepted_tokens > 0 and stats.generated_tokens > stats.token_steps
