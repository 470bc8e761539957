"""The worker's Redis side in-process, fast: the intake (worker/intake.py), acceptance
(worker/acceptance.py) and publisher (worker/publisher.py) against a real Redis, with the engine
replaced by the load report it would give. What the intake hands to the engine is recorded; no
model runs, so each case takes milliseconds (these are the mutation check's subset)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from shared.client import QueueClient
from shared.event_delivery import LOG_FIELD
from shared.keys import CONSUMER_GROUP, Keys
from shared.request_lifecycle import RequestStatus
from shared.schemas import DeadLetter, DoneEvent, ErrorEvent, FinalResult, SamplingSpec, TokenEvent, WorkerHeartbeat
from shared.settings import Settings
from shared.work_queue import STREAM_FIELD
from worker import intake as intake_module
from worker import publisher as publisher_module
from worker.acceptance import Acceptance
from worker.active import ActiveRequest
from worker.engine import EngineEvent
from worker.engine.core.policy import Capacity, EngineLoad, RunningLoad, Urgency
from worker.intake import Intake, WorkerLoad
from worker.publisher import Publisher
from worker.run_state import RunState

MODEL = "m"
SPEC = SamplingSpec(max_new_tokens=4)


@dataclass
class Harness:
    settings: Settings
    redis: redis.Redis
    client: QueueClient
    publisher: Publisher
    acceptance: Acceptance
    intake: Intake
    handed: list[ActiveRequest] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    load: EngineLoad = field(default_factory=lambda: EngineLoad(max_num_seqs=2, block_size=4, spare_blocks=1000))
    idle: bool = False

    def submit(self, priority: int, prompt: list[int] | None = None, **options: Any) -> str:
        return self.client.submit(MODEL, prompt or [1, 2, 3], SPEC, priority=priority, **options)

    def taken(self) -> list[str]:
        return [a.id for a in self.handed]

    def status(self, request_id: str) -> RequestStatus:
        info = self.client.status(request_id)
        assert info is not None
        return info.status


def make_harness(redis_url: str, key_prefix: str, **overrides: Any) -> Harness:
    settings = Settings(redis_url=redis_url, key_prefix=key_prefix, model=MODEL, **overrides)
    connection = redis.Redis.from_url(redis_url, decode_responses=True)
    publisher = Publisher(settings, connection, "w")
    publisher.start()
    counters = {"expired": 0, "taken_over": 0, "cancelled": 0, "dead_lettered": 0}
    handed: list[ActiveRequest] = []
    acceptance = Acceptance(settings, connection, publisher, "w", MODEL, handed.append, counters)
    h = Harness(settings, connection, QueueClient(settings), publisher, acceptance, None, handed, counters)  # type: ignore[arg-type]
    load = WorkerLoad(engine_load=lambda: h.load, in_transit=lambda: (), is_idle=lambda: h.idle)
    h.intake = Intake(settings, connection, acceptance, Capacity(prefetch=0), load, RunState(), name="w", model=MODEL)
    h.client.ensure_groups(MODEL)
    return h


@pytest.fixture
def h(redis_url: str, key_prefix: str) -> Iterator[Harness]:
    harness = make_harness(redis_url, key_prefix)
    yield harness
    harness.publisher.stop()
    harness.client.close()
    harness.redis.close()


def flushed(h: Harness) -> None:
    assert h.publisher.flush(10), "the publisher did not reach Redis"


# The intake: strict priority, room, urgency ---------------------------------------------------


def test_the_most_urgent_stream_is_read_first_and_only_what_fits(h: Harness) -> None:
    low, urgent, middle = h.submit(2), h.submit(0), h.submit(1)
    h.load = EngineLoad(max_num_seqs=1, block_size=4, spare_blocks=1000)  # one slot
    assert h.intake.read_once() == "took"
    assert h.taken() == [urgent]
    assert h.status(urgent) is RequestStatus.RUNNING and h.status(middle) is RequestStatus.QUEUED
    h.load = EngineLoad(max_num_seqs=3, block_size=4, num_seqs=1, spare_blocks=1000)  # two more
    assert h.intake.read_once() == "took"
    assert h.taken() == [urgent, middle, low]
    assert h.intake.read_once() == "empty"


def test_a_stream_with_work_left_keeps_less_urgent_streams_waiting(h: Harness) -> None:
    first, second = h.submit(1), h.submit(1)
    later = h.submit(2)
    h.load = EngineLoad(max_num_seqs=1, block_size=4, spare_blocks=1000)
    assert h.intake.read_once() == "took"
    assert h.taken() == [first]
    h.load = EngineLoad(max_num_seqs=2, block_size=4, num_seqs=1, spare_blocks=1000)
    h.intake.read_once()
    assert h.taken() == [first, second]
    assert h.status(later) is RequestStatus.QUEUED


def test_work_that_does_not_fit_the_kv_blocks_stays_in_redis(h: Harness) -> None:
    big = h.submit(1, prompt=list(range(1, 41)))  # 40 tokens: 11 blocks of 4 with the next token
    h.load = EngineLoad(max_num_seqs=4, block_size=4, num_seqs=1, spare_blocks=10)
    assert h.intake.read_once() == "blocked"
    assert h.taken() == [] and h.status(big) is RequestStatus.QUEUED
    h.idle = True  # an idle engine takes the first entry whatever its size
    h.load = EngineLoad(max_num_seqs=4, block_size=4, num_seqs=0, spare_blocks=10)
    assert h.intake.read_once() == "took" and h.taken() == [big]


def full_with(priority: float) -> EngineLoad:
    return EngineLoad(
        max_num_seqs=1,
        block_size=4,
        num_seqs=1,
        spare_blocks=0,
        running=(RunningLoad(Urgency(priority, 0), 10),),
        waiting=(),
    )


def test_a_full_worker_takes_only_what_would_preempt_its_least_urgent_sequence(h: Harness) -> None:
    same, urgent = h.submit(2), h.submit(0)
    h.load = full_with(2.0)
    assert h.intake.read_once() == "took"
    assert h.taken() == [urgent]  # p0 would preempt the p2 sequence; another p2 would not
    assert h.status(same) is RequestStatus.QUEUED
    h.load = full_with(0.0)  # nothing runs that anything could preempt: no stream is even read
    assert h.intake.read_once() == "blocked"
    assert h.taken() == [urgent]


def test_urgent_work_is_left_to_a_worker_with_a_free_slot_for_the_handoff_time(redis_url: str, key_prefix: str) -> None:
    h = make_harness(redis_url, key_prefix, urgent_handoff_s=0.3)
    try:
        beat = WorkerHeartbeat(
            name="free", model=MODEL, device="cpu", dtype="float32", max_num_seqs=2, num_kv_blocks=10,
            running=1, waiting=0, free_kv_blocks=10, started_at=time.time(),
        )  # fmt: skip
        h.redis.set(h.intake.keys.worker("free"), beat.model_dump_json())
        h.redis.zadd(h.intake.keys.workers(), {"free": time.time(), "w": time.time()})
        urgent = h.submit(0)
        h.load = full_with(2.0)
        assert h.intake.read_once() == "blocked"  # left for "free", which has a slot
        assert h.taken() == []
        first_look = time.monotonic()
        while time.monotonic() - first_look < 0.35:  # past the handoff time (a lower bound: no race)
            time.sleep(0.05)
        assert h.intake.read_once() == "took" and h.taken() == [urgent]
    finally:
        h.publisher.stop()
        h.client.close()


def test_a_draining_or_full_other_worker_does_not_hold_urgent_work_back(h: Harness) -> None:
    for name, running, draining in (("busy", 2, False), ("leaving", 0, True)):
        beat = WorkerHeartbeat(
            name=name, model=MODEL, device="cpu", dtype="float32", max_num_seqs=2, num_kv_blocks=10,
            running=running, waiting=0, free_kv_blocks=10, started_at=time.time(), draining=draining,
        )  # fmt: skip
        h.redis.set(h.intake.keys.worker(name), beat.model_dump_json())
        h.redis.zadd(h.intake.keys.workers(), {name: time.time()})
    urgent = h.submit(0)
    h.load = full_with(2.0)
    assert h.intake.read_once() == "took" and h.taken() == [urgent]


def test_a_missing_consumer_group_is_recreated(h: Harness) -> None:
    stream = h.intake.streams[1]
    h.redis.delete(*h.intake.streams)
    request_id = h.submit(1)  # the client's group cache skips creating it again
    h.intake.turn()
    h.intake.turn()
    assert h.redis.xinfo_groups(stream)[0]["name"] == CONSUMER_GROUP
    assert request_id in h.taken()


# Acceptance: what happens to each entry --------------------------------------------------------


def stream_entry(h: Harness, priority: int, fields: dict[str, str]) -> str:
    return h.redis.xadd(h.intake.streams[priority], fields)


def test_malformed_entries_are_dead_lettered_with_their_id_when_one_can_be_salvaged(h: Harness) -> None:
    stream_entry(h, 0, {STREAM_FIELD: "{not json"})
    stream_entry(h, 0, {STREAM_FIELD: json.dumps({"id": "salvaged", "model": MODEL})})
    stream_entry(h, 0, {"other": "field"})
    h.load = EngineLoad(max_num_seqs=4, block_size=4, spare_blocks=1000)
    assert h.intake.read_once() == "empty"  # read, but nothing went to the engine
    flushed(h)
    letters = [DeadLetter.model_validate_json(f["letter"]) for f in h.client.dead_letters(MODEL)]
    assert [letter.request_id for letter in letters] == [None, "salvaged", None]
    assert all(letter.reason.startswith("malformed entry") and letter.worker == "w" for letter in letters)
    # The error's first line for what did not validate; the fields found for an entry with foreign fields.
    assert all("validation error for QueuedRequest" in letter.reason for letter in letters[:2])
    assert "fields ['other']" in letters[2].reason
    assert json.loads(letters[1].raw) == {STREAM_FIELD: json.dumps({"id": "salvaged", "model": MODEL})}
    assert h.counters["dead_lettered"] == 3 and h.handed == []
    (event,) = [e for e in h.client.stream("salvaged", timeout=10)]
    assert isinstance(event, ErrorEvent) and event.error_type == "generation"
    stream = h.intake.streams[0]
    assert h.redis.xpending(stream, CONSUMER_GROUP)["pending"] == 0 and h.redis.xlen(stream) == 0


def test_an_expired_request_ends_expired_without_reaching_the_engine(h: Harness) -> None:
    request_id = h.submit(1, deadline=time.time() - 1)
    h.intake.read_once()
    flushed(h)
    assert h.handed == [] and h.counters["expired"] == 1
    assert h.status(request_id) is RequestStatus.EXPIRED
    (event,) = list(h.client.stream(request_id, timeout=10))
    assert isinstance(event, ErrorEvent) and event.error_type == "expired"


def test_a_request_cancelled_while_running_elsewhere_is_not_started_again(h: Harness) -> None:
    request_id = h.submit(1)
    h.redis.hset(h.client.keys.request(request_id), mapping={"status": "running", "cancel_requested": "1"})
    h.intake.read_once()
    flushed(h)
    assert h.handed == [] and h.counters["cancelled"] == 1
    assert h.status(request_id) is RequestStatus.CANCELLED


def test_a_request_already_final_is_only_acknowledged(h: Harness) -> None:
    request_id = h.submit(1)
    h.redis.hset(h.client.keys.request(request_id), "status", "done")
    h.intake.read_once()
    flushed(h)
    assert h.handed == [] and h.status(request_id) is RequestStatus.DONE
    assert h.redis.xpending(h.intake.streams[1], CONSUMER_GROUP)["pending"] == 0


def test_a_deleted_pending_entry_is_acknowledged(h: Harness) -> None:
    assert h.acceptance.accept(h.intake.streams[1], "1-1", None) is False
    assert h.acceptance.accept(h.intake.streams[1], "1-2", {}) is False
    assert h.handed == []


def test_a_redelivered_request_resumes_from_its_replay_log(h: Harness) -> None:
    request_id = h.submit(1)
    h.intake.read_once()
    (first,) = h.handed
    assert first.attempt == 0 and first.prior_token_ids == []
    log = h.client.keys.replay_log(request_id)
    for index, token_id in ((0, 11), (1, 12), (1, 12), (3, 14)):  # a duplicate, then a hole: stop there
        event = TokenEvent(request_id=request_id, index=index, token_id=token_id, text=f"<{token_id}>")
        h.redis.xadd(log, {LOG_FIELD: event.to_json()})
    stream, entry_id = first.stream, first.entry_id
    fields = {STREAM_FIELD: h.redis.xrange(stream, entry_id, entry_id)[0][1][STREAM_FIELD]}
    assert h.acceptance.accept(stream, entry_id, fields) is True  # a takeover re-reads the same entry
    resumed = h.handed[-1]
    assert resumed.prior_token_ids == [11, 12] and resumed.prior_text == "<11><12>"
    assert resumed.attempt == 1 and h.counters["taken_over"] == 1


def test_a_request_delivered_too_often_is_dead_lettered(redis_url: str, key_prefix: str) -> None:
    h = make_harness(redis_url, key_prefix, max_deliveries=1)
    try:
        request_id = h.submit(1)
        h.intake.read_once()
        active = h.handed[0]
        fields = {STREAM_FIELD: h.redis.xrange(active.stream, active.entry_id, active.entry_id)[0][1][STREAM_FIELD]}
        assert h.acceptance.accept(active.stream, active.entry_id, fields) is False
        flushed(h)
        (letter,) = [DeadLetter.model_validate_json(f["letter"]) for f in h.client.dead_letters(MODEL)]
        assert letter.request_id == request_id and "delivered 1 times" in letter.reason
        assert json.loads(letter.raw) == fields  # the entry as it was in the stream
        assert h.status(request_id) is RequestStatus.FAILED and h.counters["dead_lettered"] == 1
    finally:
        h.publisher.stop()
        h.client.close()


def test_prompt_length_of_an_unreadable_entry_is_zero() -> None:
    assert Acceptance.prompt_length({STREAM_FIELD: json.dumps({"prompt_token_ids": [1, 2, 3]})}) == 3
    for fields in (None, {}, {STREAM_FIELD: "{"}, {STREAM_FIELD: "[]"}, {STREAM_FIELD: json.dumps({"x": 1})}):
        assert Acceptance.prompt_length(fields) == 0


# The publisher --------------------------------------------------------------------------------


def test_the_publisher_logs_then_publishes_every_token_and_the_final_result(h: Harness) -> None:
    request_id = h.submit(1)
    h.intake.read_once()
    (active,) = h.handed
    channel = h.client.keys.tokens_channel(request_id)
    with h.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
        pubsub.subscribe(channel)
        while pubsub.get_message(timeout=1.0) is None and not h.redis.pubsub_numsub(channel)[0][1]:
            pass
        events = [EngineEvent(request_id, i, 100 + i, f"t{i}") for i in range(2)]
        events.append(
            EngineEvent(request_id, 2, 102, "t2", finish_reason="length")
        )  # the last token, as the engine ends it
        h.publisher.publish_tokens([(events[0], 0), (EngineEvent(request_id, 1, -1, ""), 0)])  # no token: skipped
        h.publisher.publish_tokens([(e, 2) for e in events[1:]])
        result = FinalResult(
            request_id=request_id, model=MODEL, token_ids=[100, 101, 102], text="t0t1t2", finish_reason="length",
            usage={"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
            timings={"submitted_at": time.time()}, worker="w",
        )  # fmt: skip
        h.publisher.finish_done(active.stream, active.entry_id, result)
        flushed(h)
        live = []
        while len(live) < 4:
            message = pubsub.get_message(timeout=5.0)
            assert message is not None, f"only {len(live)} live messages"
            live.append(json.loads(message["data"]))
    logged = [json.loads(f[LOG_FIELD]) for _, f in h.redis.xrange(h.client.keys.replay_log(request_id))]
    assert live == logged
    assert [(e["index"], e["token_id"], e.get("attempt", 0), e.get("finish_reason")) for e in logged[:3]] == [
        (0, 100, 0, None),
        (1, 101, 2, None),
        (2, 102, 2, "length"),  # the request's last token, which carries its finish reason
    ]
    assert logged[3]["type"] == "done"
    assert h.client.result(request_id, timeout=5) == result
    assert h.status(request_id) is RequestStatus.DONE
    assert h.redis.xpending(active.stream, CONSUMER_GROUP)["pending"] == 0 and h.redis.xlen(active.stream) == 0
    ttl = h.redis.ttl(h.client.keys.replay_log(request_id))
    assert 0 < ttl <= h.settings.result_ttl_s
    assert h.publisher.events_sent == 3


def test_a_backlog_is_sent_in_calls_of_bounded_size_in_order(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publisher_module, "TOKENS_PER_CALL", 2)
    request_id = h.submit(1)
    last = EngineEvent(request_id, 4, 4, "4", finish_reason="stop_sequence")
    h.publisher.publish_tokens([*((EngineEvent(request_id, i, i, str(i)), 0) for i in range(4)), (last, 0)])
    flushed(h)
    logged = [json.loads(f[LOG_FIELD]) for _, f in h.redis.xrange(h.client.keys.replay_log(request_id))]
    assert [e["index"] for e in logged] == [0, 1, 2, 3, 4]
    assert logged[-1]["finish_reason"] == "stop_sequence"
    assert h.publisher.round_trips >= 1 and h.publisher.events_sent == 5


def test_finish_error_and_ack_and_flush(h: Harness) -> None:
    request_id = h.submit(1)
    h.intake.read_once()
    (active,) = h.handed
    h.publisher.finish_error(request_id, active.stream, active.entry_id, "failed", "generation", "boom", 4)
    assert h.publisher.flush(10)
    (event,) = list(h.client.stream(request_id, timeout=5))
    assert isinstance(event, ErrorEvent) and (event.error_type, event.message, event.index) == ("generation", "boom", 4)
    assert h.status(request_id) is RequestStatus.FAILED
    assert h.redis.xpending(active.stream, CONSUMER_GROUP)["pending"] == 0
    other = h.submit(2)
    h.load = EngineLoad(max_num_seqs=4, block_size=4, spare_blocks=1000)
    h.intake.read_once()
    taken = h.handed[-1]
    assert taken.id == other
    h.publisher.ack(taken.stream, taken.entry_id)
    assert h.publisher.flush(10)
    assert h.redis.xlen(taken.stream) == 0 and h.redis.xpending(taken.stream, CONSUMER_GROUP)["pending"] == 0


def test_done_event_matches_the_result(h: Harness) -> None:
    # The terminal event a follower sees carries the stored result, unchanged.
    request_id = h.submit(1)
    h.intake.read_once()
    (active,) = h.handed
    result = FinalResult(
        request_id=request_id, model=MODEL, token_ids=[], text="", finish_reason="length",
        usage={"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3},
        timings={"submitted_at": time.time()}, worker="w",
    )  # fmt: skip
    h.publisher.finish_done(active.stream, active.entry_id, result)
    flushed(h)
    (event,) = list(h.client.stream(request_id, timeout=5))
    assert isinstance(event, DoneEvent) and event.result == result


# What the intake waits on between looks ---------------------------------------------------------


class Waits:
    """Records the intake's waits instead of waiting."""

    def __init__(self, h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
        self.blpop: list[float] = []
        self.capacity: list[float] = []
        monkeypatch.setattr(h.intake.redis, "blpop", lambda keys, timeout: self.blpop.append(timeout))
        monkeypatch.setattr(h.intake.state.capacity_changed, "wait", lambda timeout: self.capacity.append(timeout))


def test_an_idle_worker_with_room_blocks_on_the_wakeup_list(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    waits = Waits(h, monkeypatch)
    h.intake.turn()  # nothing queued, room for two
    # prefix affinity is on: it looks again within the steal bound (500 ms), as offers become its to take
    assert h.settings.affinity and h.settings.affinity_steal_after_ms == 500
    assert waits.blpop == [0.5] and waits.capacity == []


def test_a_worker_that_took_work_looks_again_at_once(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    waits = Waits(h, monkeypatch)
    h.submit(1)
    h.intake.turn()
    assert len(h.handed) == 1 and waits.blpop == [] and waits.capacity == []


@pytest.mark.parametrize(("seqs", "running", "wait"), [(2, 1.0, "urgent"), (2, 0.0, "idle"), (3, 2.0, "urgent")])
def test_a_full_worker_never_takes_wakeups_meant_for_idle_ones(
    h: Harness, monkeypatch: pytest.MonkeyPatch, seqs: int, running: float, wait: str
) -> None:
    # Full (room 0) or over-full (room < 0): it waits for a freed slot, looking for urgent work every
    # urgent_poll_s while something it runs could be preempted (else every IDLE_BLOCK_S).
    waits = Waits(h, monkeypatch)
    h.load = EngineLoad(
        max_num_seqs=2,
        block_size=4,
        num_seqs=seqs,
        running=tuple(RunningLoad(Urgency(running, i), 4) for i in range(seqs)),
    )
    h.intake.turn()
    expected = h.settings.urgent_poll_s if wait == "urgent" else intake_module.IDLE_BLOCK_S
    assert waits.blpop == [] and waits.capacity == [expected]


def test_a_full_worker_running_low_priority_work_takes_any_more_urgent_entry(h: Harness) -> None:
    # Running priority-3 work: entries of priorities 0, 1 and 2 are all worth preempting it for.
    second = h.submit(1)
    h.load = full_with(3.0)
    assert h.intake.read_once() == "took" and h.taken() == [second]


def test_one_victim_takes_one_urgent_entry_even_when_the_handoff_time_is_over(redis_url: str, key_prefix: str) -> None:
    h = make_harness(redis_url, key_prefix, urgent_handoff_s=0)
    try:
        other_worker(h, "free", running=0)
        first, second = h.submit(0), h.submit(0)
        h.load = full_with(2.0)  # one p2 sequence to preempt
        assert h.intake.read_once() == "took"
        assert h.taken() == [first] and h.status(second) is RequestStatus.QUEUED
    finally:
        h.publisher.stop()
        h.client.close()


def test_every_other_worker_is_asked_for_a_free_slot(redis_url: str, key_prefix: str) -> None:
    h = make_harness(redis_url, key_prefix, urgent_handoff_s=600)
    try:
        for i, name in enumerate(("busy-1", "busy-2", "busy-3")):
            other_worker(h, name, running=2, score=time.time() - 10 + i)
        other_worker(h, "free", running=0, score=time.time())  # listed last
        h.submit(0)
        h.load = full_with(2.0)
        assert h.intake.read_once() == "blocked" and h.taken() == []  # left for "free"
    finally:
        h.publisher.stop()
        h.client.close()


def other_worker(h: Harness, name: str, *, running: int, score: float | None = None) -> None:
    beat = WorkerHeartbeat(
        name=name, model=MODEL, device="cpu", dtype="float32", max_num_seqs=2, num_kv_blocks=10,
        running=running, waiting=0, free_kv_blocks=10, started_at=time.time(),
    )  # fmt: skip
    h.redis.set(h.intake.keys.worker(name), beat.model_dump_json())
    h.redis.zadd(h.intake.keys.workers(), {name: score or time.time()})


def test_a_lost_consumer_group_is_recreated_and_other_redis_errors_are_raised(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    def nogroup() -> str:
        raise redis.ResponseError("NOGROUP No such key or consumer group")

    monkeypatch.setattr(h.intake, "read_once", nogroup)
    h.redis.delete(*h.intake.streams)
    h.intake.turn()  # recreates the groups, no error
    assert all(h.redis.xinfo_groups(s)[0]["name"] == CONSUMER_GROUP for s in h.intake.streams)

    def wrongtype() -> str:
        raise redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

    monkeypatch.setattr(h.intake, "read_once", wrongtype)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        h.intake.turn()


def test_a_salvaged_id_is_at_most_128_characters(h: Harness) -> None:
    for request_id in ("a" * 128, "b" * 129, ""):
        stream_entry(h, 0, {STREAM_FIELD: json.dumps({"id": request_id, "model": MODEL})})
    h.load = EngineLoad(max_num_seqs=4, block_size=4, spare_blocks=1000)
    h.intake.read_once()
    flushed(h)
    letters = [DeadLetter.model_validate_json(f["letter"]) for f in h.client.dead_letters(MODEL)]
    assert [letter.request_id for letter in letters] == ["a" * 128, None, None]


def test_the_publisher_sends_again_what_a_redis_outage_interrupted(key_prefix: str) -> None:
    """A round trip that fails with the connection (Redis restarting) is rebuilt and sent once Redis
    is back; nothing handed over is lost (the restarted server here keeps nothing else)."""
    from inflightq_cli.redis_server import PrivateRedis, free_port

    port = free_port()
    server = PrivateRedis(port=port).start()
    settings = Settings(redis_url=server.url, key_prefix=key_prefix, model=MODEL)
    connection = redis.Redis.from_url(server.url, decode_responses=True)
    publisher = Publisher(settings, connection, "w")
    publisher.start()
    try:
        publisher.publish_tokens([(EngineEvent("r", 0, 7, "a"), 0)])
        assert publisher.flush(10)
        server.stop()
        publisher.publish_tokens([(EngineEvent("r", 1, 8, "b"), 0)])
        assert not publisher.flush(0.5), "nothing can reach a Redis that is down"
        server = PrivateRedis(port=port).start()
        assert publisher.flush(60), "sent again once Redis is back"
        log = connection.xrange(Keys.for_prefix(key_prefix).replay_log("r"))
        assert [json.loads(f[LOG_FIELD])["index"] for _, f in log] == [1]
        assert publisher.is_alive()
    finally:
        publisher.stop(timeout=2)
        connection.close()
        server.stop()


def test_flush_after_hundreds_of_writes_says_everything_was_sent(h: Harness) -> None:
    request_id = h.submit(1)
    for i in range(300):  # more handed-over writes than CPython caches small ints for
        h.publisher.publish_tokens([(EngineEvent(request_id, i, i, "x"), 0)])
    assert h.publisher.flush(60)
    assert h.redis.xlen(h.client.keys.replay_log(request_id)) == 300


def test_a_publisher_stopped_while_redis_is_down_ends(key_prefix: str) -> None:
    from inflightq_cli.redis_server import PrivateRedis, free_port

    server = PrivateRedis(port=free_port()).start()
    connection = redis.Redis.from_url(server.url, decode_responses=True)
    publisher = Publisher(Settings(redis_url=server.url, key_prefix=key_prefix, model=MODEL), connection, "w")
    publisher.start()
    try:
        server.stop()
        publisher.publish_tokens([(EngineEvent("r", 0, 7, "a"), 0)])
        publisher.stop(timeout=0.5)
        publisher.join(timeout=60)  # it gives up on what Redis cannot take, instead of retrying forever
        assert not publisher.is_alive()
    finally:
        connection.close()
