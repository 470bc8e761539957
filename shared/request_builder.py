"""A new request, normalised once for every entry point (the HTTP routes, the queue client's
``submit``, batch lines): its defaults, range checks and seed are applied here and nowhere else.

- priority: ``settings.default_priority`` when none is named; refused outside
  0..priority_levels - 1; never more urgent than a caller's ceiling (an API key's).
- sampling: ``settings.default_max_new_tokens`` when no sampling is given; field ranges are the
  wire schema's (``shared.schemas.SamplingFields``); a sampled request gets its seed here, so a
  request taken over by another worker reproduces its tokens and responses can report the seed;
  the n choices of one request get their own seeds, reproducible from the first.

The defaults themselves are named once, in ``shared.schemas`` (``DEFAULT_PRIORITY``,
``DEFAULT_MAX_NEW_TOKENS``), and configurable in ``shared.settings``."""

from __future__ import annotations

import random

import pydantic

from shared.errors import ValidationError
from shared.schemas import SEED_LIMIT, QueuedRequest, SamplingSpec, new_request_id
from shared.settings import Settings

_SEED_STRIDE = 0x9E3779B97F4A7C15  # the golden-ratio increment: n choices' seeds spread over the range


def resolve_priority(settings: Settings, requested: int | None, *, most_urgent: int | None = None) -> int:
    """The priority a request runs at; ``most_urgent``: the lowest number its caller may use."""
    priority = settings.default_priority if requested is None else requested
    if not 0 <= priority < settings.priority_levels:
        raise ValidationError(
            f"priority must be between 0 and {settings.priority_levels - 1}; given {priority}", field="priority"
        )
    if most_urgent is not None:
        priority = min(max(priority, most_urgent), settings.priority_levels - 1)
    return priority


def seeded(spec: SamplingSpec) -> SamplingSpec:
    """``spec`` with a seed when it samples (greedy decoding needs none)."""
    if spec.seed is None and spec.temperature > 0:
        return spec.model_copy(update={"seed": random.randrange(SEED_LIMIT)})
    return spec


def sampling_spec(**fields: object) -> SamplingSpec:
    """A seeded SamplingSpec from a route's fields (None: the field's default); a value out of
    range is a ValidationError naming the field."""
    given = {k: v for k, v in fields.items() if v is not None}
    try:
        spec = SamplingSpec(**given)  # type: ignore[arg-type]
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "parameters"
        raise ValidationError(f"{field}: {err['msg']}", field=field) from None
    return seeded(spec)


def derived(spec: SamplingSpec, i: int) -> SamplingSpec:
    """The i-th of n choices: its own seed, reproducible from the request's seed."""
    if i == 0 or spec.seed is None:
        return spec
    return spec.model_copy(update={"seed": (spec.seed + i * _SEED_STRIDE) % SEED_LIMIT})


def new_request(
    model: str,
    prompt_token_ids: list[int],
    sampling: SamplingSpec,
    *,
    priority: int,
    deadline: float | None = None,
    tenant: str | None = None,
    request_id: str | None = None,
) -> QueuedRequest:
    """A request whose priority ``resolve_priority`` gave and whose sampling is seeded."""
    return QueuedRequest(
        id=request_id or new_request_id(),
        model=model,
        prompt_token_ids=prompt_token_ids,
        sampling=seeded(sampling),
        priority=priority,
        deadline=deadline,
        tenant=tenant,
    )


def build_request(
    settings: Settings,
    model: str,
    prompt_token_ids: list[int],
    sampling: SamplingSpec | None = None,
    *,
    priority: int | None = None,
    deadline: float | None = None,
    tenant: str | None = None,
    request_id: str | None = None,
) -> QueuedRequest:
    """A request from the queue client's arguments, with every default applied and checked."""
    return new_request(
        model,
        prompt_token_ids,
        sampling or SamplingSpec(max_new_tokens=settings.default_max_new_tokens),
        priority=resolve_priority(settings, priority),
        deadline=deadline,
        tenant=tenant,
        request_id=request_id,
    )
