"""Checks every route shares beyond what the body models already enforce: the API key's priority
ceiling, deadlines, stop sequences, constraints. Defaults, ranges and seeds of the request itself
are ``shared.request_builder``'s."""

from __future__ import annotations

import time

import pydantic

from producer_api.api_keys import ApiKey
from producer_api.models_common import RequestOptions
from shared import request_builder
from shared.errors import ValidationError
from shared.schemas import Constraint
from shared.settings import Settings

# Placeholder model names TGI-style clients send when they talk to "the" model behind a URL:
# huggingface_hub's InferenceClient(base_url=...).chat_completion sends "dummy", TGI's docs use "tgi".
DEFAULT_MODEL_PLACEHOLDERS = frozenset({"tgi", "dummy"})


def resolve_model(settings: Settings, name: str) -> str:
    """A placeholder means the default model; any other name must be served (checked by the tokenizers)."""
    return settings.model if name in DEFAULT_MODEL_PLACEHOLDERS else name


def resolve_priority(settings: Settings, requested: int | None, key: ApiKey | None) -> int:
    """The request's priority, never more urgent than its API key allows."""
    return request_builder.resolve_priority(settings, requested, most_urgent=key.max_priority if key else None)


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
