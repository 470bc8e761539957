"""Grammar-constrained decoding: the regex engine agrees with Python's, JSON schemas become the
right languages, and whatever the logits say, a constrained output is in the language."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
import torch

from worker.engine.grammar import DEAD, Grammar, GrammarCache, TokenVocabulary
from worker.engine.json_schema import json_schema_to_regex
from worker.engine.model_loader import load_tokenizer
from worker.engine.regex_nfa import Nfa, parse_regex
from worker.engine.sampler import Sampler, SamplingRow
from worker.engine.sampling_params import SamplingParams

PATTERNS = {
    r"a|b": ["a", "b"],
    r"(ab)*c": ["c", "abababc"],
    r"[a-c]+x?": ["abcx", "cc"],
    r"\d{2,3}": ["12", "123"],
    r"[^ab]{2}": ["zz", "\n1"],
    r"(?:foo|ba[rz])+": ["foobarbaz"],
    r"a{0,2}b{1,}": ["bbb", "aab"],
    r".\.": ["x."],
    r"\w+\s\W": ["abc_1 -"],
    r"[\d-]+": ["1-2-3"],
    r"(a|)b": ["ab", "b"],
    r"[]a]+": ["]a]"],
    r"a+?b": ["aaab"],
    r"\u00e9\x41": ["éA"],
    r'"(?:[^"\\]|\\["\\/bfnrt])*"': ['"a\\"b"', '""'],
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?": ["-12.5e+3", "0"],
}


def nfa_matches(nfa: Nfa, text: str) -> bool:
    states = nfa.closure({nfa.start})
    for ch in text:
        states = nfa.closure(nfa.move(states, ch))
    return nfa.accept in states


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_the_regex_engine_agrees_with_python_re(pattern: str) -> None:
    rng = random.Random(pattern)
    alphabet = 'abcxz019.- "\\\nfoobarbaz/eE+]é'
    samples = PATTERNS[pattern] + ["".join(rng.choice(alphabet) for _ in range(rng.randrange(7))) for _ in range(400)]
    nfa = parse_regex(pattern)
    for text in samples:
        assert nfa_matches(nfa, text) == (re.fullmatch(pattern, text, re.ASCII) is not None), text
    assert all(nfa_matches(nfa, text) for text in PATTERNS[pattern])


@pytest.mark.parametrize("pattern", [r"(?=a)b", r"(a)\1", r"a{3,1}", r"(ab", r"ab)", r"*a", r"[z-a]"])
def test_unsupported_or_broken_regexes_are_rejected(pattern: str) -> None:
    with pytest.raises(ValueError, match="regex"):
        parse_regex(pattern)


PERSON = {
    "$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]}},
    "type": "object",
    "title": "Person",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0},
        "score": {"type": "number"},
        "nickname": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]},
        "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}, "maxItems": 2},
        "active": {"type": "boolean"},
        "born": {"type": "string", "format": "date"},
    },
    "required": ["name", "age", "active"],
}


@pytest.mark.parametrize(
    ("document", "valid"),
    [
        ('{"name": "Ann", "age": 31, "active": true}', True),
        ('{"name":"Ann","age":31,"score":-1.5e3,"active":false}', True),
        ('{"name": "Bo", "age": 0, "nickname": null, "pets": [{"kind": "cat"}, {"kind":"dog"}], "active": true}', True),
        ('{"name": "Bo", "age": 0, "active": true, "born": "2024-02-29"}', True),
        ('{"age": 31, "name": "Ann", "active": true}', False),  # declared order
        ('{"name": "Ann", "active": true}', False),  # age is required
        ('{"name": "Annabelle", "age": 31, "active": true}', False),  # maxLength
        ('{"name": "Ann", "age": 3.5, "active": true}', False),  # integer
        ('{"name": "Ann", "age": 1, "pets": [{"kind": "cow"}], "active": true}', False),  # enum
        (
            '{"name": "Ann", "age": 1, "pets": [{"kind": "cat"}, {"kind": "cat"}, {"kind": "cat"}], "active": true}',
            False,
        ),
        ('{"name": "Ann", "age": 1, "active": true, "extra": 1}', False),  # no extra properties
        ('{"name": "Ann", "age": 1, "active": true, "born": "2024-13-01"}', False),
        ('{"name": "Ann", "age": 1,, "active": true}', False),
    ],
)
def test_a_json_schema_becomes_the_language_of_its_documents(document: str, valid: bool) -> None:
    assert (re.fullmatch(json_schema_to_regex(PERSON), document) is not None) == valid


def test_optional_properties_may_all_be_absent_with_no_stray_commas() -> None:
    pattern = json_schema_to_regex({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "null"}}})
    for doc in ["{}", '{"a": 1}', '{"b": null}', '{"a": 1, "b": null}']:
        assert re.fullmatch(pattern, doc), doc
    for doc in ['{, "b": null}', '{"a": 1,}', '{"b": null, "a": 1}']:
        assert not re.fullmatch(pattern, doc), doc


@pytest.mark.parametrize(
    "schema",
    [
        {},
        {"type": "object", "additionalProperties": True},
        {"type": "string", "format": "email"},
        {"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {}},
        {"$ref": "https://example.com/schema"},
        {"allOf": [{"type": "integer"}, {"type": "number"}]},
    ],
)
def test_unsupported_schemas_are_refused_not_loosened(schema: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        json_schema_to_regex(schema)


@pytest.fixture(scope="module")
def tokenizer(default_model_name: str) -> Any:
    return load_tokenizer(default_model_name)


@pytest.fixture(scope="module")
def vocabulary(tokenizer: Any) -> TokenVocabulary:
    return TokenVocabulary.from_tokenizer(tokenizer)


def brute_force_allowed(grammar: Grammar, state: int) -> set[int]:
    allowed = set()
    for token_id, text in enumerate(grammar.vocabulary.texts):
        at = state
        for ch in text or "":
            at = grammar.step(at, ch)
            if at == DEAD:
                break
        if text and at != DEAD:
            allowed.add(token_id)
    if grammar.is_accepting(state) or not allowed:
        allowed |= set(grammar.vocabulary.eos_token_ids)
    return allowed


def test_token_masks_equal_a_token_by_token_check(tokenizer: Any, vocabulary: TokenVocabulary) -> None:
    grammar = Grammar(r'\{"n": (-?[1-9][0-9]{0,3}|"[a-z ]*")\}', vocabulary)
    state = grammar.initial_state
    for token_id in tokenizer.encode('{"n": "ab cd"}', add_special_tokens=False):
        expected = brute_force_allowed(grammar, state)
        assert set(grammar.allowed(state).nonzero().flatten().tolist()) == expected
        assert token_id in expected
        state = grammar.advance(state, token_id)
    assert grammar.is_accepting(state)
    assert grammar.allowed(state).nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_vocabulary_leaves_out_special_tokens_and_byte_fragments(tokenizer: Any, vocabulary: TokenVocabulary) -> None:
    assert vocabulary.texts[tokenizer.eos_token_id] is None
    sun = tokenizer.encode(" 🌞", add_special_tokens=False)
    assert len(sun) > 1 and all(vocabulary.texts[t] is None for t in sun[1:])
    assert vocabulary.texts[tokenizer.encode(" hello", add_special_tokens=False)[0]] == " hello"


def generate(sampler: Sampler, rows: list[SamplingRow], eos: int, seed: int, steps: int = 120) -> list[list[int]]:
    """Drives the sampler with random logits, as a model that knows nothing of the grammar."""
    gen = torch.Generator().manual_seed(seed)
    outputs: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    for _ in range(steps):
        logits = torch.randn(len(rows), sampler.vocab_size, generator=gen) * 4
        live = [i for i in range(len(rows)) if not done[i]]
        if not live:
            break
        batch = [
            SamplingRow(rows[i].request_id, rows[i].params, [1], list(outputs[i]), len(outputs[i]), rows[i].grammar)
            for i in live
        ]
        for i, token in zip(live, sampler.sample(logits[live], batch).token_ids, strict=True):
            if token == eos and rows[i].grammar is not None:
                done[i] = True
            else:
                outputs[i].append(token)
    assert all(done[i] for i in range(len(rows)) if rows[i].grammar is not None)
    return outputs


def test_constrained_outputs_are_valid_documents_whatever_the_logits(
    tokenizer: Any, vocabulary: TokenVocabulary
) -> None:
    grammar = Grammar(json_schema_to_regex(PERSON), vocabulary)
    sampler = Sampler(len(tokenizer), torch.device("cpu"))
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3, top_p=0.9)]
    rows = [SamplingRow(f"r{i}", p, [1], [], 0, grammar) for i, p in enumerate(params)]
    rows.append(SamplingRow("free", SamplingParams(), [1], [], 0))  # an unconstrained neighbour
    for seed in range(2):
        outputs = generate(sampler, rows, tokenizer.eos_token_id, seed)
        for output in outputs[:2]:
            text = tokenizer.decode(output)
            assert re.fullmatch(json_schema_to_regex(PERSON), text), text
            document = json.loads(text)
            assert isinstance(document["name"], str) and isinstance(document["age"], int)
        for rid in ("r0", "r1", "free"):
            sampler.release(rid)


def test_a_regex_forces_its_shape_and_then_the_end(tokenizer: Any, vocabulary: TokenVocabulary) -> None:
    grammar = Grammar(r"\(\d{3}\) \d{3}-\d{4}", vocabulary)
    sampler = Sampler(len(tokenizer), torch.device("cpu"))
    rows = [SamplingRow("phone", SamplingParams(temperature=1.0, seed=5), [1], [], 0, grammar)]
    (output,) = generate(sampler, rows, tokenizer.eos_token_id, seed=11)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", tokenizer.decode(output))


def test_the_grammar_state_follows_the_output_across_samplers(tokenizer: Any, vocabulary: TokenVocabulary) -> None:
    """A resumed request (a fresh sampler, output so far given) is constrained as before."""
    grammar = Grammar(r"(yes|no|maybe)!", vocabulary)
    partial = tokenizer.encode("may", add_special_tokens=False)
    logits = torch.zeros(1, len(tokenizer))
    logits[0, tokenizer.encode("!", add_special_tokens=False)[0]] = 5.0  # the model wants "!" now
    row = SamplingRow("r", SamplingParams(), [1], partial, len(partial), grammar)
    token = Sampler(len(tokenizer), torch.device("cpu")).sample(logits, [row]).token_ids[0]
    text = vocabulary.texts[token]
    assert text and "be!".startswith(text)  # not the "!" the logits favour


def test_the_cache_compiles_each_pattern_once_and_shares_the_vocabulary(tokenizer: Any) -> None:
    cache = GrammarCache(tokenizer, size=2)
    first = cache.json_schema({"type": "integer"})
    assert cache.regex(json_schema_to_regex({"type": "integer"})) is first
    assert cache.regex("a+").vocabulary is first.vocabulary
    cache.regex("b+")
    assert cache.json_schema({"type": "integer"}) is not first  # evicted, least recently used
    with pytest.raises(ValueError):
        cache.regex("(a")


def test_the_model_padding_ids_are_never_allowed(tokenizer: Any) -> None:
    width = len(tokenizer) + 16
    grammar = GrammarCache(tokenizer, vocab_size=width).regex("[0-9]+")
    logits = torch.zeros(1, width)
    logits[0, len(tokenizer) :] = 100.0  # the model's untrained padding rows
    row = SamplingRow("r", SamplingParams(temperature=1.0, seed=1), [1], [], 0, grammar)
    token = Sampler(width, torch.device("cpu")).sample(logits, [row]).token_ids[0]
    assert token < len(tokenizer) and tokenizer.decode([token]).isdigit()
