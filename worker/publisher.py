"""Everything a worker writes about requests goes through here, on its own thread.

The engine loop hands over a step's events and moves on; this thread turns whatever has piled
up (usually one step, more when Redis is slow) into ONE pipelined round trip per Redis node:
per token an XADD to the request's replay log then a PUBLISH on its channel (log first, so a
subscriber that reads the log after subscribing can miss nothing), one script call
(``PUBLISH_TOKENS``) per slot of the requests' shards (on a single Redis, one call for all),
followed by the final-status scripts. On a Cluster, redis-py's pipeline sends each node its
share of the calls and reads the replies of all, so a step costs one round trip per node, in
parallel.

A finished request's queue entry is settled (``SETTLE``: its tenant charged what it used, the
entry XACKed and XDELed) only once its final status is written (the two live in different slots):
on a single Redis in the same round trip, after it; on a Cluster, where a pipeline's nodes answer
in any order, tokens, final statuses and acks go in three round trips, each once the one before
fully reached Redis. A failed round trip (Redis restarting, a failover, a node that stayed
unreachable: on a Cluster its error comes back as a reply, not raised) is sent again after a
backoff: clients drop repeated indexes, so at-least-once is enough."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis
from redis.crc import key_slot
from redis.exceptions import ClusterDownError, NoScriptError, TryAgainError

from shared.event_delivery import PUBLISH_TOKENS, log_maxlen, publish_command
from shared.keys import CONSUMER_GROUP, Keys
from shared.redis_connect import load_script
from shared.request_lifecycle import FINISH
from shared.schemas import DeadLetter, DoneEvent, ErrorEvent, FinalResult
from shared.settings import Settings
from shared.work_queue import SETTLE, settle_keys
from worker.reconnect import TRANSIENT, ResilientLoop

log = logging.getLogger("inflightq.worker")

# Replies that mean a command never reached a live node (a failover, a restart): an outage.
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, TryAgainError)

# A pending write: adds its commands to the pipeline of the next round trip.
Write = Callable[[Any], None]

# Token events per script call: a backlog after a Redis outage is sent in calls of this size, so
# no single call blocks Redis for long.
TOKENS_PER_CALL = 1024

# Script loads one round trip may try before it counts as an outage (backoff, then sent again):
# a node that keeps answering NOSCRIPT right after a reload must not spin the publisher.
SCRIPT_RELOADS = 3


@dataclass
class InHand:
    """What one turn took to send; a stage that reached Redis is emptied, so a retry resumes after it."""

    tokens: list[tuple[Any, int]]
    writes: list[Write]
    acks: list[Write]
    settled: list[Callable[[], None]]
    handed: int  # hand-overs it accounts for (``flush`` waits on them)


# The engine's finish reasons that end a request with an error instead of a result.
ERROR_FINISHES = {
    "expired": ("expired", "deadline passed during generation"),
    "error": ("generation", "generation failed"),
}


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


class Publisher(ResilientLoop):
    def __init__(self, settings: Settings, connection: redis.Redis, worker_name: str) -> None:
        """``connection``: a redis.Redis, or a redis.cluster.RedisCluster on a Cluster."""
        self._stopped = threading.Event()
        super().__init__("publisher", self._stopped)
        self.settings = settings
        self.keys = Keys.for_prefix(settings.key_prefix)
        self.redis = connection
        self.worker_name = worker_name
        self.maxlen = log_maxlen(settings)
        self.publish = publish_command(settings)
        # On a Cluster a script call may only touch one slot, and a pipeline's nodes answer in any
        # order (so acks wait for the final writes' round trip).
        self.by_slot = settings.redis_cluster
        # Called by EVALSHA in the pipeline; loaded up front and again after a NOSCRIPT (a Redis
        # restart). redis-py's Script objects would add a SCRIPT EXISTS round trip to every send.
        self._scripts = {FINISH: "", PUBLISH_TOKENS: "", SETTLE: ""}
        self._writes: deque[Write] = deque()
        self._acks: deque[Write] = deque()  # sent after the writes they follow
        self._settled: deque[Callable[[], None]] = deque()  # called once the acks reached Redis
        self._tokens: list[tuple[Any, int]] = []
        self._token_batches = 0
        self._cond = threading.Condition()
        self._submitted = 0
        self._sent = 0
        self._in_hand: InHand | None = None  # taken, unsent
        self._handed = 0  # writes and acks handed over since the last take
        self._finished = False
        self.round_trips = 0
        self.events_sent = 0

    # Called from other threads ----------------------------------------------------
    def publish_tokens(self, events: Iterable[tuple[Any, int]]) -> None:
        """``(engine_event, attempt)`` pairs of one step; events without a token are skipped."""
        batch = [(e, a) for e, a in events if e.token_id >= 0]
        if batch:
            with self._cond:
                # Kept apart from the other writes and sent first in the round trip: a request's
                # final write always follows its tokens, whatever else is in between.
                self._tokens += batch
                self._submitted += 1
                self._token_batches += 1
                self._cond.notify()

    def finish_done(
        self, stream: str, entry_id: str, result: FinalResult, settled: Callable[[], None] | None = None
    ) -> None:
        """``settled`` is called once the final status and the ack have reached Redis (or were
        given up as unsendable): until then the entry is still this worker's to keep fresh."""
        event = DoneEvent(request_id=result.request_id, result=result)
        final = self._final(result.request_id, "done", event.to_json(), "result", result.to_json())
        used = result.usage.total_tokens
        self._put(final, self._ack(stream, entry_id, used) if entry_id else None, settled)

    def finish_error(
        self,
        request_id: str,
        stream: str,
        entry_id: str,
        status: str,
        error_type: str,
        message: str,
        index: int | None,
        settled: Callable[[], None] | None = None,
        *,
        used: int | None = 0,
    ) -> None:
        """``used``: the tokens the request used (prompt + generated), charged to its tenant;
        None charges what its pull charged."""
        event = ErrorEvent(request_id=request_id, error_type=error_type, message=message, index=index).to_json()
        ack = self._ack(stream, entry_id, used) if entry_id else None
        self._put(self._final(request_id, status, event, "error", event), ack, settled)

    def dead_letter(self, model: str, letter: DeadLetter) -> None:
        key = self.keys.dead_letters(model)
        self._put(lambda pipe: pipe.xadd(key, {"letter": letter.to_json()}, maxlen=10_000, approximate=True), None)

    def mirror(self, write: Write) -> None:
        """A write of the worker's own state (its held prefixes: ``held_blocks``), in the next round trip."""
        self._put(write, None)

    def ack(self, stream: str, entry_id: str, used: int | None = 0) -> None:
        """Ends the entry: its tenant is charged ``used`` tokens (None: what its pull charged)."""
        self._put(None, self._ack(stream, entry_id, used))

    def _ack(self, stream: str, entry_id: str, used: int | None) -> Write:
        # SETTLE: the tenant's charge and the XACK + XDEL at once, so it runs once per entry.
        keys = settle_keys(self.keys, stream)
        args = [CONSUMER_GROUP, entry_id, "" if used is None else used]
        return lambda pipe: self._evalsha(pipe, SETTLE, keys, args)

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
    def done(self) -> bool:
        return self._finished

    def turn(self) -> None:
        if self._in_hand is None:
            with self._cond:
                while not self._writes and not self._acks and not self._tokens and not self._stopped.is_set():
                    self._cond.wait()
                if not self._writes and not self._acks and not self._tokens:
                    self._finished = True
                    return
                writes, acks, settled = list(self._writes), list(self._acks), list(self._settled)
                self._writes.clear()
                self._acks.clear()
                self._settled.clear()
                tokens, self._tokens = self._tokens, []
                self._in_hand = InHand(tokens, writes, acks, settled, self._handed + self._token_batches)
                self._token_batches = self._handed = 0
        in_hand = self._in_hand
        try:
            self._send(in_hand)
        except TRANSIENT:
            if self._stopped.is_set():  # shutting down with Redis gone: give up on what is left
                self._finished = True
                return
            raise  # sent again after a backoff
        except Exception:
            # Not an outage: sending it again would fail again and wedge every later write.
            lost = len(in_hand.writes) + len(in_hand.acks) + len(in_hand.tokens)
            log.exception("dropping a round trip of %d writes that cannot be sent", lost)
        for settled in in_hand.settled:
            settled()
        self._in_hand = None
        with self._cond:
            self._sent += in_hand.handed
            self._cond.notify_all()

    def _send(self, in_hand: InHand) -> None:
        tokens, writes, acks = in_hand.tokens, in_hand.writes, in_hand.acks
        chunks = [self._token_chunk(chunk) for group in self._by_slot(tokens) for chunk in _chunks(group)]
        if not all(self._scripts.values()):
            self._load_scripts()
        if not self.by_slot:
            self._round_trips(chunks + writes + acks)  # one connection: in order, all or an error
        else:
            # A Cluster pipeline's nodes succeed or fail apart, and redis-py retries a failed node's
            # commands one by one: a final status could land while its request's last tokens did
            # not, or an ack while its final status did not. So three stages, each sent only once
            # the one before it fully reached Redis; a retry after an outage resumes at the stage
            # that failed (what reached Redis is not sent again).
            if chunks:
                self._round_trips(chunks)
                self.events_sent += len(tokens)
                in_hand.tokens = []
            if writes:
                self._round_trips(writes)
                in_hand.writes = []
            self._round_trips(acks)
            return
        self.events_sent += len(tokens)

    def _by_slot(self, tokens: list[tuple[Any, int]]) -> list[list[tuple[Any, int]]]:
        if not self.by_slot:
            return [tokens]
        groups: dict[int, list[tuple[Any, int]]] = {}
        for token in tokens:
            groups.setdefault(key_slot(self.keys.replay_log(token[0].request_id).encode()), []).append(token)
        return list(groups.values())

    def _round_trips(self, calls: list[Write]) -> None:
        """One pipelined round trip (per node), again for script calls that found no script."""
        reloads = 0
        while calls:
            pipe = self.redis.pipeline(transaction=False)
            spans = []
            for call in calls:
                # len(pipe), not len(pipe.command_stack): redis-py 8's Cluster pipeline queues its
                # commands elsewhere and leaves command_stack empty, so every span was empty and
                # a promoted replica's NOSCRIPT went unseen (the writes silently dropped).
                start = len(pipe)
                call(pipe)
                spans.append((start, len(pipe)))
            replies = pipe.execute(raise_on_error=False)
            self.round_trips += 1
            again = []
            for call, (start, end) in zip(calls, spans, strict=True):
                errors = [r for r in replies[start:end] if isinstance(r, redis.RedisError)]
                # On a Cluster, a node that stayed unreachable through redis-py's retries leaves its
                # error in the replies instead of raising: that round trip did not reach Redis.
                down = next((e for e in errors if isinstance(e, UNREACHABLE)), None)
                if down is not None:
                    raise down
                if any(isinstance(e, NoScriptError) for e in errors):
                    again.append(call)  # a script call that did not run at all: safe to send again
                elif errors:
                    # A rejected command (not a lost connection) is a bug to see, not to retry forever.
                    log.error("redis rejected a write: %s", errors[0])
            if again:
                reloads += 1
                if reloads > SCRIPT_RELOADS:
                    # Sent again whole after a backoff: at-least-once, clients drop repeated indexes.
                    raise redis.ConnectionError(f"{len(again)} script calls still find no script after reloading")
                self._load_scripts()
            calls = again

    def _load_scripts(self) -> None:
        for script in self._scripts:
            self._scripts[script] = load_script(self.redis, script)

    def _evalsha(self, pipe: Any, script: str, keys: list[str], args: list[Any]) -> None:
        # execute_command: redis-py's Cluster pipeline refuses its evalsha() helper, not the command.
        pipe.execute_command("EVALSHA", self._scripts[script], len(keys), *keys, *args)

    def _token_chunk(self, tokens: list[tuple[Any, int]]) -> Write:
        keys: list[str] = []
        docs: list[str] = []
        for event, attempt in tokens:
            rid = event.request_id
            keys += (self.keys.replay_log(rid), self.keys.tokens_channel(rid))
            docs.append(token_json(rid, event.index, event.token_id, event.text, event, attempt))
        args = [self.maxlen, self.settings.result_ttl_s, self.publish, *docs]
        return lambda pipe: self._evalsha(pipe, PUBLISH_TOKENS, keys, args)

    def _put(self, write: Write | None, ack: Write | None, settled: Callable[[], None] | None = None) -> None:
        with self._cond:
            if write is not None:
                self._writes.append(write)
            if ack is not None:
                self._acks.append(ack)
            if settled is not None:
                self._settled.append(settled)
            self._submitted += 1
            self._handed += 1
            self._cond.notify()

    def _final(self, request_id: str, status: str, event: str, field: str, payload: str) -> Write:
        keys = [self.keys.request(request_id), self.keys.replay_log(request_id), self.keys.tokens_channel(request_id)]
        args = [status, event, field, payload, repr(time.time()), self.settings.result_ttl_s, self.maxlen, self.publish]
        args.append(min(self.settings.replay_log_ttl_s, self.settings.result_ttl_s))
        return lambda pipe: self._evalsha(pipe, FINISH, keys, args)


def _chunks(tokens: list[tuple[Any, int]]) -> list[list[tuple[Any, int]]]:
    return [tokens[i : i + TOKENS_PER_CALL] for i in range(0, len(tokens), TOKENS_PER_CALL)]
