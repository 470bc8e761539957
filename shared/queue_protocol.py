"""What the sync and the asyncio client share: building a request, the fields of its hash,
and putting a stream of events back in order.

Kept free of I/O so both clients (and tests) use the same rules."""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from shared.errors import NotFoundError, ValidationError, error_from_type
from shared.keys import CONSUMER_GROUP
from shared.lifecycle import RequestStatus
from shared.schemas import (
    AnyEvent,
    DoneEvent,
    ErrorEvent,
    QueuedRequest,
    RequestInfo,
    SamplingSpec,
    TokenEvent,
    WorkerHeartbeat,
    parse_event,
)
from shared.settings import Settings
from shared.transitions import LOG_FIELD

# Index past any real token: following from here yields only the terminal event.
TERMINAL_ONLY = sys.maxsize
# Wake-up tokens kept in a model's notify list; one per idle worker is all that matters.
NOTIFY_KEEP = 64


def redis_kwargs(settings: Settings) -> dict[str, Any]:
    """Connection options both clients use: text replies, retries with backoff across a restart,
    and a pool as large as the settings allow (redis-py's default of 100 would turn the 101st
    followed stream into a spurious "Redis unreachable")."""
    return {
        "max_connections": settings.redis_max_connections,
        "decode_responses": True,
        "retry": Retry(ExponentialBackoff(cap=2.0, base=0.05), 8),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        "health_check_interval": 30,
    }


def cancelled_event(request_id: str) -> ErrorEvent:
    return ErrorEvent(request_id=request_id, error_type="cancelled", message="cancelled by client")


def raise_for(event: ErrorEvent) -> None:
    raise error_from_type(event.error_type, event.message)


# How long a follower waits on pub/sub before it re-reads the replay log and the hash: the
# safety net for a lost pub/sub message or a dropped connection, not the normal path. The wait
# doubles while the stream stays silent (a request waiting its turn in the queue), up to
# IDLE_CHECK_MAX_S: at 1 s flat, 1,000 queued streams cost the API 2,000 Redis round trips a
# second and took CPU from the worker beside it.
IDLE_CHECK_S = 1.0
IDLE_CHECK_MAX_S = 8.0
# While the last check found the request still queued, the wait grows further: nothing has been
# published for it yet, so nothing can have been lost (its first token, when it comes, resets the
# wait). At 8 s, 1,000 queued streams still cost 125 checks a second, in the API and in any
# service following them, on the CPU the worker beside them needs.
QUEUED_CHECK_MAX_S = 30.0


def build_request(
    settings: Settings,
    model: str,
    prompt_token_ids: list[int],
    sampling: SamplingSpec | None,
    *,
    priority: int | None,
    deadline: float | None,
    tenant: str | None,
    request_id: str | None,
) -> QueuedRequest:
    sampling = sampling or SamplingSpec(max_new_tokens=settings.default_max_new_tokens)
    if sampling.seed is None and sampling.temperature > 0:
        # A fixed seed makes a taken-over request reproduce the tokens it would have produced.
        sampling = sampling.model_copy(update={"seed": random.getrandbits(63)})
    fields: dict[str, object] = {
        "model": model,
        "prompt_token_ids": prompt_token_ids,
        "sampling": sampling,
        "priority": settings.default_priority if priority is None else priority,
        "deadline": deadline,
        "tenant": tenant,
    }
    if request_id is not None:
        fields["id"] = request_id
    request = QueuedRequest(**fields)  # type: ignore[arg-type]
    return normalize(settings, request)


def normalize(settings: Settings, request: QueuedRequest) -> QueuedRequest:
    if request.priority >= settings.priority_levels:
        raise ValidationError(
            f"priority must be between 0 and {settings.priority_levels - 1}, got {request.priority}", field="priority"
        )
    return request


def hash_fields(request: QueuedRequest) -> dict[str, str]:
    return {
        "id": request.id,
        "status": RequestStatus.QUEUED.value,
        "model": request.model,
        "priority": str(request.priority),
        "submitted_at": repr(request.submitted_at),
        "attempt": str(request.attempt),
        "deliveries": "0",
    }


def log_maxlen(settings: Settings) -> int:
    """Replay logs keep every event of the longest allowed generation (resume needs them all)."""
    return settings.max_new_tokens + 16


def terminal_from_info(info: RequestInfo) -> AnyEvent | None:
    """The terminal event a final request's hash implies (used when its log has expired)."""
    if info.result is not None:
        return DoneEvent(request_id=info.id, result=info.result)
    if info.error is not None:
        return info.error
    if info.status.is_final:
        return ErrorEvent(request_id=info.id, error_type="generation", message=f"request {info.status.value}")
    return None


def parse_log_entry(fields: dict[str, str]) -> AnyEvent | None:
    raw = fields.get(LOG_FIELD)
    if raw is None:
        return None
    try:
        return parse_event(raw)
    except ValueError:
        return None


# Replay-log entries read per round trip when catching up.
CATCH_UP_COUNT = 512


def accept_log_entries(sequencer: EventSequencer, entries: list[tuple[str, dict[str, str]]]) -> list[AnyEvent]:
    """Feeds one XRANGE reply of a replay log to ``sequencer``; what it yields, in order."""
    out: list[AnyEvent] = []
    for entry_id, fields in entries:
        sequencer.last_log_id = entry_id
        event = parse_log_entry(fields)
        if event is not None:
            out += sequencer.accept(event, from_log=True)
    return out


def status_found(request_id: str, status: str | None) -> RequestStatus:
    """A request's status as an idle check read it; a request that is gone is an error."""
    if status is None:
        raise NotFoundError(f"request {request_id} vanished (expired, or Redis lost it)")
    return RequestStatus(status)


@dataclass
class EventSequencer:
    """Puts events from the replay log and from pub/sub into one ordered, duplicate-free stream.

    Token events are keyed by index: anything below the next expected index was already
    delivered (a taken-over request may republish, pub/sub and the log overlap). A live event
    ahead of the next index means the follower missed something; ``gap`` tells the caller to
    read the log first."""

    next_index: int = 0
    last_log_id: str = "0-0"
    finished: bool = False
    gap: bool = False

    def accept(self, event: AnyEvent, *, from_log: bool) -> list[AnyEvent]:
        if self.finished:
            return []
        if isinstance(event, TokenEvent):
            if event.index < self.next_index:
                return []
            if event.index > self.next_index and not from_log:
                self.gap = True
                return []
            # A hole inside the log itself (trimmed log) cannot be filled: move on past it.
            self.next_index = event.index + 1
            return [event]
        if not from_log and self.next_index < tokens_before(event):
            self.gap = True  # the end, seen live before some of its tokens: read them first
            return []
        self.finished = True
        return [event]


def tokens_before(event: DoneEvent | ErrorEvent) -> int:
    if isinstance(event, DoneEvent):
        return len(event.result.token_ids)
    return event.index or 0


def deadline_from(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: float | None, wait: float = IDLE_CHECK_S) -> float:
    """``wait``, or less if the deadline comes first; TimeoutError once it has passed."""
    if deadline is None:
        return wait
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out waiting for the request's events")
    return min(wait, left)


class IdleBackoff:
    """A follower's wait on pub/sub between safety-net checks: IDLE_CHECK_S after anything was
    heard, doubling with each silent check up to IDLE_CHECK_MAX_S, or QUEUED_CHECK_MAX_S while
    the request has not started."""

    def __init__(self) -> None:
        self.wait = IDLE_CHECK_S

    def timeout(self, deadline: float | None) -> float:
        return remaining(deadline, self.wait)

    def heard(self) -> None:
        self.wait = IDLE_CHECK_S

    def silent(self, *, queued: bool = False) -> None:
        self.wait = min(self.wait * 2, QUEUED_CHECK_MAX_S if queued else IDLE_CHECK_MAX_S)


def depth_of(length: object, pending: object) -> int:
    if isinstance(length, Exception):
        return 0
    taken = 0 if isinstance(pending, Exception) or not pending else int(pending["pending"])  # type: ignore[index]
    return max(0, int(length) - taken)  # type: ignore[call-overload]


def first_undelivered(groups: list[dict[str, Any]]) -> str:
    for group in groups:
        if group.get("name") == CONSUMER_GROUP:
            return "(" + str(group["last-delivered-id"])
    return "-"


def filter_heartbeats(raw: list[str | None], model: str | None) -> list[WorkerHeartbeat]:
    beats = []
    for doc in raw:
        if not doc:
            continue
        try:
            beat = WorkerHeartbeat.model_validate_json(doc)
        except ValueError:
            continue
        if model is None or beat.model == model:
            beats.append(beat)
    return beats
