"""What a worker does with a stream entry it was handed (a fresh read or a takeover).

Either it becomes an ``ActiveRequest`` for the engine, or it ends here: malformed (dead
letter), past its deadline (expired), cancelled while queued, already final (just XACK), or
delivered too often (dead letter). A taken-over request is resumed from its replay log: the
tokens already sent become context and generation continues at the next index."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import redis
from pydantic import ValidationError

from shared.keys import Keys
from shared.queue_protocol import parse_log_entry
from shared.schemas import DeadLetter, QueuedRequest, TokenEvent
from shared.settings import Settings
from shared.transitions import START, STREAM_FIELD
from worker.active import ActiveRequest
from worker.publisher import Publisher

log = logging.getLogger("inflightq.worker")


class Admission:
    def __init__(
        self,
        settings: Settings,
        connection: redis.Redis,
        publisher: Publisher,
        worker_name: str,
        model: str,
        hand_over: Callable[[ActiveRequest], None],
        counters: dict[str, int],
    ) -> None:
        self.settings = settings
        self.keys = Keys.for_prefix(settings.key_prefix)
        self.redis = connection
        self.publisher = publisher
        self.worker_name = worker_name
        self.model = model
        self.hand_over = hand_over
        self.counters = counters
        self._start = connection.register_script(START)

    @staticmethod
    def prompt_length(fields: dict[str, str] | None) -> int:
        """Prompt size of an entry not yet read, for admission; 0 for anything unparsable."""
        try:
            return len(json.loads((fields or {}).get(STREAM_FIELD, ""))["prompt_token_ids"])
        except (ValueError, KeyError, TypeError):
            return 0

    def admit(self, stream: str, entry_id: str, fields: dict[str, str] | None) -> bool:
        """True when the entry went to the engine."""
        if not fields:  # deleted while pending (Redis 6.2 still lists it): nothing to run
            self.publisher.ack(stream, entry_id)
            return False
        try:
            request = QueuedRequest.model_validate_json(fields.get(STREAM_FIELD, ""))
        except (ValidationError, ValueError) as error:
            self._malformed(stream, entry_id, fields, error)
            return False
        if request.expired():
            self.counters["expired"] += 1
            self.publisher.finish_error(
                request.id, stream, entry_id, "expired", "expired", "deadline passed while queued", None
            )
            return False
        verdict, deliveries, attempt, started_at = self._start_script(request)
        if verdict == "run":
            active = ActiveRequest(request, stream, entry_id, attempt=attempt, started_at=started_at)
            if deliveries > 1:
                self._resume(active)
                if attempt > 0:
                    self.counters["taken_over"] += 1
            self.hand_over(active)
            return True
        if verdict == "cancel":
            self.counters["cancelled"] += 1
            self.publisher.finish_error(request.id, stream, entry_id, "cancelled", "cancelled", "cancelled", None)
        elif verdict == "poison":
            reason = f"delivered {deliveries - 1} times without finishing (max {self.settings.max_deliveries})"
            self.dead_letter(request, stream, entry_id, reason, fields)
        else:  # already final (finished by an earlier owner, or cancelled while queued): just drop the entry
            self.publisher.ack(stream, entry_id)
        return False

    def dead_letter(
        self, request: QueuedRequest, stream: str, entry_id: str, reason: str, fields: dict[str, str] | None = None
    ) -> None:
        log.warning("dead-lettering %s: %s", request.id, reason)
        self.counters["dead_lettered"] += 1
        raw = json.dumps(fields) if fields is not None else request.to_json()
        letter = DeadLetter(
            reason=reason, stream=stream, entry_id=entry_id, request_id=request.id, worker=self.worker_name, raw=raw
        )
        self.publisher.dead_letter(request.model, letter)
        self.publisher.finish_error(request.id, stream, entry_id, "failed", "generation", reason, None)

    def _malformed(self, stream: str, entry_id: str, fields: dict[str, str], error: Exception) -> None:
        reason = f"malformed entry: {_describe(error)}"
        log.warning("dead-lettering entry %s of %s: %s", entry_id, stream, reason)
        self.counters["dead_lettered"] += 1
        request_id = _salvage_id(fields)
        letter = DeadLetter(
            reason=reason,
            stream=stream,
            entry_id=entry_id,
            request_id=request_id,
            worker=self.worker_name,
            raw=json.dumps(fields),
        )
        self.publisher.dead_letter(self.model, letter)
        if request_id is not None:  # someone may be waiting on it: tell them
            self.publisher.finish_error(request_id, stream, entry_id, "failed", "generation", reason, None)
        else:
            self.publisher.ack(stream, entry_id)

    def _start_script(self, request: QueuedRequest) -> tuple[str, int, int, float]:
        now = time.time()
        verdict, deliveries, attempt = self._start(
            keys=[self.keys.request(request.id)],
            args=[
                self.worker_name,
                repr(now),
                self.settings.max_deliveries,
                self.settings.result_ttl_s,
                request.id,
                request.model,
                request.priority,
                repr(request.submitted_at),
            ],
        )
        started = self.redis.hget(self.keys.request(request.id), "started_at")
        return str(verdict), int(deliveries), int(attempt), float(started) if started else now

    def _resume(self, active: ActiveRequest) -> None:
        """Takes over what earlier attempts already sent: the log's tokens, contiguous from 0."""
        last = "-"
        while True:
            entries = self.redis.xrange(self.keys.replay_log(active.id), min=last, max="+", count=512)
            if last != "-":
                entries = entries[1:]
            if not entries:
                return
            for entry_id, fields in entries:
                last = entry_id
                event = parse_log_entry(fields)
                if isinstance(event, TokenEvent) and event.index == len(active.prior_token_ids):
                    active.prior_token_ids.append(event.token_id)
                    active.prior_text += event.text
                    active.prior_finish = event.finish_reason


def _describe(error: Exception) -> str:
    """One line naming what is wrong (pydantic's first line only counts the errors)."""
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where}: {first['msg']}".splitlines()[0]
    return str(error).splitlines()[0]


def _salvage_id(fields: dict[str, str]) -> str | None:
    try:
        value = json.loads(fields.get(STREAM_FIELD, ""))["id"]
    except (ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) and 0 < len(value) <= 128 else None
