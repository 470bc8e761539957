"""How one request wants its tokens chosen and when it stops.

The field names and ranges are those of ``shared.schemas.SamplingSpec`` (the wire twin), so the
worker passes a spec straight through as ``SamplingParams(**spec.model_dump())``; the engine may
not import ``shared``, so the ranges are repeated here and a test pins that the two agree."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from worker.engine.sampling.structured import Constraint

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt + output
    frequency_penalty: float = 0.0  # OpenAI semantics, over output only
    presence_penalty: float = 0.0  # OpenAI semantics, over output only
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per token; 0 = only the sampled token's; None = none
    constraint: Constraint | None = None  # the output must match it (structured.py); the wire's dict works too
    watermark: bool = False  # TGI's green-list watermark (watermark.py)
    speculate: bool | None = None  # n-gram speculation (core/speculation.py); None: the engine's default

    def __post_init__(self) -> None:
        # Accept the shapes callers naturally write (a single stop string, tuples), store lists.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.constraint = Constraint.coerce(self.constraint)
        self._validate()

    def _validate(self) -> None:
        _int_in("max_new_tokens", self.max_new_tokens, 1, None)
        _float_in("temperature", self.temperature, 0.0, 100.0)
        _int_in("top_k", self.top_k, 0, None)
        _float_in("top_p", self.top_p, 0.0, 1.0, open_low=True)
        _float_in("min_p", self.min_p, 0.0, 1.0)
        _float_in("typical_p", self.typical_p, 0.0, 1.0, open_low=True)
        _float_in("repetition_penalty", self.repetition_penalty, 0.0, None, open_low=True)
        _float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _float_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if self.seed is not None:
            _int_in("seed", self.seed, 0, MAX_SEED)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.watermark, bool):
            raise ValueError(f"watermark must be a bool, got {self.watermark!r}")
        if self.speculate is not None and not isinstance(self.speculate, bool):
            raise ValueError(f"speculate must be a bool, got {self.speculate!r}")
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """Whether choosing a token depends on the tokens seen so far (any penalty active)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _is_int(value: object) -> bool:
    # bool is an int subclass; top_k=True is a bug in the caller, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(name: str, value: object, low: int, high: int | None) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    assert isinstance(value, int)
    if value < low or (high is not None and value > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def _float_in(name: str, value: object, low: float, high: float | None, *, open_low: bool = False) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    ok = math.isfinite(v) and (v > low if open_low else v >= low) and (high is None or v <= high)
    if not ok:
        left = "(" if open_low else "["
        bounds = f"in {left}{low:g}, {high:g}]" if high is not None else f"{'>' if open_low else '>='} {low:g}"
        raise ValueError(f"{name} must be {bounds}, got {value!r}")
