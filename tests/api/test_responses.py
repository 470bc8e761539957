"""/v1/responses with the official openai SDK against a real stack (API + worker, tiny model).

Covers create (plain, streamed, stream helper), previous_response_id chains, service_tier, background
with retrieve / resumed streams (during and after generation), cancel (queued and running), delete,
input_items, the errors (404, 400 naming the parameter), and a worker SIGKILL mid-generation."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
import redis

from shared.keys import Keys
from shared.settings import Settings
from tests.api.api_process import ApiProcess, SpawnApi, spawn_api  # noqa: F401 - the fixture
from tests.api.conftest import ApiServer, WorkerProcess, wait_for_workers
from tests.worker import paced_worker

pytestmark = pytest.mark.timeout(300)


def sdk(api: ApiServer | ApiProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def wait_status(client: openai.OpenAI, response_id: str, wanted: set[str], timeout: float = 120) -> str:
    give_up = time.monotonic() + timeout
    while True:
        status = client.responses.retrieve(response_id).status
        if status in wanted or time.monotonic() > give_up:
            return str(status)
        time.sleep(0.05)


def drop_and_resume(client: openai.OpenAI, response_id: str, first: int) -> list:
    """A client reads ``first`` events, its connection drops, it resumes after the last one it saw."""
    seen = []
    stream = client.responses.retrieve(response_id, stream=True)
    for event in stream:
        seen.append(event)
        if len(seen) == first:
            break
    stream.close()
    for event in client.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number):
        seen.append(event)
    return seen


def check_sequence(events: list, *, start: int = 0) -> None:
    """Numbered from ``start`` without gap or duplicate, in the spec's order, deltas adding up."""
    assert [e.sequence_number for e in events] == list(range(start, start + len(events)))
    types = [e.type for e in events]
    if start == 0:
        assert types[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    middle = types[4 if start == 0 else 0 : -4]
    assert set(middle) <= {"response.output_text.delta"}


def test_create_retrieve_and_input_items(live_api: ApiServer) -> None:
    client = sdk(live_api)
    r = client.responses.create(
        model="tgi",
        input="Say hello.",
        instructions="Be brief.",
        max_output_tokens=8,
        temperature=0,
        top_p=0.9,
        metadata={"case": "plain"},
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and 1 <= r.usage.output_tokens <= 8 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
    assert r.metadata == {"case": "plain"} and r.instructions == "Be brief." and r.service_tier == "default"
    assert r.temperature == 0 and r.top_p == 0.9 and r.max_output_tokens == 8 and r.background is False
    again = client.responses.retrieve(r.id)
    assert again.model_dump() == r.model_dump()
    items = client.responses.input_items.list(r.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "Say hello.")]

    multi = client.responses.create(
        input=[
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        ],
        max_output_tokens=4,
        temperature=0,
    )
    listed = client.responses.input_items.list(multi.id, order="asc")
    assert [i.role for i in listed.data] == ["developer", "user"]
    assert [i.role for i in client.responses.input_items.list(multi.id).data] == ["user", "developer"]  # desc


def test_streaming_create_and_stream_helper(live_api: ApiServer) -> None:
    client = sdk(live_api)
    events = list(client.responses.create(input="Count.", max_output_tokens=12, temperature=0, stream=True))
    check_sequence(events)
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete") and final.status in (
        "completed",
        "incomplete",
    )
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    assert len([e for e in events if e.type == "response.output_text.delta"]) == final.usage.output_tokens

    # The helper wants response.completed: stop strings (an extension) end the tiny model's text early.
    stops = {"stop": ["e", "a", "o", "i", " "]}
    with client.responses.stream(model="tgi", input="Count.", max_output_tokens=200, extra_body=stops) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        helper_final = stream.get_final_response()
    assert helper_final.status == "completed" and helper_final.usage.output_tokens < 200
    assert "".join(texts) == helper_final.output_text


def test_previous_response_id_chains(live_api: ApiServer) -> None:
    client = sdk(live_api)
    first = client.responses.create(input="My name is Ada.", max_output_tokens=6, temperature=0)
    second = client.responses.create(
        input="What is my name?", previous_response_id=first.id, max_output_tokens=6, temperature=0
    )
    third = client.responses.create(
        input="And again?", previous_response_id=second.id, max_output_tokens=6, temperature=0
    )
    assert second.previous_response_id == first.id
    # The earlier turn's input and output are the new prompt's prefix.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert [i.content[0].text for i in client.responses.input_items.list(second.id).data] == ["What is my name?"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="x", previous_response_id="resp_nope")


def test_service_tier_maps_to_priority(live_api: ApiServer, redis_url: str) -> None:
    client = sdk(live_api)
    keys = Keys.for_prefix(live_api.settings.key_prefix)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    levels = live_api.settings.priority_levels
    try:
        for tier, level, echoed in (
            ("flex", levels - 1, "flex"),
            ("priority", 0, "priority"),
            ("auto", 1, "default"),
            ("default", 1, "default"),
        ):
            resp = client.responses.create(input="Hi", max_output_tokens=2, service_tier=tier)
            assert resp.service_tier == echoed
            assert r.hget(keys.request(resp.id), "priority") == str(level)
        ext = client.responses.create(input="Hi", max_output_tokens=2, extra_body={"priority": 0})
        assert ext.service_tier == "priority" and r.hget(keys.request(ext.id), "priority") == "0"
    finally:
        r.close()


def test_background_resume_during_and_after_generation(live_api: ApiServer) -> None:
    client = sdk(live_api)
    created = client.responses.create(
        input="Tell a story.", max_output_tokens=120, background=True, extra_body={"seed": 7}
    )
    assert created.status == "queued" and created.background is True and created.output == []
    seen = drop_and_resume(client, created.id, 10)
    check_sequence(seen)
    final = client.responses.retrieve(created.id)
    assert final.status in ("completed", "incomplete") and seen[-1].response.id == created.id
    assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == final.output_text
    # After the end: the same events again, from any point.
    replay = list(client.responses.retrieve(created.id, stream=True, starting_after=5))
    check_sequence(replay, start=6)
    assert [e.model_dump() for e in replay[:-1]] == [e.model_dump() for e in seen[6:-1]]
    # Deleted: gone for everyone.
    assert client.responses.delete(created.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_cancel_a_running_background_response(live_api: ApiServer) -> None:
    client = sdk(live_api)
    created = client.responses.create(input="Go on forever.", max_output_tokens=2000, background=True)
    assert wait_status(client, created.id, {"in_progress", "completed", "incomplete"}) == "in_progress"
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(created.id).status == "cancelled"
    events = list(client.responses.retrieve(created.id, stream=True))
    assert events[-1].response.status == "cancelled"
    check_sequence(events)


def test_errors_name_the_parameter(live_api: ApiServer) -> None:
    client = sdk(live_api)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_" + uuid.uuid4().hex)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_unknown")
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
    cases = [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0]"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user"}]}, "input[0].content"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"background": True, "store": False}, "store"),
    ]
    for extra, param in cases:
        kwargs = {"input": "x", **{k: v for k, v in extra.items() if k in ("input", "tools", "reasoning", "include")}}
        body = {k: v for k, v in extra.items() if k not in kwargs}
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**kwargs, extra_body=body)
        assert info.value.status_code == 400
        assert (info.value.body or {}).get("param", "").startswith(param), (extra, info.value.body)
    non_background = client.responses.create(input="x", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(non_background.id)


@pytest.mark.slow
def test_cancel_queued_and_api_restart(
    redis_url: str,
    run_prefix: str,
    tiny_model_dir: Path,
    spawn_api: SpawnApi,  # noqa: F811
) -> None:
    """No worker at all: a background response waits queued; its API process is killed and another
    (a restart: started beside it, used only after the kill) sees it, cancels it, deletes it."""
    settings = Settings(
        redis_url=redis_url, key_prefix=f"{run_prefix}-rq{uuid.uuid4().hex[:6]}", model=str(tiny_model_dir)
    )
    first, second = spawn_api(settings), spawn_api(settings, ready=False)
    created = sdk(first).responses.create(input="Wait.", background=True, metadata={"k": "v"})
    first.kill()
    second.wait_ready()
    client = sdk(second)
    assert client.responses.retrieve(created.id).status == "queued"
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.metadata == {"k": "v"}
    events = list(client.responses.retrieve(created.id, stream=True))
    check_sequence(events)
    assert events[-1].response.status == "cancelled" and events[-1].response.output_text == ""
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


PACED_TOKENS = 10


@pytest.mark.slow
def test_background_survives_a_worker_crash(
    redis_url: str,
    module_prefix: str,
    tiny_model_dir: Path,
    start_api: Callable[[Settings], ApiServer],
    tmp_path: Path,
) -> None:
    prefix = module_prefix + "-crash"
    settings = Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        model=str(tiny_model_dir),
        heartbeat_ttl_s=3,
        no_worker_wait_s=120,
        max_new_tokens=2000,
    )
    fast_reclaim = {"INFLIGHTQ_RECLAIM_AFTER_S": "1"}
    # The first worker is paced (tests/worker/paced_worker.py): it generates PACED_TOKENS and then waits,
    # so the crash lands mid-response however fast the machine runs the model.
    first = WorkerProcess(tiny_model_dir, redis_url, prefix, tmp_path / "first.log", fast_reclaim, paced_worker.SCRIPT)
    second: WorkerProcess | None = None
    try:
        api = start_api(settings)
        with api.client() as http:
            wait_for_workers(http, settings.model, 1, [first])
        client = sdk(api)
        created = client.responses.create(
            input="Go", max_output_tokens=300, background=True, extra_body={"ignore_eos": True, "seed": 3}
        )
        gates = redis.Redis.from_url(redis_url)
        paced_worker.allow_steps(gates, prefix, created.id, PACED_TOKENS)
        gates.close()
        seen = []
        stream = client.responses.retrieve(created.id, stream=True)
        for event in stream:
            seen.append(event)
            if len(seen) == 12:  # 4 opening events and 8 deltas: the first worker waits after PACED_TOKENS
                first.crash()
                second = WorkerProcess(tiny_model_dir, redis_url, prefix, tmp_path / "second.log", fast_reclaim)
                break
        stream.close()
        for event in client.responses.retrieve(created.id, stream=True, starting_after=seen[-1].sequence_number):
            seen.append(event)
        final = client.responses.retrieve(created.id)
    finally:
        first.stop()
        if second is not None:
            second.stop()
    check_sequence(seen)
    assert final.status in ("completed", "incomplete")
    assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == final.output_text
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    attempt = r.hget(Keys.for_prefix(prefix).request(created.id), "attempt")
    r.close()
    assert final.usage.output_tokens == 300  # ignore_eos: it ran well past the crash
    assert attempt is not None and int(attempt) >= 1, "the response was not taken over"
