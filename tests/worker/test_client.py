"""The queue client against a real Redis, with this test playing the worker's part by hand."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
from redis.cluster import RedisCluster

from shared.async_client import AsyncQueueClient
from shared.client import QueueClient
from shared.client_core import IDLE_CHECK_MAX_S, IDLE_CHECK_S, QUEUED_CHECK_MAX_S, IdleBackoff, QueueCore
from shared.errors import CancelledError, ConflictError, NotFoundError, OverloadedError, ValidationError
from shared.event_delivery import LOG_FIELD, EventSequencer
from shared.keys import Keys
from shared.request_lifecycle import RequestStatus
from shared.schemas import (
    DoneEvent,
    ErrorEvent,
    FinalResult,
    QueuedRequest,
    SamplingSpec,
    Timings,
    TokenEvent,
    Usage,
)
from shared.settings import Settings
from shared.subscriptions import ChannelHub
from shared.work_queue import PULL, STREAM_FIELD, pull_args, pull_keys
from tests.conftest import RedisBackend

MODEL = "m"


@pytest.fixture
def client_settings(redis_backend: RedisBackend, key_prefix: str) -> Settings:
    return Settings(
        redis_url=redis_backend.url, redis_cluster=redis_backend.cluster, key_prefix=key_prefix, max_queue_depth=3
    )


@pytest.fixture
def client(client_settings: Settings):
    with QueueClient(client_settings) as queue:
        yield queue


def emit(r: redis.Redis, keys: Keys, event: TokenEvent | DoneEvent | ErrorEvent, *, log: bool = True) -> None:
    """What a worker's publisher does for one event: log first, then publish."""
    if log:
        r.xadd(keys.replay_log(event.request_id), {LOG_FIELD: event.to_json()})
    if isinstance(r, RedisCluster):
        r.spublish(keys.tokens_channel(event.request_id), event.to_json())
    else:
        r.publish(keys.tokens_channel(event.request_id), event.to_json())


def wait_subscribed(r: redis.Redis, keys: Keys, *request_ids: str, timeout: float = 30.0) -> None:
    """Until a follower listens on each request's channel: what the test's "worker" waits for before
    it publishes, so the live path is what gets tested (a fixed sleep tested the log on a slow day)."""
    channels = [keys.tokens_channel(request_id) for request_id in request_ids]
    deadline = time.monotonic() + timeout

    def counts() -> list[int]:
        if isinstance(r, RedisCluster):  # sharded channels: each counted on the node that owns its slot
            return [dict(r.pubsub_shardnumsub(c, target_nodes=r.get_node_from_key(c))).get(c, 0) for c in channels]
        return [count for _, count in r.pubsub_numsub(*channels)]

    while not all(count >= 1 for count in counts()):
        assert time.monotonic() < deadline, "the client never subscribed to the token channel"
        time.sleep(0.01)


def token(request_id: str, index: int) -> TokenEvent:
    return TokenEvent(request_id=request_id, index=index, token_id=100 + index, text=f"t{index}")


def done(request_id: str, n: int) -> DoneEvent:
    result = FinalResult(
        request_id=request_id,
        model=MODEL,
        text="".join(f"t{i}" for i in range(n)),
        token_ids=[100 + i for i in range(n)],
        finish_reason="length",
        usage=Usage(prompt_tokens=1, completion_tokens=n, total_tokens=n + 1),
        timings=Timings(submitted_at=time.time()),
    )
    return DoneEvent(request_id=request_id, result=result)


def test_submit_writes_the_queued_hash_then_the_stream_entry_and_a_wakeup(client, redis_client, keys) -> None:
    request_id = client.submit(MODEL, [1, 2, 3], SamplingSpec(max_new_tokens=4, temperature=0.7), priority=2)
    info = client.status(request_id)
    assert info is not None and info.status is RequestStatus.QUEUED and info.priority == 2
    entries = redis_client.xrange(keys.stream(MODEL, 2))
    queued = QueuedRequest.model_validate_json(entries[0][1][STREAM_FIELD])
    assert queued.id == request_id and queued.prompt_token_ids == [1, 2, 3]
    assert queued.sampling.seed is not None, "sampled requests get a seed so a takeover reproduces them"
    assert redis_client.llen(keys.notify(MODEL)) == 1
    assert client.queue_depth(MODEL) == {0: 0, 1: 0, 2: 1, 3: 0}
    assert client.oldest_waiting_age_s(MODEL) >= 0.0


def test_greedy_requests_keep_no_seed_and_bad_priority_is_rejected(client, redis_client, keys) -> None:
    request_id = client.submit(MODEL, [1], priority=0)
    queued = QueuedRequest.model_validate_json(redis_client.xrange(keys.stream(MODEL, 0))[0][1][STREAM_FIELD])
    assert queued.id == request_id and queued.sampling.seed is None
    with pytest.raises(ValidationError):
        client.submit(MODEL, [1], priority=4)


def test_a_create_sent_again_by_a_retry_is_its_own_not_a_duplicate(redis_client, keys) -> None:
    # A connection lost after Redis ran CREATE makes redis-py send it again: without this, a
    # failover answered 409 for an id the API had minted itself, and the job ran unannounced.
    from shared.request_lifecycle import CREATE, hash_fields

    def create(submitted_at: float) -> list[str]:
        fields = hash_fields("retried-1", MODEL, 2, submitted_at, 0)
        args = [60, *[item for pair in fields.items() for item in pair]]
        return [str(v) for v in redis_client.eval(CREATE, 1, keys.request("retried-1"), *args)]

    assert create(1000.25) == ["ok", ""]
    assert create(1000.25) == ["ok", ""], "the same submission again"
    assert create(1000.5) == ["duplicate", "queued"], "another submission reusing the id"
    redis_client.hset(keys.request("retried-1"), "status", "running")
    assert create(1000.25) == ["duplicate", "running"], "once it has moved on, even the same one is refused"


def take_one(redis_client: redis.Redis, keys: Keys, priority: int) -> None:
    """What a worker's intake does to take an entry (``PULL``)."""
    args = pull_args(keys, MODEL, priority, "w", 1, idle=True, steal_after_ms=0, peek=False)
    assert len(redis_client.eval(PULL, 8, *pull_keys(keys, MODEL, priority, "w"), *args)) == 1


def test_submit_past_the_queue_depth_is_overloaded_but_taken_work_does_not_count(client, redis_client, keys) -> None:
    for _ in range(3):
        client.submit(MODEL, [1], priority=1)
    with pytest.raises(OverloadedError):
        client.submit(MODEL, [1], priority=0)
    take_one(redis_client, keys, 1)
    assert client.queue_depth(MODEL)[1] == 2
    client.submit(MODEL, [1], priority=0)


def test_a_reused_request_id_is_refused_and_the_original_is_untouched(client, redis_client, keys) -> None:
    original = client.submit(MODEL, [1, 2], priority=2, request_id="reused-1")
    before = redis_client.hgetall(keys.request(original))
    with pytest.raises(ConflictError, match="already in use"):
        client.submit(MODEL, [3], priority=1, request_id="reused-1")
    assert redis_client.hgetall(keys.request(original)) == before, "the original's hash is untouched"
    assert client.queue_depth(MODEL) == {0: 0, 1: 0, 2: 1, 3: 0}, "the refused request has no entry"
    assert client.cancel(original) is True  # once final, the id stays taken
    with pytest.raises(ConflictError, match="cancelled"):
        client.submit(MODEL, [3], request_id="reused-1")
    # A request refused as overloaded leaves nothing behind: its id is free again.
    for _ in range(2):
        client.submit(MODEL, [1], priority=1)
    with pytest.raises(OverloadedError):
        client.submit(MODEL, [1], priority=0, request_id="refused-1")
    assert client.status("refused-1") is None
    take_one(redis_client, keys, 1)
    assert client.submit(MODEL, [1], priority=0, request_id="refused-1") == "refused-1"


def test_stream_replays_the_log_then_follows_live_without_duplicates(client, redis_client, keys) -> None:
    request_id = client.submit(MODEL, [1])
    for i in range(3):
        emit(redis_client, keys, token(request_id, i))

    def worker() -> None:
        wait_subscribed(redis_client, keys, request_id)
        emit(redis_client, keys, token(request_id, 1))  # a taken-over request may republish
        for i in range(3, 6):
            emit(redis_client, keys, token(request_id, i))
        emit(redis_client, keys, done(request_id, 6))

    thread = threading.Thread(target=worker)
    thread.start()
    events = list(client.stream(request_id, timeout=10))
    thread.join()
    assert [e.index for e in events[:-1]] == [0, 1, 2, 3, 4, 5]
    assert isinstance(events[-1], DoneEvent)


def test_stream_fills_a_missed_live_event_from_the_log(client, redis_client, keys) -> None:
    request_id = client.submit(MODEL, [1])

    def worker() -> None:
        wait_subscribed(redis_client, keys, request_id)
        redis_client.xadd(keys.replay_log(request_id), {LOG_FIELD: token(request_id, 0).to_json()})
        emit(redis_client, keys, token(request_id, 1))
        emit(redis_client, keys, done(request_id, 2))

    thread = threading.Thread(target=worker)
    thread.start()
    events = list(client.stream(request_id, timeout=10))
    thread.join()
    assert [e.index for e in events[:-1]] == [0, 1]


def test_stream_never_ends_before_the_tokens_its_end_accounts_for(client, redis_client, keys) -> None:
    request_id = client.submit(MODEL, [1])

    def worker() -> None:
        wait_subscribed(redis_client, keys, request_id)
        for i in range(2):  # in the log, but their live messages were lost
            redis_client.xadd(keys.replay_log(request_id), {LOG_FIELD: token(request_id, i).to_json()})
        emit(redis_client, keys, done(request_id, 2))

    thread = threading.Thread(target=worker)
    thread.start()
    events = list(client.stream(request_id, timeout=10))
    thread.join()
    assert [e.index for e in events[:-1]] == [0, 1] and isinstance(events[-1], DoneEvent)


def test_stream_from_index_skips_what_the_caller_has(client, redis_client, keys) -> None:
    request_id = client.submit(MODEL, [1])
    for i in range(4):
        emit(redis_client, keys, token(request_id, i))
    emit(redis_client, keys, done(request_id, 4))
    events = list(client.stream(request_id, from_index=2, timeout=5))
    assert [e.index for e in events[:-1]] == [2, 3]


def test_cancel_of_a_queued_request_is_final_at_once(client) -> None:
    request_id = client.submit(MODEL, [1])
    assert client.cancel(request_id) is True
    info = client.status(request_id)
    assert info is not None and info.status is RequestStatus.CANCELLED
    events = list(client.stream(request_id, timeout=5))
    assert isinstance(events[-1], ErrorEvent) and events[-1].error_type == "cancelled"
    with pytest.raises(CancelledError):
        client.result(request_id, timeout=5)
    assert client.cancel(request_id) is False


def test_concurrent_submits_never_overfill_the_queue(client, redis_client, keys) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def attempt(_: int) -> bool:
        try:
            client.submit(MODEL, [1], priority=2)
            return True
        except OverloadedError:
            return False

    with ThreadPoolExecutor(8) as pool:
        accepted = sum(pool.map(attempt, range(24)))
    assert accepted == 3
    assert client.queue_depth(MODEL)[2] == 3


def test_unknown_requests_are_not_found(client) -> None:
    assert client.status("nope") is None
    with pytest.raises(NotFoundError):
        client.result("nope", timeout=2)
    with pytest.raises(NotFoundError):
        list(client.stream("nope", timeout=2))
    with pytest.raises(NotFoundError):
        client.cancel("nope")


def test_result_waits_for_the_done_event(client, redis_client, keys) -> None:
    request_id = client.submit(MODEL, [1])

    def worker() -> None:
        wait_subscribed(redis_client, keys, request_id)
        emit(redis_client, keys, done(request_id, 2))

    threading.Thread(target=worker).start()
    assert client.result(request_id, timeout=10).token_ids == [100, 101]
    with pytest.raises(TimeoutError):
        client.result(client.submit(MODEL, [1]), timeout=0.5)


def test_async_client_has_the_same_behaviour(client_settings, redis_client, keys) -> None:
    async def scenario() -> None:
        async with AsyncQueueClient(client_settings) as queue:
            assert await queue.ping()
            request_id = await queue.submit(MODEL, [5, 6], priority=0)
            assert (await queue.queue_depth(MODEL))[0] == 1
            emit(redis_client, keys, token(request_id, 0))

            async def worker() -> None:
                await asyncio.to_thread(wait_subscribed, redis_client, keys, request_id)
                emit(redis_client, keys, token(request_id, 0))
                emit(redis_client, keys, token(request_id, 1))
                emit(redis_client, keys, done(request_id, 2))

            task = asyncio.create_task(worker())
            events = [event async for event in queue.stream(request_id, timeout=10)]
            await task
            assert [e.index for e in events[:-1]] == [0, 1]
            assert (await queue.result(request_id)).text == "t0t1"
            other = await queue.submit(MODEL, [1])
            assert await queue.cancel(other)
            info = await queue.status(other)
            assert info is not None and info.status is RequestStatus.CANCELLED
            assert await queue.live_workers() == []

    asyncio.run(scenario())


def test_one_async_client_follows_more_streams_than_redis_py_default_pool(redis_url, key_prefix) -> None:
    """Each followed stream holds a pub/sub connection; 150 at once must not exhaust the pool."""
    settings = Settings(redis_url=redis_url, key_prefix=key_prefix, max_queue_depth=1000)

    async def scenario() -> None:
        async with AsyncQueueClient(settings) as queue:
            ids = [await queue.submit(MODEL, [1]) for _ in range(150)]

            async def follow(request_id: str) -> str:
                events = [event async for event in queue.stream(request_id, timeout=30)]
                return events[-1].error_type  # type: ignore[union-attr]

            followers = [asyncio.create_task(follow(request_id)) for request_id in ids]
            # Every follower subscribed and waiting (Redis counts them), then all are cancelled.
            channels = [queue.keys.tokens_channel(request_id) for request_id in ids]
            while not all(count >= 1 for _, count in await queue.redis.pubsub_numsub(*channels)):
                assert not any(f.done() for f in followers), [f.result() for f in followers if f.done()][:1]
                await asyncio.sleep(0.02)
            for request_id in ids:
                await queue.cancel(request_id)
            assert await asyncio.gather(*followers) == ["cancelled"] * 150

    asyncio.run(scenario())


def test_a_stream_resumed_while_the_left_one_is_still_unsubscribing_is_confirmed(
    client, client_settings, redis_client, keys, monkeypatch
) -> None:
    """A job's stream resumed (Last-Event-ID) right after its client left the first one: the hub
    unsubscribes the channel (its last follower left), then subscribes it again for the resumed
    stream, and the reply to the unsubscription comes back after the new subscription went out (a
    loaded machine; here held until then, so the order is certain). On a Cluster that reply is an
    ``sunsubscribe``, which Redis also sends when a slot moves away: taken for a move, it dropped
    the new subscription's confirmation, and the resumed stream ended SUBSCRIBE_S later with an
    error instead of its tokens (a flaky API test on the Cluster). Fails if the hub mistakes its
    own unsubscription's reply for a slot move."""
    dispatch = ChannelHub._dispatch
    held: list[str] = []

    async def unsubscribe_reply_after_the_resubscription(self, listener, message):  # type: ignore[no-untyped-def]
        channel = message.get("channel")
        if message["type"] in ("unsubscribe", "sunsubscribe") and not held:
            held.append(channel)
            deadline = time.monotonic() + 30
            while channel not in listener.channels:  # until the resumed stream's subscription is sent
                assert time.monotonic() < deadline, "the resumed stream never subscribed"
                await asyncio.sleep(0.01)
        await dispatch(self, listener, message)

    monkeypatch.setattr(ChannelHub, "_dispatch", unsubscribe_reply_after_the_resubscription)
    request_id = client.submit(MODEL, [1])
    emit(redis_client, keys, token(request_id, 0))

    def worker() -> None:
        wait_subscribed(redis_client, keys, request_id)
        emit(redis_client, keys, token(request_id, 1))
        emit(redis_client, keys, done(request_id, 2))

    async def scenario() -> list[TokenEvent | DoneEvent | ErrorEvent]:
        async with AsyncQueueClient(client_settings) as queue:
            first = queue.stream(request_id, timeout=60)
            assert (await anext(first)).index == 0  # type: ignore[union-attr]
            await first.aclose()  # the client left: the hub unsubscribes the channel
            thread = threading.Thread(target=worker)
            thread.start()
            try:
                return [event async for event in queue.stream(request_id, from_index=1, timeout=60)]
            finally:
                await asyncio.to_thread(thread.join)

    events = asyncio.run(scenario())
    assert held == [keys.tokens_channel(request_id)]  # the reply really was held past the resubscription
    assert [e.index for e in events[:-1]] == [1] and isinstance(events[-1], DoneEvent), events


def test_a_stream_whose_live_messages_are_all_lost_still_ends(
    client, client_settings, redis_client, keys, monkeypatch
) -> None:
    """The safety net: with nothing on pub/sub, the follower's idle checks read the log and the hash.
    Counted in checks, not seconds: the "worker" writes after the first check has come back empty,
    so the second, backed-off check is what finds everything."""
    checks: dict[str, int] = {}
    idle_check = QueueCore.idle_check

    def counted(self, request_id, sequencer):  # type: ignore[no-untyped-def]
        found = yield from idle_check(self, request_id, sequencer)
        checks[request_id] = checks.get(request_id, 0) + 1
        return found

    monkeypatch.setattr(QueueCore, "idle_check", counted)

    def worker_writing_only_the_log(request_id: str) -> None:
        deadline = time.monotonic() + 30
        while not checks.get(request_id):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for event in (token(request_id, 0), token(request_id, 1), done(request_id, 2)):
            emit_log_only(redis_client, keys, event)

    request_id = client.submit(MODEL, [1])
    threading.Thread(target=worker_writing_only_the_log, args=(request_id,)).start()
    events = list(client.stream(request_id, timeout=60))
    assert [e.index for e in events[:-1]] == [0, 1] and isinstance(events[-1], DoneEvent)
    assert checks[request_id] == 2  # found at the second check

    async def scenario() -> tuple[str, list]:
        async with AsyncQueueClient(client_settings) as queue:
            other = await queue.submit(MODEL, [1])
            threading.Thread(target=worker_writing_only_the_log, args=(other,)).start()
            return other, [event async for event in queue.stream(other, timeout=60)]

    other, events = asyncio.run(scenario())
    assert [e.index for e in events[:-1]] == [0, 1] and isinstance(events[-1], DoneEvent)
    assert checks[other] == 2


def test_the_idle_check_reads_log_and_status_in_one_round_trip_and_tells_a_queued_request(
    client, client_settings, redis_client, keys
) -> None:
    request_id = client.submit(MODEL, [1])
    calls = []
    original = client.redis.pipeline

    def counting_pipeline(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("pipeline")
        return original(*args, **kwargs)

    client.redis.pipeline = counting_pipeline  # type: ignore[method-assign]
    try:
        assert client._idle_check(request_id, EventSequencer()) == ([], True)
        redis_client.hset(keys.request(request_id), "status", RequestStatus.RUNNING.value)
        emit_log_only(redis_client, keys, token(request_id, 0))
        events, queued = client._idle_check(request_id, EventSequencer())
        assert [e.index for e in events] == [0] and not queued
    finally:
        client.redis.pipeline = original  # type: ignore[method-assign]
    assert calls == ["pipeline", "pipeline"]

    async def scenario() -> tuple[list, bool]:
        async with AsyncQueueClient(client_settings) as queue:
            return await queue._idle_check(request_id, EventSequencer())

    events, queued = asyncio.run(scenario())
    assert [e.index for e in events] == [0] and not queued


def emit_log_only(r: redis.Redis, keys: Keys, event: TokenEvent | DoneEvent) -> None:
    r.xadd(keys.replay_log(event.request_id), {LOG_FIELD: event.to_json()})


def within(wait: float, nominal: float) -> bool:
    """Checks are jittered: between half and all of the nominal wait, so streams opened together
    do not check (and take pooled connections) together."""
    return nominal / 2 <= wait <= nominal


def test_idle_checks_back_off_while_silent_and_reset_on_news() -> None:
    idle = IdleBackoff()
    waits = []
    for _ in range(6):
        waits.append(idle.timeout(None))
        idle.silent()
    assert all(within(w, n) for w, n in zip(waits, [1.0, 2.0, 4.0, 8.0, 8.0, 8.0], strict=True)), waits
    assert IDLE_CHECK_MAX_S == 8.0
    idle.heard()
    assert within(idle.timeout(None), IDLE_CHECK_S)
    for _ in range(6):  # a request still in the queue has published nothing that could be lost
        idle.silent(queued=True)
    assert within(idle.timeout(None), QUEUED_CHECK_MAX_S) and QUEUED_CHECK_MAX_S == 30.0
    idle.silent()  # started, and silent: back under the tighter cap
    assert within(idle.timeout(None), IDLE_CHECK_MAX_S)
    # Spread: a thousand followers silent alike do not all wait the same.
    spread = {round(IdleBackoff().timeout(None), 3) for _ in range(1000)}
    assert len(spread) > 100
    idle.heard()
    assert idle.timeout(time.monotonic() + 0.25) <= 0.25  # never past the stream's deadline
    with pytest.raises(TimeoutError):
        idle.timeout(time.monotonic() - 1)


@pytest.mark.parametrize(
    "torn_down",
    [
        AttributeError("'NoneType' object has no attribute 'writelines'"),  # asyncio's loop
        RuntimeError("unable to perform operation on <TCPTransport closed=True reading=False>; the handler is closed"),
    ],
)
def test_a_connection_torn_down_mid_handshake_is_a_lost_connection_not_a_crash(client_settings, torn_down) -> None:
    # Seen in a Cluster failover: without the conversion the API answered 500 (and the Cluster
    # failover test's client saw its connection reset) instead of 503 with Retry-After.
    async def scenario() -> None:
        async with AsyncQueueClient(client_settings) as queue:

            async def tear_down(*args: object, **kwargs: object) -> None:
                raise torn_down

            queue.redis.evalsha = tear_down  # type: ignore[method-assign]
            with pytest.raises(redis.ConnectionError, match="connection lost while it was opened"):
                await queue.submit(MODEL, [5, 6])
            # Anything else stays what it is.
            queue.redis.evalsha = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug"))  # type: ignore[method-assign]
            with pytest.raises(RuntimeError, match="a bug"):
                await queue.submit(MODEL, [5, 6])

    asyncio.run(scenario())
