"""SamplingParams: validated on construction, errors name the field, ranges match the wire twin."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from shared.schemas import SamplingSpec
from worker.engine.sampling.sampling_params import SamplingParams

INVALID = [
    ("max_new_tokens", 0),
    ("max_new_tokens", 1.5),
    ("temperature", -0.1),
    ("temperature", 100.5),
    ("temperature", float("nan")),
    ("top_k", -1),
    ("top_k", True),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("typical_p", 0.0),
    ("typical_p", 1.2),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -2.5),
    ("presence_penalty", 2.1),
    ("presence_penalty", -2.1),
    ("seed", -1),
    ("seed", 2**63),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    ("logprobs", -1),
    ("logprobs", 21),
]

VALID_EDGES = [
    ("max_new_tokens", 1),
    ("temperature", 0.0),
    ("temperature", 100.0),
    ("top_k", 0),
    ("top_p", 1.0),
    ("top_p", 1e-9),
    ("min_p", 0.0),
    ("min_p", 1.0),
    ("typical_p", 1.0),
    ("repetition_penalty", 0.01),
    ("frequency_penalty", -2.0),
    ("presence_penalty", 2.0),
    ("seed", 0),
    ("seed", 2**63 - 1),
    ("logprobs", 0),
    ("logprobs", 20),
]


# top_k=True: pydantic's lax mode reads it as 1. Negative stop token ids: the wire has no bound.
def test_defaults_are_greedy_without_history() -> None:
    params = SamplingParams()
    assert params.is_greedy
    assert not params.needs_history
    assert params.stop == [] and params.stop_token_ids == [] and params.logprobs is None


@pytest.mark.parametrize(("name", "value"), INVALID)
def test_invalid_value_raises_an_error_naming_the_field(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_top_p_error_message_states_the_range() -> None:
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        SamplingParams(top_p=0)


@pytest.mark.parametrize(("name", "value"), VALID_EDGES)
def test_range_edges_are_accepted(name: str, value: object) -> None:
    SamplingParams(**{name: value})


@pytest.mark.parametrize(("name", "value"), INVALID + VALID_EDGES)
def test_engine_and_wire_agree_on_every_range(name: str, value: object) -> None:
    engine_ok = wire_ok = True
    try:
        SamplingParams(**{name: value})
    except ValueError:
        engine_ok = False
    try:
        SamplingSpec(**{name: value})
    except ValidationError:
        wire_ok = False
    assert engine_ok == wire_ok


def test_field_names_and_defaults_match_the_wire_spec() -> None:
    engine = {f.name: f for f in dataclasses.fields(SamplingParams)}
    assert list(engine) == list(SamplingSpec.model_fields)
    spec = SamplingSpec()
    params = SamplingParams()
    for name in engine:
        assert getattr(params, name) == getattr(spec, name), name


# A valid value other than the default for every wire field.
NON_DEFAULT = {
    "max_new_tokens": 7,
    "temperature": 0.7,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.05,
    "typical_p": 0.8,
    "repetition_penalty": 1.2,
    "frequency_penalty": 0.5,
    "presence_penalty": -0.5,
    "seed": 7,
    "stop": ["\n\n", "###"],
    "stop_token_ids": [2, 5],
    "ignore_eos": True,
    "logprobs": 2,
}


def test_every_wire_field_reaches_the_engine_unchanged() -> None:
    """The worker builds the engine's params as ``SamplingParams(**spec.model_dump())``: a field dropped,
    renamed or re-defaulted on the way would change what the engine samples without any error."""
    assert set(NON_DEFAULT) <= set(SamplingSpec.model_fields)
    spec = SamplingSpec(**NON_DEFAULT)
    assert all(getattr(spec, name) != getattr(SamplingSpec(), name) for name in NON_DEFAULT), "premise: not defaults"
    params = SamplingParams(**spec.model_dump())
    assert {name: getattr(params, name) for name in NON_DEFAULT} == NON_DEFAULT
    assert dataclasses.asdict(params) == spec.model_dump()
    assert not params.is_greedy and params.needs_history


def test_a_single_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"), [("repetition_penalty", 1.1), ("frequency_penalty", 0.5), ("presence_penalty", -0.5)]
)
def test_any_penalty_needs_history(field: str, value: float) -> None:
    assert SamplingParams(**{field: value}).needs_history


def test_positive_temperature_is_not_greedy() -> None:
    assert not SamplingParams(temperature=0.5).is_greedy
