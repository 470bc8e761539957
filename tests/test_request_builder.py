"""A new request is normalised in one place (shared/request_builder.py): defaults, ranges, seeds."""

from __future__ import annotations

import pytest

from shared.errors import ValidationError
from shared.request_builder import build_request, derived, new_request, resolve_priority, sampling_spec
from shared.schemas import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PRIORITY, SamplingSpec
from shared.settings import Settings

SETTINGS = Settings(priority_levels=4, default_priority=2, default_max_new_tokens=7)


def test_the_named_defaults_are_the_settings_defaults() -> None:
    assert Settings().default_priority == DEFAULT_PRIORITY
    assert Settings().default_max_new_tokens == DEFAULT_MAX_NEW_TOKENS == SamplingSpec().max_new_tokens


def test_a_request_that_names_nothing_gets_the_deployments_defaults() -> None:
    request = build_request(SETTINGS, "m", [1, 2])
    assert request.priority == 2 and request.sampling.max_new_tokens == 7
    assert request.sampling.seed is None  # greedy: no seed needed


def test_a_sampled_request_gets_a_seed_once_and_keeps_a_given_one() -> None:
    sampled = build_request(SETTINGS, "m", [1], SamplingSpec(temperature=0.5))
    assert sampled.sampling.seed is not None
    again = new_request("m", [1], sampled.sampling, priority=0)
    assert again.sampling.seed == sampled.sampling.seed
    assert build_request(SETTINGS, "m", [1], SamplingSpec(temperature=0.5, seed=9)).sampling.seed == 9
    assert sampling_spec(temperature=0.5).seed is not None and sampling_spec(temperature=0.0).seed is None


@pytest.mark.parametrize("priority", [-1, 4, 99])
def test_a_priority_outside_the_levels_is_refused_naming_the_field(priority: int) -> None:
    with pytest.raises(ValidationError) as refused:
        build_request(SETTINGS, "m", [1], priority=priority)
    assert refused.value.field == "priority" and "between 0 and 3" in refused.value.message


def test_a_callers_ceiling_makes_a_priority_less_urgent_but_never_past_the_last_level() -> None:
    assert resolve_priority(SETTINGS, 0, most_urgent=2) == 2
    assert resolve_priority(SETTINGS, 3, most_urgent=2) == 3
    assert resolve_priority(SETTINGS, None, most_urgent=3) == 3
    assert resolve_priority(SETTINGS, 0, most_urgent=9) == 3
    with pytest.raises(ValidationError):
        resolve_priority(SETTINGS, 4, most_urgent=2)  # checked before the ceiling, not clamped into range


def test_choices_of_one_request_get_distinct_seeds_within_the_range() -> None:
    spec = SamplingSpec(temperature=1.0, seed=2**63 - 1)
    seeds = [derived(spec, i).seed for i in range(8)]
    assert seeds[0] == 2**63 - 1 and len(set(seeds)) == 8
    assert all(0 <= s < 2**63 for s in seeds)  # type: ignore[operator]
