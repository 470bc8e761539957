"""Structured output in the engine: every output of a constrained request matches its constraint,
whatever the model (here a tiny random one) would rather say; constrained and free rows share a
batch; preemption, chunked prefill and a crash resume keep the matcher in step; a broken
constraint or matcher fails its own request only."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine.conftest import run_to_end
from tests.structured_cases import PROMPTS, REGEXES, SCHEMAS, full_match, validate
from worker.engine import SamplingParams
from worker.engine.sampling.structured import Constraint


def text_of(events: list[Any]) -> str:
    return "".join(e.text for e in events)


def finish_of(events: list[Any]) -> str | None:
    return events[-1].finish_reason


def schema_params(schema: dict[str, Any], temperature: float, seed: int, **kw: Any) -> SamplingParams:
    kw.setdefault("max_new_tokens", 300)
    return SamplingParams(temperature=temperature, seed=seed, constraint={"type": "json_schema", "value": schema}, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_output_validates_against_its_schema(make_engine: Any, temperature: float) -> None:
    engine = make_engine(max_num_seqs=64, num_kv_blocks=1024, block_size=16)
    tok = engine.tokenizer
    for name, schema in SCHEMAS.items():
        for i, text in enumerate(PROMPTS):
            engine.add_request(f"{name}/{i}", tok.encode(text), schema_params(schema, temperature, seed=i))
    events = run_to_end(engine)
    assert len(events) == len(SCHEMAS) * len(PROMPTS)
    for request_id, evs in events.items():
        # Every case here is bounded, so every generation ends by completing its JSON.
        assert finish_of(evs) == "eos_token", (request_id, text_of(evs))
        validate(text_of(evs), SCHEMAS[request_id.split("/")[0]])


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_output_fully_matches_its_regex(make_engine: Any, temperature: float) -> None:
    engine = make_engine(max_num_seqs=32, num_kv_blocks=512, block_size=16)
    for r, pattern in enumerate(REGEXES):
        for i, text in enumerate(PROMPTS):
            params = SamplingParams(
                max_new_tokens=64, temperature=temperature, seed=i, constraint={"type": "regex", "value": pattern}
            )
            engine.add_request(f"{r}/{i}", engine.tokenizer.encode(text), params)
    for request_id, evs in run_to_end(engine).items():
        pattern = REGEXES[int(request_id.split("/")[0])]
        # A regex like (ab|cd)+x may go on; a length finish is then an honest prefix, not a match.
        if finish_of(evs) == "length":
            assert Constraint("regex", pattern) and not full_match(pattern, text_of(evs))
            continue
        assert full_match(pattern, text_of(evs)), (pattern, text_of(evs))


def test_a_lark_grammar_constrains_the_output(make_engine: Any) -> None:
    engine = make_engine()
    grammar = 'start: "answer: " ANSWER\nANSWER: "yes" | "no"'
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=3, constraint={"type": "lark", "value": grammar})
    engine.add_request("lark", engine.tokenizer.encode("Well?"), params)
    assert text_of(run_to_end(engine)["lark"]) in ("answer: yes", "answer: no")


def test_characters_spelled_only_in_byte_pieces_are_producible(make_engine: Any) -> None:
    engine = make_engine()
    params = SamplingParams(max_new_tokens=30, constraint={"type": "regex", "value": "😀🦀 done"})
    engine.add_request("bytes", engine.tokenizer.encode("emoji"), params)
    evs = run_to_end(engine)["bytes"]
    assert text_of(evs) == "😀🦀 done"
    assert finish_of(evs) == "eos_token"


def test_free_and_constrained_rows_share_a_batch_each_correct(make_engine: Any) -> None:
    free = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = make_engine()
    alone.add_request("free", alone.tokenizer.encode("hello there"), free)
    expected = [e.token_id for e in run_to_end(alone)["free"]]

    engine = make_engine()
    tok = engine.tokenizer
    engine.add_request("json", tok.encode("hi"), schema_params(SCHEMAS["enums"], 0.0, seed=1))
    engine.add_request("free", tok.encode("hello there"), free)
    engine.add_request("regex", tok.encode("x"), SamplingParams(constraint={"type": "regex", "value": "[0-9]{4}"}))
    events = run_to_end(engine)
    assert [e.token_id for e in events["free"]] == expected
    validate(text_of(events["json"]), SCHEMAS["enums"])
    assert full_match("[0-9]{4}", text_of(events["regex"]))
    assert engine.stats.masked_rows > 0 and engine.stats.mask_time_s > 0


def test_a_finished_grammar_ends_the_sequence_even_with_ignore_eos(make_engine: Any) -> None:
    engine = make_engine()
    params = SamplingParams(max_new_tokens=50, ignore_eos=True, constraint={"type": "regex", "value": "abc"})
    engine.add_request("r", engine.tokenizer.encode("x"), params)
    evs = run_to_end(engine)["r"]
    assert text_of(evs) == "abc" and finish_of(evs) == "eos_token"


def test_preemption_and_chunked_prefill_keep_the_matcher_in_step(make_engine: Any) -> None:
    # 24 blocks of 4 tokens for 6 sequences that each want ~10: the scheduler must preempt.
    engine = make_engine(num_kv_blocks=24, block_size=4, max_num_batched_tokens=8)
    schema = SCHEMAS["refs_and_defs"]
    long_prompt = engine.tokenizer.encode("a rather long prompt that needs several prefill chunks " * 2)
    for i in range(6):
        engine.add_request(str(i), long_prompt[: 10 + i], schema_params(schema, 1.0, seed=i))
    events = run_to_end(engine)
    assert engine.stats.preemptions > 0
    for evs in events.values():
        validate(text_of(evs), schema)


@pytest.mark.parametrize("cut", [1, 7, 15])
def test_a_resumed_request_replays_its_tokens_into_a_fresh_matcher(make_engine: Any, cut: int) -> None:
    schema = SCHEMAS["nested_objects"]
    params = schema_params(schema, 1.0, seed=11)
    prompt = make_engine().tokenizer.encode("resume me")
    whole = make_engine()
    whole.add_request("r", prompt, params)
    full = [e for e in run_to_end(whole)["r"] if e.token_id >= 0]
    assert len(full) > cut

    resumed = make_engine()  # a second worker: only the prompt and the tokens already streamed
    resumed.add_request("r", prompt, params, prior_output_token_ids=[e.token_id for e in full[:cut]])
    rest = run_to_end(resumed)["r"]
    assert [e.index for e in rest if e.token_id >= 0] == list(range(cut, len(full)))
    assert [e.token_id for e in rest if e.token_id >= 0] == [e.token_id for e in full[cut:]]
    validate(text_of(full[:cut]) + text_of(rest), schema)


def test_an_invalid_constraint_is_refused_at_add_request(make_engine: Any) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="regex"):
        engine.add_request("bad", [1, 2], SamplingParams(constraint={"type": "regex", "value": "[a-"}))
    with pytest.raises(ValueError, match="does not match"):
        engine.add_request(
            "prior",
            [1, 2],
            SamplingParams(constraint={"type": "regex", "value": "[0-9]+"}),
            prior_output_token_ids=engine.tokenizer.encode("abc", add_special_tokens=False),
        )
    assert not engine.has_unfinished()


def test_a_broken_matcher_fails_its_request_alone(make_engine: Any) -> None:
    engine = make_engine()
    tok = engine.tokenizer
    engine.add_request("victim", tok.encode("a"), schema_params(SCHEMAS["enums"], 0.0, seed=0))
    engine.add_request("other", tok.encode("b"), schema_params(SCHEMAS["enums"], 0.0, seed=0))
    first = engine.step()
    victim = engine._seqs["victim"]
    victim.matcher.consume_token(tok.encode("zzz", add_special_tokens=False)[0])  # not JSON: error state
    events = run_to_end(engine)
    assert finish_of(events["victim"]) == "error" and "structured output" in (events["victim"][-1].error or "")
    validate(text_of([e for e in first if e.request_id == "other"] + events["other"]), SCHEMAS["enums"])


def test_compiled_constraints_are_shared_by_requests(make_engine: Any) -> None:
    engine = make_engine()
    schema = SCHEMAS["numbers_with_bounds"]
    for i in range(3):
        engine.add_request(str(i), [5, 6, 7], schema_params(dict(reversed(list(schema.items()))), 0.0, seed=i))
    assert len(engine.structured._templates) == 1
    run_to_end(engine)
