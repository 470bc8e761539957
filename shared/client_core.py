"""The queue client's logic, written once for the sync and the asyncio client.

Every client method is a plan (``shared.redis_plan``) on ``QueueCore``: it yields the Redis
round trips it needs and takes their replies back, without doing I/O itself. ``QueueClient``
performs the ops with redis-py, ``AsyncQueueClient`` with redis.asyncio, and that is all the two
differ in.

Following a request (``QueueCore.follow``) subscribes to its token channel first, then replays
its log, then follows live (``shared.event_delivery``); after a silent wait it re-reads the log
and the request's status (the safety net for a lost pub/sub message or a dropped connection),
waiting longer between such checks while nothing happens (``IdleBackoff``)."""

from __future__ import annotations

import time
from typing import Any, TypedDict

import redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import EqualJitterBackoff, ExponentialBackoff
from redis.retry import Retry

from shared.errors import (
    ConflictError,
    NotFoundError,
    OverloadedError,
    TenantOverloadedError,
    UnavailableError,
    error_from_type,
)
from shared.event_delivery import (
    CATCH_UP_COUNT,
    TERMINAL_ONLY,
    AnyEvent,
    EventSequencer,
    accept_log_entries,
    log_maxlen,
    publish_command,
)
from shared.keys import CONSUMER_GROUP, Keys, lane_priority
from shared.redis_plan import Emit, Pause, Pipeline, RunScript, Steps, call, pubsub_call
from shared.request_builder import build_request
from shared.request_lifecycle import CANCEL, CREATE, STATUS, RequestStatus, hash_fields
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
from shared.settings import Settings
from shared.work_queue import (
    ENQUEUE,
    NOTIFY_KEEP,
    STREAM_FIELD,
    depth_of,
    first_undelivered,
    model_lanes,
    request_cost,
)

# The scripts a client runs; each front registers them once.
CLIENT_SCRIPTS = (CREATE, ENQUEUE, CANCEL)

# How long a follower waits on pub/sub before it re-reads the replay log and the hash: the
# safety net for a lost pub/sub message or a dropped connection, not the normal path. The wait
# doubles while the stream stays silent (a request waiting its turn in the queue), up to
# IDLE_CHECK_MAX_S: at a flat second, every queued stream would cost two Redis round trips a
# second, in the API and on the CPU the worker beside it needs.
IDLE_CHECK_S = 1.0
IDLE_CHECK_MAX_S = 8.0
# While the last check found the request still queued, the wait grows further: nothing has been
# published for it yet, so nothing can have been lost (its first token, when it comes, resets the
# wait). Thousands of queued streams then cost a few checks a second, in the API and in any service
# following them.
QUEUED_CHECK_MAX_S = 30.0
# A follower's pause after a Redis round trip failed even with the connection's own retries
# (``redis_kwargs``); it keeps trying for ``redis_outage_grace_s``, and the subscription
# re-subscribes on reconnect (``shared.subscriptions``).
RECONNECT_PAUSE_S = 0.2
# How long a new subscription may take to be confirmed.
SUBSCRIBE_S = 10.0


def redis_kwargs(
    settings: Settings,
    *,
    asyncio: bool = False,
    encoding_errors: str = "replace",
    retries: int = 8,
    backoff_cap_s: float = 2.0,
) -> dict[str, Any]:
    """Connection options every client uses: text replies, retries with backoff across a restart,
    and a pool as large as the settings allow: ``redis_max_connections`` for a sync client (redis-py's
    default of 100 would turn the 101st thread's command into a spurious "Redis unreachable"), the
    API's ``api_redis_max_connections`` for an asyncio one, whose pool waits for a free connection
    past it (``shared.redis_pool``).

    ``asyncio`` picks redis.asyncio's own Retry: the sync one, given to an asyncio client, returns
    an un-awaited coroutine instead of retrying, so every command would fail across a blip and stale
    pooled connections with it. ``encoding_errors``: a reply that
    is not UTF-8 (anyone may XADD anything) becomes U+FFFD instead of an exception that stops the
    reader; the worker asks for ``surrogateescape`` to tell such bytes apart and reject them."""
    retry_class = AsyncRetry if asyncio else Retry
    return {
        "max_connections": settings.api_redis_max_connections if asyncio else settings.redis_max_connections,
        "decode_responses": True,
        "encoding_errors": encoding_errors,
        "retry": retry_class(ExponentialBackoff(cap=backoff_cap_s, base=0.05), retries),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        "health_check_interval": 30,
    }


class OutageClock:
    """How long a follower has found Redis unreachable; past ``grace_s`` it gives up with 503
    (``UnavailableError``). Shorter outages are only a pause: the follower then reads what it
    missed from the replay log."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.since: float | None = None

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, error: Exception) -> None:
        now = time.monotonic()
        self.since = self.since if self.since is not None else now
        if now - self.since >= self.grace_s:
            raise UnavailableError(
                f"the queue (Redis) has been unreachable for {now - self.since:.0f} s ({error})"
            ) from error

    def over(self) -> None:
        self.since = None


# Rules without I/O ---------------------------------------------------------------------------
class SubmitOptions(TypedDict, total=False):
    """``submit``'s keyword options (see ``QueueCore.submit``)."""

    priority: int | None
    deadline: float | None
    tenant: str | None
    request_id: str | None
    check_depth: bool
    adapter: str | None


def cancelled_event(request_id: str) -> ErrorEvent:
    return ErrorEvent(request_id=request_id, error_type="cancelled", message="cancelled by client")


def raise_for(event: ErrorEvent) -> None:
    raise error_from_type(event.error_type, event.message)


def terminal_from_info(info: RequestInfo) -> AnyEvent | None:
    """The terminal event a final request's hash implies (used when its log has expired)."""
    if info.result is not None:
        return DoneEvent(request_id=info.id, result=info.result)
    if info.error is not None:
        return info.error
    if info.status.is_final:
        return ErrorEvent(request_id=info.id, error_type="generation", message=f"request {info.status.value}")
    return None


def status_found(request_id: str, status: str | None) -> RequestStatus:
    """A request's status as an idle check read it; a request that is gone is an error."""
    if status is None:
        raise NotFoundError(f"request {request_id} vanished (expired, or Redis lost it)")
    return RequestStatus(status)


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


# Jittered (each wait between half and all of the nominal one): streams opened together would
# otherwise check together forever, and every check wave would take as many pooled command
# connections as streams checked at once.
_SILENT = EqualJitterBackoff(cap=IDLE_CHECK_MAX_S, base=IDLE_CHECK_S)
_SILENT_QUEUED = EqualJitterBackoff(cap=QUEUED_CHECK_MAX_S, base=IDLE_CHECK_S)


class IdleBackoff:
    """A follower's wait on pub/sub between safety-net checks: IDLE_CHECK_S after anything was
    heard, doubling with each silent check up to IDLE_CHECK_MAX_S, or QUEUED_CHECK_MAX_S while
    the request has not started; each wait drawn between half and all of that."""

    def __init__(self) -> None:
        self.silent_checks = 0
        self._backoff = _SILENT

    def timeout(self, deadline: float | None) -> float:
        return remaining(deadline, self._backoff.compute(self.silent_checks))

    def heard(self) -> None:
        self.silent_checks = 0

    def silent(self, *, queued: bool = False) -> None:
        self.silent_checks = min(self.silent_checks + 1, 32)  # past the cap already; 2**n stays a float
        self._backoff = _SILENT_QUEUED if queued else _SILENT


# The plans -----------------------------------------------------------------------------------
class QueueCore:
    """What a queue client does, as plans (see the module's docstring)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys.for_prefix(settings.key_prefix)
        self._models_with_groups: set[str] = set()

    # Submitting --------------------------------------------------------------------------
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
        adapter: str | None = None,
    ) -> Steps[str]:
        """A new request, normalised by ``shared.request_builder``: ``priority`` defaults to the
        settings' (0 = most urgent), ``deadline`` is a Unix time, ``check_depth=False`` skips the
        queue-depth limit (batch work), ``adapter`` names a LoRA adapter of ``model`` (``shared.adapters``;
        the worker fails a request naming one it does not find)."""
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
        request.adapter = adapter
        return (yield from self.enqueue(request, check_depth=check_depth))

    def enqueue(
        self,
        request: QueuedRequest,
        *,
        check_depth: bool = True,
        offer_to: str | None = None,
        tenant_max_queued: int | None = 0,
        offered_tokens: int = 0,
    ) -> Steps[str]:
        """Queues ``request`` as it is: one that ``shared.request_builder`` built (``submit``
        does), so its defaults, priority range and seed are already in place.

        ``offer_to``: the worker that holds the request's prefix (``offered_tokens`` of it); the entry
        is offered to it first (a busy worker takes it after the steal bound plus the time it would take
        to prefill those tokens, an idle one at once, any at once when it is dead). ``tenant_max_queued``: how
        many requests of ``request.tenant`` may wait for this model (0 or None: no limit); past it
        ``TenantOverloadedError``. ``check_depth=False`` skips both limits (batch work)."""
        yield from self.ensure_groups(request.model)
        keys, model, priority = self.keys, request.model, request.priority
        first = hash_fields(
            request.id, request.model, request.priority, request.submitted_at, request.attempt, request.tenant
        )
        # The hash first, in the request's slot; then the entry, in the model's (another node on a
        # Cluster): a worker never reads an entry whose hash is still to come.
        # A reused id is refused here, before anything is written: the request that owns it stays untouched.
        verdict, detail = yield RunScript(
            CREATE,
            keys=[self.keys.request(request.id)],
            args=[self.settings.result_ttl_s, *[item for pair in first.items() for item in pair]],
        )
        if verdict in (b"duplicate", "duplicate"):
            raise ConflictError(f"request id {request.id} is already in use (status {detail}); choose a new id")
        tenant = request.tenant or ""
        lane = keys.lane(model, priority, tenant if self.settings.fair_share else None)
        verdict, detail = yield RunScript(
            ENQUEUE,
            keys=[
                lane,
                keys.notify(model),
                keys.lanes(model),
                keys.share(model, priority),
                keys.backlog(model, priority),
                keys.waiting(model, priority),
                keys.clock(model, priority),
                keys.offers(model, priority, offer_to or ""),
                keys.held(model, offer_to or ""),
                keys.offered(model, priority),
                keys.notify_worker(model, offer_to or ""),
                keys.light_arrivals(model),
                *[keys.waiting(model, p) for p in range(self.settings.priority_levels)],
            ],
            args=[
                request.to_json(),
                NOTIFY_KEEP,
                self.settings.max_queue_depth if check_depth else 0,
                CONSUMER_GROUP,
                STREAM_FIELD,
                tenant,
                repr(request.tenant_weight),
                request_cost(len(request.prompt_token_ids), request.sampling.max_new_tokens),
                (tenant_max_queued or 0) if check_depth and tenant else 0,
                offer_to or "",
                offered_tokens if offer_to else 0,
                "1" if self.settings.fair_share else "0",
            ],
        )
        if verdict in (b"tenant_overloaded", "tenant_overloaded"):
            yield call("delete", self.keys.request(request.id))
            raise TenantOverloadedError(
                f"tenant {tenant} has {int(detail)} requests queued for {model}, as many as it may",
                tenant=tenant,
                value=int(detail),
            )
        if verdict in (b"overloaded", "overloaded"):
            yield call("delete", self.keys.request(request.id))
            raise OverloadedError(f"queue for {request.model} is full ({int(detail)} waiting)")
        return request.id

    def ensure_groups(self, model: str) -> Steps[None]:
        """Creates the consumer group on every priority stream, reading from the start ("0"), so
        nothing enqueued before the first worker arrives is skipped."""
        if model in self._models_with_groups:
            return
        for priority in range(self.settings.priority_levels):
            try:
                yield call("xgroup_create", self.keys.stream(model, priority), CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as error:
                if "BUSYGROUP" not in str(error):
                    raise
        yield call("sadd", self.keys.models(), model)
        self._models_with_groups.add(model)

    # Following ---------------------------------------------------------------------------
    def follow(self, request_id: str, from_index: int = 0, timeout: float | None = None) -> Steps[AnyEvent | None]:
        """Emits every event of the request from ``from_index`` on, ending with its terminal
        event, which it also returns. ``timeout`` bounds the whole stream (TimeoutError past it)."""
        deadline = deadline_from(timeout)
        sequencer = EventSequencer(next_index=from_index)
        # The log may be read only once the subscription is live, or an event could fall between:
        # ``subscribe`` returns once Redis has confirmed it.
        try:
            yield pubsub_call(
                "subscribe", self.keys.tokens_channel(request_id), timeout=remaining(deadline, SUBSCRIBE_S)
            )
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise  # the caller's own timeout
            # Redis never confirmed the subscription: a connection problem, not the request's
            # deadline ("expired" would mislead a client whose job has none).
            raise redis.ConnectionError(f"Redis did not confirm the subscription within {SUBSCRIBE_S:g} s") from None
        yield Emit((yield from self.catch_up(request_id, sequencer)))
        if not sequencer.finished and not (yield call("exists", self.keys.request(request_id))):
            raise NotFoundError(f"unknown request {request_id}")
        idle = IdleBackoff()
        outage = OutageClock(self.settings.redis_outage_grace_s)
        while not sequencer.finished:
            try:
                out = yield from self.follow_once(request_id, sequencer, idle, deadline, resync=outage.down)
                outage.over()
            except (redis.ConnectionError, redis.TimeoutError) as error:
                outage.failed(error)  # past the grace: 503
                yield Pause(RECONNECT_PAUSE_S)
                continue
            yield Emit(out)
        return sequencer.terminal

    def follow_once(
        self, request_id: str, sequencer: EventSequencer, idle: IdleBackoff, deadline: float | None, *, resync: bool
    ) -> Steps[list[AnyEvent]]:
        """One wait on pub/sub and what it brings; ``resync`` (after Redis was unreachable) reads
        the log and status first: whatever was published meanwhile is only there. The subscription
        (``shared.subscriptions``) gives an event's JSON, or None: silence, or a request to check
        (it re-subscribed after its connection failed)."""
        message = None
        if not resync:
            message = yield pubsub_call("get_message", timeout=idle.timeout(deadline))
        if message is None:
            out, queued = yield from self.idle_check(request_id, sequencer)
            if out or resync:
                idle.heard()
            else:
                idle.silent(queued=queued)
            return out
        idle.heard()
        event = parse_event(message)
        out = sequencer.accept(event, from_log=False)
        if sequencer.gap:
            sequencer.gap = False
            out = yield from self.catch_up(request_id, sequencer)
            out += sequencer.accept(event, from_log=True)
        return out

    def catch_up(self, request_id: str, sequencer: EventSequencer) -> Steps[list[AnyEvent]]:
        log = self.keys.replay_log(request_id)
        out: list[AnyEvent] = []
        while not sequencer.finished:
            entries = yield call("xrange", log, min="(" + sequencer.last_log_id, max="+", count=CATCH_UP_COUNT)
            if not entries:
                break
            out += accept_log_entries(sequencer, entries)
        return out

    def idle_check(self, request_id: str, sequencer: EventSequencer) -> Steps[tuple[list[AnyEvent], bool]]:
        """The safety net after a silent wait, in one round trip while nothing has changed (the
        common case: a request waiting in the queue): the log past what was delivered, and the
        request's status. Only news costs more. Returns what it found, and whether the request
        is still queued."""
        log = self.keys.replay_log(request_id)
        entries, status = yield Pipeline(
            [
                call("xrange", log, min="(" + sequencer.last_log_id, max="+", count=CATCH_UP_COUNT),
                call("hget", self.keys.request(request_id), STATUS),
            ]
        )
        out = accept_log_entries(sequencer, entries)
        if len(entries) == CATCH_UP_COUNT:
            out += yield from self.catch_up(request_id, sequencer)
        if sequencer.finished:
            return out, False
        found = status_found(request_id, status)
        if found.is_final:
            out += yield from self.finish_from_hash(request_id, sequencer)
        return out, found == RequestStatus.QUEUED

    def finish_from_hash(self, request_id: str, sequencer: EventSequencer) -> Steps[list[AnyEvent]]:
        info = yield from self.status(request_id)
        if info is None:
            raise NotFoundError(f"request {request_id} vanished (expired, or Redis lost it)")
        if not info.status.is_final:
            return []
        # Final but the terminal event is not in the log yet: the log may have expired.
        out = yield from self.catch_up(request_id, sequencer)
        terminal = terminal_from_info(info)
        if not sequencer.finished and terminal is not None:
            out += sequencer.accept(terminal, from_log=True)
        return out

    def result(self, request_id: str, timeout: float | None = None) -> Steps[FinalResult]:
        """Waits for the request to finish; raises the error type of its ErrorEvent."""
        info = yield from self.status(request_id)
        if info is None:
            raise NotFoundError(f"unknown request {request_id}")
        terminal = terminal_from_info(info) if info.status.is_final else None
        if terminal is None:
            terminal = yield from self.follow(request_id, from_index=TERMINAL_ONLY, timeout=timeout)
        if isinstance(terminal, DoneEvent):
            return terminal.result
        if isinstance(terminal, ErrorEvent):
            raise_for(terminal)
        raise NotFoundError(f"request {request_id} ended without a terminal event")

    # Looking -----------------------------------------------------------------------------
    def status(self, request_id: str) -> Steps[RequestInfo | None]:
        fields = yield call("hgetall", self.keys.request(request_id))
        return RequestInfo.from_hash(fields) if fields else None

    def cancel(self, request_id: str) -> Steps[bool]:
        """True when this call cancelled the request: it was queued (now cancelled) or running
        (its worker is told). Of concurrent calls, exactly one gets True."""
        outcome = yield RunScript(
            CANCEL,
            keys=[
                self.keys.request(request_id),
                self.keys.replay_log(request_id),
                self.keys.tokens_channel(request_id),
            ],
            args=[
                request_id,
                cancelled_event(request_id).to_json(),
                repr(time.time()),
                self.settings.result_ttl_s,
                log_maxlen(self.settings),
                self.keys.cancel_channel(),
                publish_command(self.settings),
            ],
        )
        if outcome == -1:
            raise NotFoundError(f"unknown request {request_id}")
        return outcome in (1, 2)

    def lanes(self, model: str) -> Steps[list[str]]:
        """Every lane and offer stream of the model, most urgent priority first."""
        members = yield call("smembers", self.keys.lanes(model))
        return model_lanes(members, self.keys, model, self.settings.priority_levels)

    def queue_depth(self, model: str) -> Steps[dict[int, int]]:
        """Requests waiting (not yet taken by a worker), per priority, over every lane and offer stream."""
        lanes = yield from self.lanes(model)
        calls = [c for lane in lanes for c in (call("xlen", lane), call("xpending", lane, CONSUMER_GROUP))]
        replies = yield Pipeline(calls, raise_on_error=False)
        depth = dict.fromkeys(range(self.settings.priority_levels), 0)
        for i, lane in enumerate(lanes):
            depth[lane_priority(lane)] += depth_of(replies[2 * i], replies[2 * i + 1])
        return depth

    def tenant_waiting(self, model: str) -> Steps[dict[str, int]]:
        """Requests waiting per tenant ('' for none), every priority together."""
        replies = yield Pipeline(
            [call("hgetall", self.keys.waiting(model, p)) for p in range(self.settings.priority_levels)]
        )
        waiting: dict[str, int] = {}
        for counts in replies:
            for tenant, count in (counts or {}).items():
                waiting[tenant] = waiting.get(tenant, 0) + int(count)
        return waiting

    def tenant_shares(self, model: str, priority: int) -> Steps[dict[str, float]]:
        """Each tenant's virtual time at ``priority``: the tokens it was served over its weight."""
        shares = yield call("hgetall", self.keys.share(model, priority))
        return {tenant: float(value) for tenant, value in (shares or {}).items()}

    def oldest_waiting_age_s(self, model: str) -> Steps[float]:
        """Age of the oldest request no worker has taken yet (0.0 when none waits)."""
        oldest = 0.0
        now_ms = time.time() * 1000
        for lane in (yield from self.lanes(model)):
            try:
                groups = yield call("xinfo_groups", lane)
            except redis.ResponseError:
                continue
            entries = yield call("xrange", lane, min=first_undelivered(groups), max="+", count=1)
            if entries:
                oldest = max(oldest, (now_ms - int(entries[0][0].split("-")[0])) / 1000)
        return oldest

    def live_workers(self, model: str | None = None) -> Steps[list[WorkerHeartbeat]]:
        since = time.time() - min(self.settings.heartbeat_stale_s, self.settings.heartbeat_ttl_s)
        names = yield call("zrangebyscore", self.keys.workers(), since, "+inf")
        if not names:
            return []
        raw = yield call("mget", [self.keys.worker(name) for name in names])
        return filter_heartbeats(raw, model)

    def models(self) -> Steps[list[str]]:
        return sorted((yield call("smembers", self.keys.models())))

    def dead_letters(self, model: str, count: int = 100) -> Steps[list[dict[str, str]]]:
        entries = yield call("xrange", self.keys.dead_letters(model), count=count)
        return [fields for _, fields in entries]

    def ping(self) -> Steps[bool]:
        try:
            return bool((yield call("ping")))
        except redis.RedisError:
            return False
