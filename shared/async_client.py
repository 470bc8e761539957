"""The asyncio twin of ``shared.client.QueueClient``: the same methods, as coroutines
(``stream`` is an async generator). The rules they follow live in ``shared.queue_protocol``
and ``shared.transitions``; see ``shared.client`` for the contract."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import redis
import redis.asyncio as aioredis

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


class AsyncQueueClient:
    def __init__(self, settings: Settings | None = None, *, client: aioredis.Redis | None = None) -> None:
        self.settings = settings or get_settings()
        self.keys = Keys.for_prefix(self.settings.key_prefix)
        self.redis: aioredis.Redis = client or aioredis.Redis.from_url(
            self.settings.redis_url, **redis_kwargs(self.settings)
        )
        self._cancel = self.redis.register_script(CANCEL)
        self._enqueue = self.redis.register_script(ENQUEUE)
        self._models_with_groups: set[str] = set()

    # Submitting --------------------------------------------------------------------
    async def submit(
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
        return await self.enqueue(request, check_depth=check_depth)

    async def enqueue(self, request: QueuedRequest, *, check_depth: bool = True) -> str:
        request = normalize(self.settings, request)
        await self.ensure_groups(request.model)
        model_streams = [self.keys.stream(request.model, p) for p in range(self.settings.priority_levels)]
        fields = [item for pair in hash_fields(request).items() for item in pair]
        verdict, detail = await self._enqueue(
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

    async def ensure_groups(self, model: str) -> None:
        if model in self._models_with_groups:
            return
        for priority in range(self.settings.priority_levels):
            try:
                await self.redis.xgroup_create(self.keys.stream(model, priority), CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as error:
                if "BUSYGROUP" not in str(error):
                    raise
        self._models_with_groups.add(model)

    # Following ---------------------------------------------------------------------
    async def stream(
        self, request_id: str, from_index: int = 0, timeout: float | None = None
    ) -> AsyncIterator[AnyEvent]:
        deadline = deadline_from(timeout)
        sequencer = EventSequencer(next_index=from_index)
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(self.keys.tokens_channel(request_id))
            while True:
                message = await pubsub.get_message(timeout=remaining(deadline))
                if message is not None and message["type"] == "subscribe":
                    break
            for event in await self._catch_up(request_id, sequencer):
                yield event
            if not sequencer.finished and not await self.redis.exists(self.keys.request(request_id)):
                raise NotFoundError(f"unknown request {request_id}")
            idle = IdleBackoff()
            while not sequencer.finished:
                try:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=idle.timeout(deadline))
                except (redis.ConnectionError, redis.TimeoutError):
                    await asyncio.sleep(0.2)
                    message = None
                if message is None or message.get("type") != "message":
                    out, queued = await self._idle_check(request_id, sequencer)
                    if out:
                        idle.heard()
                    else:
                        idle.silent(queued=queued)
                else:
                    idle.heard()
                    event = parse_event(message["data"])
                    out = sequencer.accept(event, from_log=False)
                    if sequencer.gap:
                        sequencer.gap = False
                        out = await self._catch_up(request_id, sequencer)
                        out += sequencer.accept(event, from_log=True)
                for event in out:
                    yield event
        finally:
            await pubsub.aclose()

    async def _catch_up(self, request_id: str, sequencer: EventSequencer) -> list[AnyEvent]:
        log = self.keys.replay_log(request_id)
        out: list[AnyEvent] = []
        while not sequencer.finished:
            entries = await self.redis.xrange(log, min="(" + sequencer.last_log_id, max="+", count=CATCH_UP_COUNT)
            if not entries:
                break
            out += accept_log_entries(sequencer, entries)
        return out

    async def _idle_check(self, request_id: str, sequencer: EventSequencer) -> tuple[list[AnyEvent], bool]:
        """The safety net after a silent wait, in one round trip while nothing has changed (the
        common case: a request waiting in the queue): the log past what was delivered, and the
        request's status. Only news costs more. Returns what it found, and whether the request
        is still queued."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xrange(self.keys.replay_log(request_id), min="(" + sequencer.last_log_id, max="+", count=CATCH_UP_COUNT)
        pipe.hget(self.keys.request(request_id), "status")
        entries, status = await pipe.execute()
        out = accept_log_entries(sequencer, entries)
        if len(entries) == CATCH_UP_COUNT:
            out += await self._catch_up(request_id, sequencer)
        if sequencer.finished:
            return out, False
        found = status_found(request_id, status)
        if found.is_final:
            out += await self._finish_from_hash(request_id, sequencer)
        return out, found == RequestStatus.QUEUED

    async def _finish_from_hash(self, request_id: str, sequencer: EventSequencer) -> list[AnyEvent]:
        info = await self.status(request_id)
        if info is None:
            raise NotFoundError(f"request {request_id} vanished (expired, or Redis lost it)")
        if not info.status.is_final:
            return []
        out = await self._catch_up(request_id, sequencer)
        terminal = terminal_from_info(info)
        if not sequencer.finished and terminal is not None:
            out += sequencer.accept(terminal, from_log=True)
        return out

    async def result(self, request_id: str, timeout: float | None = None) -> FinalResult:
        info = await self.status(request_id)
        if info is None:
            raise NotFoundError(f"unknown request {request_id}")
        terminal = terminal_from_info(info) if info.status.is_final else None
        if terminal is None:
            async for event in self.stream(request_id, from_index=TERMINAL_ONLY, timeout=timeout):
                terminal = event
        if isinstance(terminal, DoneEvent):
            return terminal.result
        if isinstance(terminal, ErrorEvent):
            raise_for(terminal)
        raise NotFoundError(f"request {request_id} ended without a terminal event")

    # Looking -----------------------------------------------------------------------
    async def status(self, request_id: str) -> RequestInfo | None:
        fields = await self.redis.hgetall(self.keys.request(request_id))
        return RequestInfo.from_hash(fields) if fields else None

    async def cancel(self, request_id: str) -> bool:
        outcome = await self._cancel(
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

    async def queue_depth(self, model: str) -> dict[int, int]:
        pipe = self.redis.pipeline(transaction=False)
        for priority in range(self.settings.priority_levels):
            stream = self.keys.stream(model, priority)
            pipe.xlen(stream)
            pipe.xpending(stream, CONSUMER_GROUP)
        replies = await pipe.execute(raise_on_error=False)
        return {
            priority: depth_of(replies[2 * priority], replies[2 * priority + 1])
            for priority in range(self.settings.priority_levels)
        }

    async def oldest_waiting_age_s(self, model: str) -> float:
        oldest = 0.0
        now_ms = time.time() * 1000
        for priority in range(self.settings.priority_levels):
            stream = self.keys.stream(model, priority)
            try:
                groups = await self.redis.xinfo_groups(stream)
            except redis.ResponseError:
                continue
            entries = await self.redis.xrange(stream, min=first_undelivered(groups), max="+", count=1)
            if entries:
                oldest = max(oldest, (now_ms - int(entries[0][0].split("-")[0])) / 1000)
        return oldest

    async def live_workers(self, model: str | None = None) -> list[WorkerHeartbeat]:
        since = time.time() - self.settings.heartbeat_ttl_s
        names = await self.redis.zrangebyscore(self.keys.workers(), since, "+inf")
        if not names:
            return []
        raw = await self.redis.mget([self.keys.worker(name) for name in names])
        return filter_heartbeats(raw, model)

    async def models(self) -> list[str]:
        return sorted(await self.redis.smembers(self.keys.models()))

    async def dead_letters(self, model: str, count: int = 100) -> list[dict[str, str]]:
        return [fields for _, fields in await self.redis.xrange(self.keys.dead_letters(model), count=count)]

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except redis.RedisError:
            return False

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncQueueClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
