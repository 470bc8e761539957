"""How a worker accepts a stream entry it was handed (a fresh read or a takeover).

Either it becomes an ``ActiveRequest`` for the engine, or it ends here: malformed (dead
letter), past its deadline (expired), cancelled while queued, already final (just XACK), or
delivered too often (dead letter). A taken-over or handed-back request is resumed from its
replay log: the tokens already sent become context and generation continues at the next index.

A stream is open to anyone who can XADD, so an entry is judged before anything trusts it: bytes
that are not UTF-8 (the worker's connection decodes with ``surrogateescape``, so they show up as
lone surrogates instead of an exception that would stop the intake), fields other than the one
JSON document, an oversized entry, JSON that is not a ``QueuedRequest``, another model, a priority
out of range, or a request id whose hash belongs to another entry (a duplicate). Each goes to the
dead letters (bounded in size) with one log line; the request hash is only finished when it is
this entry's own, so a hostile or duplicate entry never touches someone else's request."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import redis
from pydantic import ValidationError

from shared.event_delivery import parse_log_entry
from shared.keys import Keys
from shared.request_lifecycle import START
from shared.schemas import DeadLetter, FinalResult, QueuedRequest, TokenEvent
from shared.settings import Settings
from shared.valid_text import is_valid_text
from shared.work_queue import ENTRY_FIELDS, STREAM_FIELD
from worker.active import ActiveRequest
from worker.publisher import Publisher
from worker.reconnect import TRANSIENT

log = logging.getLogger("inflightq.worker")

# The hash field naming the stream entry a request hash belongs to (written by START).
ENTRY_ID = "entry_id"


class Rejected(Exception):
    """An entry that cannot be run, and why (the dead letter's reason)."""


def raw_json(fields: dict[str, str]) -> str:
    """The entry's fields as ASCII JSON: undecodable bytes survive as \\udcXX escapes."""
    return json.dumps(fields, ensure_ascii=True)


class Acceptance:
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
        # A request the API accepts is far smaller than its body limit once tokenized.
        self.max_entry_chars = max(2 * settings.max_body_bytes, 1 << 20)

    @staticmethod
    def prompt_length(fields: dict[str, str] | None) -> int:
        """Prompt size of an entry not yet read, for the capacity claim; 0 for anything unparsable."""
        try:
            return len(json.loads((fields or {}).get(STREAM_FIELD, ""))["prompt_token_ids"])
        except Exception:  # anything hostile (deep nesting, surrogates, wrong types) is judged by accept
            return 0

    def accept(self, stream: str, entry_id: str, fields: dict[str, str] | None, share: float = 0.0) -> bool:
        """True when the entry went to the engine. Never raises for what the entry holds: an
        entry that cannot be judged would stay pending and come back forever. ``share``: its
        tenant's virtual time when it was pulled (the fair part of its urgency)."""
        if not fields:  # deleted while pending (Redis 6.2 still lists it): nothing to run
            self.publisher.ack(stream, entry_id)
            return False
        try:
            request = self.parse(stream, fields)
        except Rejected as rejection:
            self._malformed(stream, entry_id, fields, str(rejection))
            return False
        try:
            return self._accept(request, stream, entry_id, fields, share)
        except TRANSIENT:
            raise  # Redis is away: the entry stays pending and comes back
        except Exception as error:
            log.exception("entry %s of %s could not be accepted", entry_id, stream)
            self._malformed(stream, entry_id, fields, f"could not be accepted: {error!r}")
            return False

    def parse(self, stream: str, fields: dict[str, str]) -> QueuedRequest:
        """The entry's request, or ``Rejected`` saying why it is none."""
        if any(not (is_valid_text(k) and is_valid_text(v)) for k, v in fields.items()):
            raise Rejected("undecodable entry: a field is not UTF-8")
        if STREAM_FIELD not in fields or not set(fields) <= ENTRY_FIELDS:
            raise Rejected(
                f"malformed entry: fields {sorted(fields)[:8]}, expected {STREAM_FIELD!r} and at most "
                f"{sorted(ENTRY_FIELDS - {STREAM_FIELD})}"
            )
        size = len(fields[STREAM_FIELD])
        if size > self.max_entry_chars:
            raise Rejected(f"oversized entry: {size} characters (at most {self.max_entry_chars})")
        try:
            request = QueuedRequest.model_validate_json(fields[STREAM_FIELD])
        except (ValidationError, ValueError, RecursionError) as error:
            raise Rejected(f"malformed entry: {str(error).splitlines()[0]} ({_first_problem(error)})") from None
        if request.model != self.model:
            raise Rejected(f"wrong model: the entry names {request.model[:128]!r}, this stream serves {self.model!r}")
        if request.priority >= self.settings.priority_levels:
            raise Rejected(f"priority {request.priority} out of range (0..{self.settings.priority_levels - 1})")
        return request

    def _accept(
        self, request: QueuedRequest, stream: str, entry_id: str, fields: dict[str, str], share: float = 0.0
    ) -> bool:
        if request.expired():
            self.counters["expired"] += 1
            if self._owns(request.id, entry_id, repr(request.submitted_at)):
                self.publisher.finish_error(
                    request.id, stream, entry_id, "expired", "expired", "deadline passed while queued", None
                )
            else:
                self.publisher.ack(stream, entry_id)
            return False
        verdict, deliveries, attempt, started_at = self._start_script(request, entry_id)
        if verdict == "run":
            active = ActiveRequest(request, stream, entry_id, attempt=attempt, started_at=started_at, share=share)
            # A takeover (attempt > 0: also a drain's hand-back, which gives its delivery back) or a
            # redelivery continues from what was already sent, never from token 0.
            if deliveries > 1 or attempt > 0:
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
        elif verdict == "duplicate":
            self._malformed(stream, entry_id, fields, f"duplicate request id {request.id}: another entry owns it")
        else:  # already final (finished by an earlier owner, or cancelled while queued): just drop the entry
            self.publisher.ack(stream, entry_id, self._used(request))
        return False

    def dead_letter(
        self, request: QueuedRequest, stream: str, entry_id: str, reason: str, fields: dict[str, str] | None = None
    ) -> None:
        log.warning("dead-lettering %s: %s", request.id, reason)
        self.counters["dead_lettered"] += 1
        raw = raw_json(fields) if fields is not None else request.to_json()
        letter = DeadLetter(
            reason=reason, stream=stream, entry_id=entry_id, request_id=request.id, worker=self.worker_name, raw=raw
        )
        self.publisher.dead_letter(request.model, letter)
        # It ran (deliveries times) without finishing: charged all its pull charged.
        self.publisher.finish_error(request.id, stream, entry_id, "failed", "generation", reason, None, used=None)

    def _malformed(self, stream: str, entry_id: str, fields: dict[str, str], reason: str) -> None:
        request_id, submitted_at = _salvage(fields)
        log.warning("dead-lettering entry %s of %s: %s", entry_id, stream, reason[:300])
        self.counters["dead_lettered"] += 1
        letter = DeadLetter(
            reason=reason,
            stream=stream,
            entry_id=entry_id,
            request_id=request_id,
            worker=self.worker_name,
            raw=raw_json(fields),
        )
        self.publisher.dead_letter(self.model, letter)
        # Someone may be waiting on it: tell them (only if the hash is this entry's).
        if request_id is not None and self._owns(request_id, entry_id, submitted_at):
            self.publisher.finish_error(request_id, stream, entry_id, "failed", "generation", reason, None)
        else:
            self.publisher.ack(stream, entry_id)

    def _owns(self, request_id: str, entry_id: str, submitted_at: str | None) -> bool:
        """Whether this entry may write the request's hash, by START's rule: there is no hash (Redis
        lost it; whoever follows the id then learns its fate), the hash names this entry, or it
        names none yet (no START ran: CREATE cannot know the entry) and has this entry's
        ``submitted_at`` (``repr`` of the entry's float; None when the entry has none)."""
        owner, created = self.redis.hmget(self.keys.request(request_id), [ENTRY_ID, "submitted_at"])
        if owner:
            return bool(owner == entry_id)
        return created is None or created == submitted_at

    def _used(self, request: QueuedRequest) -> int:
        """Tokens a request that is already final used, as its hash's result says (an earlier owner
        finished it and died before settling); 0 for one that never ran."""
        raw = self.redis.hget(self.keys.request(request.id), "result")
        try:
            return FinalResult.model_validate_json(raw).usage.total_tokens if raw else 0
        except ValueError:
            return 0

    def _start_script(self, request: QueuedRequest, entry_id: str) -> tuple[str, int, int, float]:
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
                entry_id,
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


def _salvage(fields: dict[str, str]) -> tuple[str | None, str | None]:
    """The request id a rejected entry names, if it names a plausible one (its waiter is told), and
    its submitted_at as the request hash holds it (``repr`` of the float), if it has one."""
    raw = fields.get(STREAM_FIELD, "")
    if len(raw) > 1_000_000 or not is_valid_text(raw):
        return None, None
    try:
        doc = json.loads(raw)
        value = doc["id"]
    except Exception:
        return None, None
    plausible = isinstance(value, str) and 0 < len(value) <= 128 and value.isprintable() and is_valid_text(value)
    if not plausible:
        return None, None
    submitted = doc.get("submitted_at") if isinstance(doc, dict) else None
    try:
        return value, repr(float(submitted)) if isinstance(submitted, int | float) and submitted is not True else None
    except OverflowError:
        return value, None


def _first_problem(error: Exception) -> str:
    if isinstance(error, ValidationError) and error.errors():
        first = error.errors()[0]
        return f"{'.'.join(map(str, first.get('loc', ()))) or 'entry'}: {first.get('msg', '')}"[:200]
    return type(error).__name__
