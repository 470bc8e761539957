"""Checks every route shares beyond what the body models already enforce: priority range and the
key's ceiling, deadlines, stop sequences, and building the wire SamplingSpec with field names."""

from __future__ import annotations

import random
import time

import pydantic

from producer_api.api_keys import ApiKey, clamp_priority
from producer_api.models_common import RequestOptions
from shared.errors import ValidationError
from shared.schemas import Constraint, SamplingSpec
from shared.settings import Settings

_SEED_LIMIT = 2**63
# Placeholder model names TGI-style clients send when they talk to "the" model behind a URL:
# huggingface_hub's InferenceClient(base_url=...).chat_completion sends "dummy", TGI's docs use "tgi".
DEFAULT_MODEL_PLACEHOLDERS = frozenset({"tgi", "dummy"})


def resolve_model(settings: Settings, name: str) -> str:
    """A placeholder means the default model; any other name must be served (checked by the tokenizers)."""
    return settings.model if name in DEFAULT_MODEL_PLACEHOLDERS else name


def resolve_priority(settings: Settings, requested: int | None, key: ApiKey | None) -> int:
    priority = settings.default_priority if requested is None else requested
    if not 0 <= priority < settings.priority_levels:
        raise ValidationError(
            f"priority must be between 0 and {settings.priority_levels - 1}; given {priority}", field="priority"
        )
    return min(clamp_priority(priority, key), settings.priority_levels - 1)


def resolve_deadline(options: RequestOptions) -> float | None:
    """Unix deadline from `deadline` and/or `timeout` (the earlier wins)."""
    now = time.time()
    candidates = []
    if options.deadline is not None:
        if options.deadline <= now:
            raise ValidationError("deadline is in the past", field="deadline")
        candidates.append(options.deadline)
    if options.timeout is not None:
        candidates.append(now + options.timeout)
    return min(candidates) if candidates else None


def check_stops(settings: Settings, stops: list[str], field: str = "stop") -> list[str]:
    if len(stops) > settings.max_stop_sequences:
        raise ValidationError(
            f"{field} may hold at most {settings.max_stop_sequences} sequences; given {len(stops)}", field=field
        )
    for i, stop in enumerate(stops):
        if stop == "":
            raise ValidationError(f"{field}[{i}] must not be empty", field=f"{field}.{i}")
    return stops


def constraint_of(raw: dict[str, object], field: str) -> Constraint:
    """A wire constraint, compiled by llguidance; its complaint becomes a 422 naming ``field``."""
    try:
        return Constraint.model_validate(raw)
    except pydantic.ValidationError as exc:
        message = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
        raise ValidationError(f"{field}: {message}", field=field) from None


def sampling_spec(**fields: object) -> SamplingSpec:
    """SamplingSpec from route fields; a seed is fixed here when sampling, so responses can report it
    and a request taken over by another worker reproduces its tokens."""
    given = {k: v for k, v in fields.items() if v is not None}
    try:
        spec = SamplingSpec(**given)  # type: ignore[arg-type]
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "parameters"
        raise ValidationError(f"{field}: {err['msg']}", field=field) from None
    if spec.seed is None and spec.temperature > 0:
        spec = spec.model_copy(update={"seed": random.getrandbits(63)})
    return spec


def derived(spec: SamplingSpec, i: int) -> SamplingSpec:
    """The i-th of n choices: its own seed, reproducible from the request's seed."""
    if i == 0 or spec.seed is None:
        return spec
    return spec.model_copy(update={"seed": (spec.seed + i * 0x9E3779B97F4A7C15) % _SEED_LIMIT})
