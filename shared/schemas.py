"""The wire contract: JSON documents that cross Redis, validated by pydantic on both ends.

Never pickle. Field names of ``SamplingSpec`` are those of the engine's ``SamplingParams``
so the worker can pass them straight through."""

from __future__ import annotations

import json
import time
import uuid
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, StrictInt, TypeAdapter, model_validator

from shared.request_lifecycle import RequestStatus

FinishReason = Literal["length", "eos_token", "stop_sequence"]

# What a request that names none gets (``shared.settings`` makes both configurable per deployment).
DEFAULT_PRIORITY = 1  # 0 is the most urgent
DEFAULT_MAX_NEW_TOKENS = 256
# Seeds are 63-bit: a non-negative int64, as the engine's generators take them.
SEED_LIMIT = 2**63
Seed = Annotated[int, Field(ge=0, le=SEED_LIMIT - 1)]


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)


def new_request_id() -> str:
    return uuid.uuid4().hex


ConstraintType = Literal["json_schema", "json_object", "regex", "lark"]
# Compact JSON, as the engine compiles it (worker/engine/sampling/structured.py); the two must agree so
# that what the API accepted is what the worker runs.
_JSON_OPTIONS = {"whitespace_flexible": False}


class Constraint(WireModel):
    """What the generated text must match: a JSON schema, any JSON object, a regular expression
    (the whole output matches) or a Lark grammar in llguidance's dialect. Checked with llguidance
    wherever it is parsed: the API answers 422 naming the problem, a worker fails that request."""

    type: ConstraintType
    value: dict[str, Any] | str | None = Field(
        None, description="json_schema: the schema; regex: the pattern; lark: the grammar; json_object: none."
    )

    @model_validator(mode="after")
    def _compiles(self) -> Constraint:
        error = _constraint_error(self.type, json.dumps(self.value, sort_keys=True))
        if error:
            raise ValueError(error)
        return self


@lru_cache(maxsize=1024)
def _constraint_error(kind: str, value_json: str) -> str:
    """'' when llguidance compiles the constraint, else why not (cached: every request parses it twice)."""
    import llguidance  # no torch; only processes that meet a constraint load it

    value = json.loads(value_json)
    matcher = llguidance.LLMatcher
    if kind == "json_object":
        grammar = matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    elif kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return "a json_schema constraint's value must be a JSON schema object"
        if not isinstance(value, dict):
            return "a json_schema constraint's value must be a JSON schema object"
        grammar = matcher.grammar_from_json_schema(value, defaults=_JSON_OPTIONS)
    elif not isinstance(value, str) or not value:
        return f"a {kind} constraint's value must be a non-empty string"
    else:
        grammar = matcher.grammar_from_regex(value) if kind == "regex" else matcher.grammar_from_lark(value)
    error = matcher.validate_grammar(grammar)
    return f"invalid {kind.replace('_', ' ')}: {error.strip()}" if error else ""


class SamplingFields(WireModel):
    """How a token is chosen: shared by the wire's SamplingSpec and the API bodies that take
    these fields flat (``/v1/jobs``), so their names and ranges are defined once."""

    max_new_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 means greedy.")
    top_k: StrictInt = Field(0, ge=0, description="0 disables.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    typical_p: float = Field(1.0, gt=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: Seed | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[NonNegativeInt] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=20, description="Top logprobs per token; None = none.")
    constraint: Constraint | None = Field(None, description="Structured output: what the text must match.")
    watermark: bool = Field(False, description="TGI's green-list watermark (Kirchenbauer et al.; gamma 0.5, delta 2).")
    speculate: bool | None = Field(
        None, description="n-gram speculative decoding for this request; None = the worker's speculate_by_default."
    )


class SamplingSpec(SamplingFields):
    """The sampling part of a queued request, as it crosses Redis."""

    @model_validator(mode="after")
    def _stop_strings_not_empty(self) -> SamplingSpec:
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        return self


class QueuedRequest(WireModel):
    """What the API (or any client) XADDs into a model's priority stream."""

    id: str = Field(default_factory=new_request_id, min_length=1, max_length=128)
    model: str
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    priority: int = Field(DEFAULT_PRIORITY, ge=0)
    deadline: float | None = Field(None, description="Unix time after which the request is dropped.")
    tenant: str | None = Field(None, description="Keeps prefix caches of tenants apart; the fair share's unit.")
    tenant_weight: float = Field(1.0, gt=0, description="The tenant's fair-share weight: its share of the level.")
    adapter: str | None = Field(
        None, min_length=1, max_length=128, description="The LoRA adapter it runs with, by its registered name."
    )
    attempt: int = Field(0, ge=0, description="Raised by a worker that takes the request over.")
    submitted_at: float = Field(default_factory=time.time)

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (now or time.time()) >= self.deadline


class TopLogprob(WireModel):
    token_id: int
    text: str
    logprob: float


class Usage(WireModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(WireModel):
    """Unix times; durations are derived so every reader computes them the same way."""

    submitted_at: float
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def queue_time_s(self) -> float:
        return max(0.0, (self.started_at or self.submitted_at) - self.submitted_at)

    @property
    def inference_time_s(self) -> float:
        if self.started_at is None or self.finished_at is None:
            return 0.0
        return max(0.0, self.finished_at - self.started_at)


class TokenEvent(WireModel):
    type: Literal["token"] = "token"
    request_id: str
    index: int = Field(ge=0, description="Position among generated tokens; the dedup key.")
    token_id: int
    text: str = Field("", description="Text delta this token adds (held back while a stop may match).")
    special: bool = False
    logprob: float | None = None
    top_logprobs: list[TopLogprob] | None = None
    finish_reason: FinishReason | None = None
    attempt: int = 0


class FinalResult(WireModel):
    request_id: str
    model: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    worker: str | None = None


class DoneEvent(WireModel):
    """Terminal event of a successful request; follows the token event that carries finish_reason."""

    type: Literal["done"] = "done"
    request_id: str
    result: FinalResult


class ErrorEvent(WireModel):
    """Terminal event of a request that failed, was cancelled or expired."""

    type: Literal["error"] = "error"
    request_id: str
    error_type: str
    message: str
    index: int | None = Field(None, description="Tokens generated before the error.")


AnyEvent = TokenEvent | DoneEvent | ErrorEvent
Event = Annotated[AnyEvent, Field(discriminator="type")]
_event_adapter: TypeAdapter[AnyEvent] = TypeAdapter(Event)


def parse_event(raw: str | bytes) -> AnyEvent:
    return _event_adapter.validate_json(raw)


def is_terminal(event: AnyEvent) -> bool:
    return not isinstance(event, TokenEvent)


class WorkerHeartbeat(WireModel):
    name: str
    model: str
    device: str
    dtype: str
    threads: int = 0  # the worker's intra-op CPU threads (0: not reported)
    max_num_seqs: int
    num_kv_blocks: int
    running: int
    waiting: int
    free_kv_blocks: int
    engine_steps: int = 0  # since the worker started: lets tests and operators count in steps, not seconds
    preemptions: int = 0
    started_at: float
    updated_at: float = Field(default_factory=time.time)
    draining: bool = False


class RequestInfo(BaseModel):
    """A request's record as ``client.status`` reads it from the request hash."""

    id: str
    status: RequestStatus
    model: str
    priority: int = 0
    submitted_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None
    attempt: int = 0
    deliveries: int = 0
    tenant: str | None = None  # with API keys: the key that owns it
    result: FinalResult | None = None
    error: ErrorEvent | None = None

    @classmethod
    def from_hash(cls, fields: dict[str, str]) -> RequestInfo:
        def number(name: str) -> float | None:
            value = fields.get(name)
            return float(value) if value not in (None, "") else None

        return cls(
            id=fields.get("id", ""),
            status=RequestStatus(fields.get("status", RequestStatus.QUEUED)),
            model=fields.get("model", ""),
            priority=int(fields.get("priority") or 0),
            submitted_at=number("submitted_at"),
            started_at=number("started_at"),
            finished_at=number("finished_at"),
            worker=fields.get("worker") or None,
            attempt=int(fields.get("attempt") or 0),
            deliveries=int(fields.get("deliveries") or 0),
            tenant=fields.get("tenant") or None,
            result=FinalResult.model_validate_json(fields["result"]) if fields.get("result") else None,
            error=ErrorEvent.model_validate_json(fields["error"]) if fields.get("error") else None,
        )


# A dead letter keeps at most this much of the entry it stands for (a 20 MB garbage entry must
# not become a 20 MB dead letter); what is cut is replaced by a marker naming the full size.
DEAD_LETTER_RAW_MAX = 64 * 1024
DEAD_LETTER_REASON_MAX = 1024


def bounded(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"...[truncated: {len(text)} characters in all]"


class DeadLetter(WireModel):
    """What the dead-letter stream of a model holds: the raw entry (bounded) and why it was dropped."""

    reason: str
    stream: str
    entry_id: str
    request_id: str | None = None
    worker: str | None = None
    raw: str = Field(
        "",
        description="The stream entry's fields, as ASCII JSON (bytes that are not UTF-8 appear "
        "as \\udcXX escapes), cut at DEAD_LETTER_RAW_MAX characters.",
    )
    at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _bounded(self) -> DeadLetter:
        self.raw = bounded(self.raw, DEAD_LETTER_RAW_MAX)
        self.reason = bounded(self.reason, DEAD_LETTER_REASON_MAX)
        return self
