"""Everything a worker writes about requests goes through here, on its own thread.

The engine loop hands over a step's events and moves on; this thread turns whatever has piled
up (usually one step, more when Redis is slow) into ONE pipelined round trip: per token an
XADD to the request's replay log then a PUBLISH on its channel (log first, so a subscriber
that reads the log after subscribing can miss nothing), and the final-status scripts. A
failed round trip (Redis restarting) is rebuilt and sent again: clients drop repeated
indexes, so at-least-once is enough."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import redis

from shared.keys import CONSUMER_GROUP, Keys
from shared.queue_protocol import log_maxlen
from shared.schemas import DeadLetter, DoneEvent, ErrorEvent, FinalResult
from shared.settings import Settings
from shared.transitions import FINISH, LOG_FIELD
from worker.reconnect import TRANSIENT, Backoff

log = logging.getLogger("inflightq.worker")

# A pending write: adds its commands to the pipeline of the next round trip.
Write = Callable[[Any], None]

# The engine's finish reasons that end a request with an error instead of a result.
ERROR_FINISHES = {"expired": ("expired", "deadline passed during generation")}


def token_json(request_id: str, index: int, token_id: int, text: str, event: Any, attempt: int) -> str:
    """A TokenEvent as JSON, written by hand: this runs for every token and pydantic's
    validation costs more than the rest of the publisher (the shape is pinned by a test)."""
    doc: dict[str, Any] = {"type": "token", "request_id": request_id, "index": index, "token_id": token_id}
    doc["text"] = text
    if event.special:
        doc["special"] = True
    if event.logprob is not None:
        doc["logprob"] = event.logprob
    if event.top_logprobs is not None:
        doc["top_logprobs"] = [{"token_id": t, "text": s, "logprob": lp} for t, s, lp in event.top_logprobs]
    if event.finish_reason is not None and event.finish_reason not in ERROR_FINISHES:
        doc["finish_reason"] = event.finish_reason
    if attempt:
        doc["attempt"] = attempt
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


class Publisher(threading.Thread):
    def __init__(self, settings: Settings, connection: redis.Redis, worker_name: str) -> None:
        super().__init__(name="publisher", daemon=True)
        self.settings = settings
        self.keys = Keys.for_prefix(settings.key_prefix)
        self.redis = connection
        self.worker_name = worker_name
        self.maxlen = log_maxlen(settings)
        self._finish = connection.register_script(FINISH)
        self._writes: deque[Write] = deque()
        self._cond = threading.Condition()
        self._submitted = 0
        self._sent = 0
        self._stopped = threading.Event()
        self.round_trips = 0
        self.events_sent = 0

    # Called from other threads ----------------------------------------------------
    def publish_tokens(self, events: Iterable[tuple[Any, int]]) -> None:
        """``(engine_event, attempt)`` pairs of one step; events without a token are skipped."""
        batch = [(e, a) for e, a in events if e.token_id >= 0]
        if batch:
            self._put(lambda pipe: self._tokens(pipe, batch))

    def finish_done(self, stream: str, entry_id: str, result: FinalResult) -> None:
        event = DoneEvent(request_id=result.request_id, result=result)
        self._put(self._final(result.request_id, stream, entry_id, "done", event.to_json(), "result", result.to_json()))

    def finish_error(
        self, request_id: str, stream: str, entry_id: str, status: str, error_type: str, message: str, index: int | None
    ) -> None:
        event = ErrorEvent(request_id=request_id, error_type=error_type, message=message, index=index).to_json()
        self._put(self._final(request_id, stream, entry_id, status, event, "error", event))

    def dead_letter(self, model: str, letter: DeadLetter) -> None:
        key = self.keys.dead_letters(model)
        self._put(lambda pipe: pipe.xadd(key, {"letter": letter.to_json()}, maxlen=10_000, approximate=True))

    def ack(self, stream: str, entry_id: str) -> None:
        def write(pipe: Any) -> None:
            pipe.xack(stream, CONSUMER_GROUP, entry_id)
            pipe.xdel(stream, entry_id)

        self._put(write)

    def flush(self, timeout: float = 10.0) -> bool:
        """Waits until everything handed over so far has reached Redis."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._submitted
            while self._sent < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        self._stopped.set()
        with self._cond:
            self._cond.notify_all()
        self.join(timeout=2)

    # The thread ---------------------------------------------------------------------
    def run(self) -> None:
        backoff = Backoff(self._stopped)
        while True:
            with self._cond:
                while not self._writes and not self._stopped.is_set():
                    self._cond.wait()
                if not self._writes:
                    return
                writes = list(self._writes)
                self._writes.clear()
            while True:
                try:
                    self._send(writes)
                    backoff.succeeded()
                    break
                except TRANSIENT as error:
                    if self._stopped.is_set():
                        return
                    backoff.failed("publish", error)
            with self._cond:
                self._sent += len(writes)
                self._cond.notify_all()

    def _send(self, writes: list[Write]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for write in writes:
            write(pipe)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, redis.ResponseError):
                # A rejected command (not a lost connection) is a bug to see, not to retry forever.
                log.error("redis rejected a write: %s", reply)
        self.round_trips += 1

    def _put(self, write: Write) -> None:
        with self._cond:
            self._writes.append(write)
            self._submitted += 1
            self._cond.notify()

    def _tokens(self, pipe: Any, batch: list[tuple[Any, int]]) -> None:
        ttl = self.settings.result_ttl_s
        logs: set[str] = set()
        for event, attempt in batch:
            rid = event.request_id
            doc = token_json(rid, event.index, event.token_id, event.text, event, attempt)
            log_key = self.keys.replay_log(rid)
            pipe.xadd(log_key, {LOG_FIELD: doc}, maxlen=self.maxlen, approximate=True)
            pipe.publish(self.keys.tokens_channel(rid), doc)
            logs.add(log_key)
        for log_key in logs:
            pipe.expire(log_key, ttl)
        self.events_sent += len(batch)

    def _final(
        self, request_id: str, stream: str, entry_id: str, status: str, event: str, field: str, payload: str
    ) -> Write:
        keys = [
            self.keys.request(request_id),
            self.keys.replay_log(request_id),
            self.keys.tokens_channel(request_id),
            stream,
        ]
        args = [status, event, field, payload, repr(time.time()), self.settings.result_ttl_s]
        args += [CONSUMER_GROUP, entry_id, self.maxlen]
        return lambda pipe: self._finish(keys=keys, args=args, client=pipe)
