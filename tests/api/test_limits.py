"""The checks every route shares, as TGI's router applies them: token budgets, priorities, seeds."""

from __future__ import annotations

import time

import pytest

from producer_api.api_keys import parse_key
from producer_api.models_common import RequestOptions
from producer_api.openai.formatting import completion_logprobs
from producer_api.tokenization import enforce_limits
from producer_api.validation import resolve_deadline, resolve_priority
from shared.errors import ValidationError
from shared.request_builder import derived, sampling_spec
from shared.schemas import TokenEvent
from shared.settings import Settings

SETTINGS = Settings(max_input_tokens=10, max_total_tokens=16, max_new_tokens=8, default_max_new_tokens=5)


def limits(n_prompt: int, max_new: int | None, truncate: int | None = None) -> tuple[int, int]:
    ids, max_new_tokens = enforce_limits(
        SETTINGS,
        list(range(n_prompt)),
        max_new,
        prompt_field="inputs",
        max_new_tokens_field="max_new_tokens",
        truncate=truncate,
    )
    return len(ids), max_new_tokens


def test_default_max_new_tokens_shrinks_to_fit_the_total_budget() -> None:
    assert limits(3, None) == (3, 5)
    assert limits(10, None) == (10, 5)
    assert limits(10, 6) == (10, 6)


def test_budgets_name_the_field_that_broke_them() -> None:
    with pytest.raises(ValidationError) as info:
        limits(11, None)
    assert info.value.field == "inputs"
    with pytest.raises(ValidationError) as info:
        limits(10, 7)
    assert info.value.field == "max_new_tokens"
    with pytest.raises(ValidationError):
        limits(1, 9)  # over the cap
    with pytest.raises(ValidationError):
        limits(0, 1)


def test_truncate_keeps_the_end_of_the_prompt() -> None:
    ids, _ = enforce_limits(SETTINGS, list(range(30)), 2, prompt_field="inputs", max_new_tokens_field="m", truncate=4)
    assert ids == [26, 27, 28, 29]


def test_priority_default_range_and_key_ceiling() -> None:
    assert resolve_priority(SETTINGS, None, None) == SETTINGS.default_priority
    assert resolve_priority(SETTINGS, 0, parse_key("k:2")) == 2
    assert resolve_priority(SETTINGS, 3, parse_key("k:2")) == 3
    assert resolve_priority(SETTINGS, 0, parse_key("k")) == 0
    with pytest.raises(ValidationError):
        resolve_priority(SETTINGS, SETTINGS.priority_levels, None)


def test_deadline_is_the_earlier_of_deadline_and_timeout() -> None:
    now = time.time()
    assert resolve_deadline(RequestOptions()) is None
    assert resolve_deadline(RequestOptions(timeout=10)) == pytest.approx(now + 10, abs=1)
    assert resolve_deadline(RequestOptions(timeout=100, deadline=now + 5)) == pytest.approx(now + 5)


def test_sampling_gets_a_seed_and_choices_get_distinct_reproducible_seeds() -> None:
    assert sampling_spec(temperature=0.0).seed is None  # greedy needs none
    spec = sampling_spec(temperature=0.8)
    assert spec.seed is not None
    seeds = [derived(spec, i).seed for i in range(4)]
    assert len(set(seeds)) == 4 and derived(spec, 2).seed == seeds[2]
    with pytest.raises(ValidationError) as info:
        sampling_spec(top_p=0.0)
    assert info.value.field == "top_p"


def test_openai_completion_logprobs_carry_text_offsets() -> None:
    tokens = [TokenEvent(request_id="r", index=i, token_id=i, text=t, logprob=-1.0) for i, t in enumerate(["ab", "c"])]
    shaped = completion_logprobs(tokens, offset=5, top=0)
    assert shaped == {
        "tokens": ["ab", "c"],
        "token_logprobs": [-1.0, -1.0],
        "top_logprobs": None,
        "text_offset": [5, 7],
    }
