"""The queue client: submit work, follow its tokens, collect results, cancel, look at queues.

Any service imports this to use the queue without HTTP; the API is a thin layer over it.
``QueueClient`` is synchronous; ``AsyncQueueClient`` (``shared.async_client``) has the same
methods as coroutines. The lifecycle they drive is in ``shared/lifecycle.py`` and the atomic
status changes in ``shared/transitions.py``.

Following a request (``stream``) subscribes to its token channel first, then replays its log,
then follows live, de-duplicating by token index: no gap and no duplicate however late the
caller comes, and a request that is already final is replayed and ends. Call ``submit`` before
``stream`` for a new request (the log makes that race-free)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import redis

from shared.errors import NotFoundError, OverloadedError
from shared.keys import CONSUMER_GROUP, Keys
from shared.lifecycle import RequestStatus
from shared.queue_protocol import (
    CATCH_UP_COUNT,
    NOTIFY_KEEP,
    TERMINAL_ONLY,
    AnyEvent,
    EventSequencer,
    IdleBackoff,
    accept_log_entries,
    build_request,
    cancelled_event,
    deadline_from,
    depth_of,
    filter_heartbeats,
    first_undelivered,
    hash_fields,
    log_maxlen,
    normalize,
    raise_for,
    redis_kwargs,
    remaining,
    status_found,
    terminal_from_info,
)
from shared.schemas import (
    DoneEvent,
    ErrorEvent,
    FinalResult,
    QueuedRequest,
    RequestInfo,
    SamplingSpec,
    WorkerHeartbeat,
    parse_event,
)
from shared.settings import Settings, get_settings
from shared.transitions import CANCEL, ENQUEUE, STREAM_FIELD


class QueueClient:
    def __init__(self, settings: Settings | None = None, *, client: redis.Redis | None = None) -> None:
        self.settings = settings or get_settings()
        self.keys = Keys.for_prefix(self.settings.key_prefix)
        self.redis: redis.Redis = client or redis.Redis.from_url(self.settings.redis_url, **redis_kwargs(self.settings))
        self._cancel = self.redis.register_script(CANCEL)
        self._enqueue = self.redis.register_script(ENQUEUE)
        self._models_with_groups: set[str] = set()

    # Submitting --------------------------------------------------------------------
    def submit(
        self,
        model: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec | None = None,
        *,
        priority: int | None = None,
        deadline: float | None = None,
        tenant: str | None = None,
        request_id: str | None = None,
        check_depth: bool = True,
    ) -> str:
        request = build_request(
            self.settings,
            model,
            prompt_token_ids,
            sampling,
            priority=priority,
            deadline=deadline,
            tenant=tenant,
            request_id=request_id,
        )
        return self.enqueue(request, check_depth=check_depth)

    def enqueue(self, request: QueuedRequest, *, check_depth: bool = True) -> str:
        request = normalize(self.settings, request)
        self.ensure_groups(request.model)
        model_streams = [self.keys.stream(request.model, p) for p in range(self.settings.priority_levels)]
        fields = [item for pair in hash_fields(request).items() for item in pair]
        verdict, detail = self._enqueue(
            keys=[
                self.keys.request(request.id),
                self.keys.stream(request.model, request.priority),
                self.keys.notify(request.model),
                self.keys.models(),
                *model_streams,
            ],
            args=[
                self.settings.result_ttl_s,
                request.to_json(),
                NOTIFY_KEEP,
                request.model,
                self.settings.max_queue_depth if check_depth else 0,
                CONSUMER_GROUP,
                STREAM_FIELD,
                *fields,
            ],
        )
        if verdict in (b"overloaded", "overloaded"):
            raise OverloadedError(f"queue for {request.model} is full ({int(detail)} waiting)")
        return request.id

    def ensure_groups(self, model: str) -> None:
        """Creates the consumer group on every priority stream, reading from the start ("0"), so
        nothing enqueued before the first worker arrives is skipped."""
        if model in self._models_with_groups:
            return
        for priority in range(self.settings.priority_levels):
            try:
                self.redis.xgroup_create(self.keys.stream(model, priority), CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as error:
                if "BUSYGROUP" not in str(error):
                    raise
        self._models_with_groups.add(model)

    # Following ---------------------------------------------------------------------
    def stream(self, request_id: str, from_index: int = 0, timeout: float | None = None) -> Iterator[AnyEvent]:
        """Every event of the request from ``from_index`` on, ending with its terminal event.
        ``timeout`` bounds the whole stream (TimeoutError past it)."""
        deadline = deadline_from(timeout)
        sequencer = EventSequencer(next_index=from_index)
        pubsub = self.redis.pubsub()
        try:
            pubsub.subscribe(self.keys.tokens_channel(request_id))
            # The log may be read only once the subscription is live, or an event could fall between.
            while True:
                message = pubsub.get_message(timeout=remaining(deadline))
                if message is not None and message["type"] == "subscribe":
                    break
            yield from self._catch_up(request_id, sequencer)
            if not sequencer.finished and not self.redis.exists(self.keys.request(request_id)):
                raise NotFoundError(f"unknown request {request_id}")
            idle = IdleBackoff()
            while not sequencer.finished:
                try:
                    message = pubsub.get_message(ignore_subscribe_messages=True, timeout=idle.timeout(deadline))
                except (redis.ConnectionError, redis.TimeoutError):
                    # redis-py re-subscribes on reconnect; the log fills whatever passed meanwhile.
                    time.sleep(0.2)
                    message = None
                if message is None or message.get("type") != "message":
                    caught, queued = self._idle_check(request_id, sequencer)
                    if caught:
                        idle.heard()
                    else:
                        idle.silent(queued=queued)
                    yield from caught
                    continue
                idle.heard()
                event = parse_event(message["data"])
                out = sequencer.accept(event, from_log=False)
                if sequencer.gap:
                    sequencer.gap = False
                    yield from self._catch_up(request_id, sequencer)
                    out = sequencer.accept(event, from_log=True)
                yield from out
        finally:
            pubsub.close()

    def _catch_up(self, request_id: str, sequencer: EventSequencer) -> Iterator[AnyEvent]:
        log = self.keys.replay_log(request_id)
        while not sequencer.finished:
            entries = self.redis.xrange(log, min="(" + sequencer.last_log_id, max="+", count=CATCH_UP_COUNT)
            if not entries:
                return
            yield from accept_log_entries(sequencer, entries)

    def _idle_check(self, request_id: str, sequencer: EventSequencer) -> tuple[list[AnyEvent], bool]:
        """The safety net after a silent wait, in one round trip while nothing has changed (the
        common case: a request waiting in the queue): the log past what was delivered, and the
        request's status. Only news costs more. Returns what it found, and whether the request
        is still queued."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xrange(self.keys.replay_log(request_id), min="(" + sequencer.last_log_id, max="+", count=CATCH_UP_COUNT)
        pipe.hget(self.keys.request(request_id), "status")
        entries, status = pipe.execute()
        out = accept_log_entries(sequencer, entries)
        if len(entries) == CATCH_UP_COUNT:
            out += self._catch_up(request_id, sequencer)
        if sequencer.finished:
            return out, False
        found = status_found(request_id, status)
        if found.is_final:
            out += self._finish_from_hash(request_id, sequencer)
        return out, found == RequestStatus.QUEUED

    def _finish_from_hash(self, request_id: str, sequencer: EventSequencer) -> Iterator[AnyEvent]:
        info = self.status(request_id)
        if info is None:
            raise NotFoundError(f"request {request_id} vanished (expired, or Redis lost it)")
        if not info.status.is_final:
            return
        # Final but the terminal event is not in the log yet: the log may have expired.
        yield from self._catch_up(request_id, sequencer)
        terminal = terminal_from_info(info)
        if not sequencer.finished and terminal is not None:
            yield from sequencer.accept(terminal, from_log=True)

    def result(self, request_id: str, timeout: float | None = None) -> FinalResult:
        """Waits for the request to finish; raises the error type of its ErrorEvent."""
        info = self.status(request_id)
        if info is None:
            raise NotFoundError(f"unknown request {request_id}")
        terminal = terminal_from_info(info) if info.status.is_final else None
        if terminal is None:
            for event in self.stream(request_id, from_index=TERMINAL_ONLY, timeout=timeout):
                terminal = event
        if isinstance(terminal, DoneEvent):
            return terminal.result
        if isinstance(terminal, ErrorEvent):
            raise_for(terminal)
        raise NotFoundError(f"request {request_id} ended without a terminal event")

    # Looking -----------------------------------------------------------------------
    def status(self, request_id: str) -> RequestInfo | None:
        fields = self.redis.hgetall(self.keys.request(request_id))
        return RequestInfo.from_hash(fields) if fields else None

    def cancel(self, request_id: str) -> bool:
        """True when the request was queued (now cancelled) or running (its worker is told)."""
        outcome = self._cancel(
            keys=[
                self.keys.request(request_id),
                self.keys.replay_log(request_id),
                self.keys.tokens_channel(request_id),
                self.keys.cancel_channel(),
            ],
            args=[
                request_id,
                cancelled_event(request_id).to_json(),
                repr(time.time()),
                self.settings.result_ttl_s,
                log_maxlen(self.settings),
            ],
        )
        if outcome == -1:
            raise NotFoundError(f"unknown request {request_id}")
        return outcome in (1, 2)

    def queue_depth(self, model: str) -> dict[int, int]:
        """Requests waiting (not yet taken by a worker), per priority."""
        pipe = self.redis.pipeline(transaction=False)
        for priority in range(self.settings.priority_levels):
            stream = self.keys.stream(model, priority)
            pipe.xlen(stream)
            pipe.xpending(stream, CONSUMER_GROUP)
        replies = pipe.execute(raise_on_error=False)
        return {
            priority: depth_of(replies[2 * priority], replies[2 * priority + 1])
            for priority in range(self.settings.priority_levels)
        }

    def oldest_waiting_age_s(self, model: str) -> float:
        """Age of the oldest request no worker has taken yet (0.0 when none waits)."""
        oldest = 0.0
        now_ms = time.time() * 1000
        for priority in range(self.settings.priority_levels):
            stream = self.keys.stream(model, priority)
            try:
                groups = self.redis.xinfo_groups(stream)
            except redis.ResponseError:
                continue
            start = first_undelivered(groups)
            entries = self.redis.xrange(stream, min=start, max="+", count=1)
            if entries:
                oldest = max(oldest, (now_ms - int(entries[0][0].split("-")[0])) / 1000)
        return oldest

    def live_workers(self, model: str | None = None) -> list[WorkerHeartbeat]:
        since = time.time() - self.settings.heartbeat_ttl_s
        names = self.redis.zrangebyscore(self.keys.workers(), since, "+inf")
        if not names:
            return []
        raw = self.redis.mget([self.keys.worker(name) for name in names])
        return filter_heartbeats(raw, model)

    def models(self) -> list[str]:
        return sorted(self.redis.smembers(self.keys.models()))

    def dead_letters(self, model: str, count: int = 100) -> list[dict[str, str]]:
        return [fields for _, fields in self.redis.xrange(self.keys.dead_letters(model), count=count)]

    def ping(self) -> bool:
        try:
            return bool(self.redis.ping())
        except redis.RedisError:
            return False

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> QueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def __getattr__(name: str) -> Any:
    # The asyncio client lives in its own module; re-exported here lazily to avoid an import cycle.
    if name == "AsyncQueueClient":
        from shared.async_client import AsyncQueueClient

        return AsyncQueueClient
    raise AttributeError(name)
