"""The live token path, proven step by step: every token reaches its consumer through Redis pub/sub
while the worker still waits to compute the next one.

The worker here is paced by the test (tests/worker/paced_worker.py: each forward of a request waits
for a permit the test pushes), and the followers' safety net (re-reading the replay log after a
silent wait) is turned off, so the only way a token can arrive is the one the design rests on:
published by the worker on ``Keys.tokens_channel(<id>)`` in the step that made it, relayed by whoever
follows it. Without the pacing, a broken subscription or a publisher that holds tokens back still
passes every other test: the safety net delivers everything, a second late, in bursts.

Verified by mutation (the commit says how): subscribing to a wrong channel in the client or a
publisher writing to a wrong channel makes every test here fail. A subscription that drops what it
receives still delivers on time (each message wakes its follower, which then reads the log), so the
followers' tests also require that nothing came from the log's idle check."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from shared.async_client import AsyncQueueClient
from shared.client import QueueClient
from shared.client_core import IdleBackoff, QueueCore, remaining
from shared.keys import Keys
from shared.schemas import DoneEvent, SamplingSpec
from shared.settings import Settings
from tests.api.conftest import ApiServer, WorkerProcess, wait_for_workers
from tests.worker import paced_worker

pytestmark = pytest.mark.timeout(300)

TOKENS = 5  # per paced request: enough steps to tell "one at a time" from "all at the end"
# How long one token may take to arrive once its step is allowed. Only a deadline for a failing
# run (a broken path never delivers): a working one delivers in milliseconds, even when loaded.
ARRIVAL_DEADLINE_S = 60.0
PROMPT = [5, 17, 29, 41, 53, 65]


@pytest.fixture(scope="module")
def paced(
    redis_url: str,
    module_prefix: str,
    tiny_model_dir: Path,
    start_api: Callable[[Settings], ApiServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ApiServer]:
    """An API with one paced worker behind it (tiny model, float64)."""
    settings = Settings(
        redis_url=redis_url,
        key_prefix=module_prefix,
        model=str(tiny_model_dir),
        heartbeat_ttl_s=3,
        no_worker_wait_s=60,
        default_max_new_tokens=TOKENS,
    )
    log = tmp_path_factory.mktemp("paced") / "worker.log"
    worker = WorkerProcess(tiny_model_dir, redis_url, module_prefix, log, script=paced_worker.SCRIPT)
    try:
        server = start_api(settings)
        with server.client() as http:
            wait_for_workers(http, settings.model, 1, [worker])
        yield server
    finally:
        worker.stop()


@dataclass
class LogReads:
    """What the followers in this process took from the replay log after a wait on pub/sub (the
    safety net's idle check). Empty while pub/sub delivers: a subscription that drops or cannot
    parse its messages still gets every token on time that way, woken by each message it dropped."""

    events: list[Any] = field(default_factory=list)

    def assert_none(self) -> None:
        assert not self.events, f"delivered by the replay log's idle check, not by pub/sub: {self.events}"


@pytest.fixture
def pubsub_only(monkeypatch: pytest.MonkeyPatch) -> LogReads:
    """Followers (the queue clients and the API, which runs in this process) never fall back to the
    replay log after a silent wait: with the fallback, a broken subscription still delivers. What
    they read from the log after any wake-up is recorded: the tests require none."""
    monkeypatch.setattr(IdleBackoff, "timeout", lambda self, deadline: remaining(deadline, 3600.0))
    reads = LogReads()
    idle_check = QueueCore.idle_check

    def recorded(self: QueueCore, request_id: str, sequencer: Any) -> Any:
        out, queued = yield from idle_check(self, request_id, sequencer)
        reads.events += out
        return out, queued

    monkeypatch.setattr(QueueCore, "idle_check", recorded)
    return reads


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def documented_channel(prefix: str, request_id: str) -> str:
    """README: consumers may subscribe to ``Keys.for_prefix(prefix).tokens_channel(id)`` directly
    (``{<prefix>/r<shard>.<n>}:tokens:<id>``: a per-request hash tag, so requests spread over a Cluster)."""
    channel = Keys.for_prefix(prefix).tokens_channel(request_id)
    assert channel.endswith(":tokens:" + request_id) and channel.startswith("{" + prefix + "/r")
    return channel


def wait_until(condition: Callable[[], bool], what: str, timeout: float = ARRIVAL_DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class Consumer:
    """Runs one consumer in a thread; what it receives, one item per token frame, lands in ``arrivals``."""

    def __init__(self, consume: Callable[[Callable[[Any], None]], None]) -> None:
        self.arrivals: queue.Queue[Any] = queue.Queue()

        def run() -> None:
            try:
                consume(self.arrivals.put)
            except BaseException as exc:  # shown by next() in the test's thread
                self.arrivals.put(exc)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def next(self, what: str) -> Any:
        try:
            item = self.arrivals.get(timeout=ARRIVAL_DEADLINE_S)
        except queue.Empty:
            raise AssertionError(f"{what} never reached the consumer through pub/sub") from None
        if isinstance(item, BaseException):
            raise item
        return item


def drive(
    r: redis.Redis, prefix: str, request_id: str, consumer: Consumer, frames: int = TOKENS, quiet_s: float = 0.0
) -> list[Any]:
    """Allows the request's steps one at a time; each step's frame must reach the consumer before
    the next step is allowed, and none may come in the ``quiet_s`` before the first step. Returns the
    steps' frames, and then whatever else the consumer sent."""
    got: list[Any] = []
    wait_until(
        lambda: r.pubsub_numsub(documented_channel(prefix, request_id))[0][1] >= 1,
        f"nobody subscribed to the request's token channel {documented_channel(prefix, request_id)}",
    )
    time.sleep(quiet_s)
    assert consumer.arrivals.empty(), f"a frame came before the first step: {consumer.arrivals.get()}"
    for step in range(frames):
        paced_worker.allow_steps(r, prefix, request_id)
        got.append(consumer.next(f"the frame of step {step} (the worker now waits for step {step + 1})"))
        # Nothing more may have come: the worker cannot have computed the next token yet.
        assert consumer.arrivals.empty() or step == frames - 1, f"more than one frame after step {step}"
    consumer.thread.join(timeout=ARRIVAL_DEADLINE_S)
    assert not consumer.thread.is_alive(), "the stream did not end after its last token"
    while not consumer.arrivals.empty():
        got.append(consumer.next("the end of the stream"))
    return got


def release_on_failure(r: redis.Redis, prefix: str, request_id: str) -> None:
    """A failed test leaves its request gated; open the gate so the worker moves on to the next test."""
    paced_worker.allow_steps(r, prefix, request_id, TOKENS + 2)


# The Python clients -------------------------------------------------------------------------


def test_sync_client_receives_each_token_before_the_next_step(paced: ApiServer, pubsub_only: LogReads, r) -> None:
    settings = paced.settings
    with QueueClient(settings) as client:
        request_id = client.submit(settings.model, PROMPT, SamplingSpec(max_new_tokens=TOKENS, ignore_eos=True))
        try:

            def consume(put: Callable[[Any], None]) -> None:
                for event in client.stream(request_id, timeout=300):
                    put(event)

            got = drive(r, settings.key_prefix, request_id, Consumer(consume))
        finally:
            release_on_failure(r, settings.key_prefix, request_id)
    tokens, (done,) = got[:TOKENS], got[TOKENS:]
    assert [t.index for t in tokens] == list(range(TOKENS))
    assert isinstance(done, DoneEvent) and done.result.token_ids == [t.token_id for t in tokens]
    pubsub_only.assert_none()


def test_async_client_receives_each_token_before_the_next_step(paced: ApiServer, pubsub_only: LogReads, r) -> None:
    settings = paced.settings
    with QueueClient(settings) as client:
        request_id = client.submit(settings.model, PROMPT, SamplingSpec(max_new_tokens=TOKENS, ignore_eos=True))

    def consume(put: Callable[[Any], None]) -> None:
        async def follow() -> None:
            async with AsyncQueueClient(settings) as aclient:
                async for event in aclient.stream(request_id, timeout=300):
                    put(event)

        asyncio.run(follow())

    try:
        got = drive(r, settings.key_prefix, request_id, Consumer(consume))
    finally:
        release_on_failure(r, settings.key_prefix, request_id)
    tokens, (done,) = got[:TOKENS], got[TOKENS:]
    assert [t.index for t in tokens] == list(range(TOKENS))
    assert isinstance(done, DoneEvent) and done.result.token_ids == [t.token_id for t in tokens]
    pubsub_only.assert_none()


# A consumer of Redis itself, by the documented contract ---------------------------------------


def test_direct_subscriber_of_the_documented_channel_gets_each_token_live(paced: ApiServer, r) -> None:
    settings = paced.settings
    with QueueClient(settings) as client:
        request_id = client.submit(settings.model, PROMPT, SamplingSpec(max_new_tokens=TOKENS, ignore_eos=True))
    subscribed = threading.Event()

    def consume(put: Callable[[Any], None]) -> None:
        with r.pubsub(ignore_subscribe_messages=True) as pubsub:
            pubsub.subscribe(documented_channel(settings.key_prefix, request_id))
            subscribed.set()
            while True:
                message = pubsub.get_message(timeout=1.0)
                if message is None:
                    continue
                event = json.loads(message["data"])  # the contract: one JSON event per message
                put(event)
                if event["type"] != "token":
                    return

    try:
        consumer = Consumer(consume)
        assert subscribed.wait(ARRIVAL_DEADLINE_S)
        got = drive(r, settings.key_prefix, request_id, consumer)
    finally:
        release_on_failure(r, settings.key_prefix, request_id)
    tokens, (done,) = got[:TOKENS], got[TOKENS:]
    assert [(t["type"], t["request_id"], t["index"]) for t in tokens] == [
        ("token", request_id, i) for i in range(TOKENS)
    ]
    assert all(isinstance(t["token_id"], int) and isinstance(t["text"], str) for t in tokens)
    assert tokens[-1]["finish_reason"] == "length"
    assert done["type"] == "done" and done["result"]["token_ids"] == [t["token_id"] for t in tokens]


# The three SSE dialects -----------------------------------------------------------------------


def sse_data(response: httpx.Response) -> Iterator[str]:
    data: list[str] = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            data.append(line[5:].strip())
        elif line == "" and data:
            yield "\n".join(data)
            data = []


def stream_route(
    paced: ApiServer,
    r: redis.Redis,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    frames: int = TOKENS,
    quiet_s: float = 0.0,
    first_two_together: bool = False,
) -> tuple[str, list[Any]]:
    """Opens an SSE route; each data frame is one item (with ``first_two_together``, the first two
    frames are one item, with the seconds between their arrivals). Returns the request id and the frames."""
    prefix = paced.settings.key_prefix
    opened: queue.Queue[str] = queue.Queue()
    request_id = ""

    def consume(put: Callable[[Any], None]) -> None:
        with paced.client() as http, http.stream(method, path, json=body) as response:
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"].startswith("text/event-stream")
            opened.put(response.headers["x-request-id"])
            held: list[tuple[Any, float]] = []
            for data in sse_data(response):
                frame = data if data == "[DONE]" else json.loads(data)
                if first_two_together and len(held) < 2:
                    held.append((frame, time.monotonic()))
                    if len(held) == 2:
                        put((held[0][0], held[1][0], held[1][1] - held[0][1]))
                else:
                    put(frame)

    consumer = Consumer(consume)
    try:
        request_id = opened.get(timeout=ARRIVAL_DEADLINE_S)
        return request_id, drive(r, prefix, request_id, consumer, frames, quiet_s)
    finally:
        if request_id:
            release_on_failure(r, prefix, request_id)


def test_tgi_generate_stream_sends_each_token_before_the_next_step(paced: ApiServer, pubsub_only: LogReads, r) -> None:
    body = {"inputs": "Hello there", "parameters": {"max_new_tokens": TOKENS, "details": True, "ignore_eos": True}}
    _, frames = stream_route(paced, r, "POST", "/generate_stream", body)
    assert len(frames) == TOKENS  # TGI: one event per token, the last one carries the result
    assert [f["generated_text"] for f in frames[:-1]] == [None] * (TOKENS - 1)
    assert frames[-1]["generated_text"] == "".join(f["token"]["text"] for f in frames)
    assert frames[-1]["details"]["finish_reason"] == "length"
    assert frames[-1]["details"]["generated_tokens"] == TOKENS
    pubsub_only.assert_none()


def test_openai_chat_stream_sends_each_token_before_the_next_step(paced: ApiServer, pubsub_only: LogReads, r) -> None:
    body = {
        "model": paced.settings.model,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    # As vLLM: nothing before the first step (a client timing its first chunk times the first token),
    # then the role chunk with the first token's, then one chunk per step.
    _, frames = stream_route(paced, r, "POST", "/v1/chat/completions", body, quiet_s=1.0, first_two_together=True)
    (role, first, apart), tokens, rest = frames[0], [frames[0][1], *frames[1:TOKENS]], frames[TOKENS:]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": "", "tool_calls": None}
    assert apart < 0.5, f"the role chunk came {apart:.2f} s before the first token's"
    assert first["choices"][0]["delta"]["content"] is not None
    # Each step's chunk carries that step's text; like TGI's, every delta also names its role and
    # carries ``tool_calls`` (null without calls): text-generation's client requires both.
    deltas = [c["choices"][0]["delta"] for c in tokens]
    assert all(isinstance(d["content"], str) and d.get("tool_calls") is None for d in deltas), tokens
    assert all(d.get("role", "assistant") == "assistant" for d in deltas), tokens
    assert [c["choices"][0]["finish_reason"] for c in rest[:-1]] == ["length"]
    assert rest[-1] == "[DONE]"
    pubsub_only.assert_none()


def test_job_stream_sends_each_token_before_the_next_step(paced: ApiServer, pubsub_only: LogReads, r) -> None:
    with paced.client() as http:
        created = http.post("/v1/jobs", json={"prompt": PROMPT, "max_new_tokens": TOKENS, "ignore_eos": True})
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    request_id, frames = stream_route(paced, r, "GET", f"/v1/jobs/{job_id}/stream", None)
    assert request_id == job_id
    assert len(frames) == TOKENS
    assert frames[-1]["details"]["finish_reason"] == "length"
    assert frames[-1]["generated_text"] == "".join(f["token"]["text"] for f in frames)
    pubsub_only.assert_none()
