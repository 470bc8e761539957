"""Structured output across worker processes: a worker killed mid-JSON (SIGKILL) is taken over and
the JSON still comes out whole and valid, with no gap or duplicate in the stream; a hostile
constraint that reaches Redis fails its own request, never the worker or its batch."""

from __future__ import annotations

import json
import signal
import threading

import pytest

from shared.client import QueueClient
from shared.keys import CONSUMER_GROUP
from shared.request_lifecycle import RequestStatus
from shared.schemas import DoneEvent, ErrorEvent, QueuedRequest, SamplingSpec, TokenEvent
from shared.work_queue import STREAM_FIELD
from tests.structured_cases import validate
from tests.worker import paced_worker
from tests.worker.test_worker import tokens_sent, wait_for

pytestmark = pytest.mark.slow

# Long enough (~150 tokens) to be caught mid-way, bounded so that it always ends.
INVENTORY = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "count": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["name", "count"],
                "additionalProperties": False,
            },
            "minItems": 8,
            "maxItems": 8,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def spec(seed: int) -> SamplingSpec:
    constraint = {"type": "json_schema", "value": INVENTORY}
    return SamplingSpec(max_new_tokens=400, temperature=0.9, seed=seed, constraint=constraint)  # type: ignore[arg-type]


def prompt(i: int) -> list[int]:
    return [10 + i, 200 + 7 * i, 3000 + i, 42]


VICTIM_TOKENS = 12


def test_a_worker_killed_mid_json_is_taken_over_and_the_json_is_whole(spawn_worker, client: QueueClient) -> None:
    model = client.settings.model
    # The victim is paced (tests/worker/paced_worker.py): it generates VICTIM_TOKENS per request and then
    # waits, so the kill lands mid-generation however fast the machine runs the model.
    victim = spawn_worker("victim", "--max-num-seqs", "2", ready=False, script=paced_worker.SCRIPT)
    survivor = spawn_worker("survivor", "--max-num-seqs", "2", ready=False)
    victim.wait_ready(client)
    survivor.wait_ready(client)
    ids = [client.submit(model, prompt(i), spec(i)) for i in range(4)]
    for request_id in ids:
        paced_worker.allow_steps(client.redis, client.settings.key_prefix, request_id, VICTIM_TOKENS)
    streams: dict[str, list] = {r: [] for r in ids}

    def follow(request_id: str) -> None:
        streams[request_id] = list(client.stream(request_id, timeout=180))

    followers = [threading.Thread(target=follow, args=(r,)) for r in ids]
    for thread in followers:
        thread.start()

    def victim_is_mid_json() -> bool:
        infos = [client.status(r) for r in ids]
        running = [i for i in infos if i and i.worker == "victim" and i.status is RequestStatus.RUNNING]
        return any(5 < tokens_sent(client, i.id) < 60 for i in running)

    wait_for(victim_is_mid_json, timeout=60, every=0.01)
    victim.signal(signal.SIGKILL)
    victim.wait(timeout=10)
    for thread in followers:
        thread.join(timeout=180)

    taken_over = 0
    for request_id in ids:
        events = streams[request_id]
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert isinstance(events[-1], DoneEvent), events[-1]
        assert [e.index for e in tokens] == list(range(len(tokens))), "no gap, no duplicate"
        text = "".join(e.text for e in tokens)
        assert text == events[-1].result.text
        validate(text, INVENTORY)
        assert events[-1].result.finish_reason == "eos_token"
        taken_over += client.status(request_id).attempt > 0  # type: ignore[union-attr]
    assert taken_over >= 1

    # The same requests run again, uninterrupted, on the survivor: identical tokens (seeded
    # draws and a matcher that replayed what was already sent).
    for i, request_id in enumerate(ids):
        again = client.result(client.submit(model, prompt(i), spec(i)), timeout=120)
        assert again.token_ids == streams[request_id][-1].result.token_ids
    assert client.redis.xpending(client.keys.stream(model, 1), CONSUMER_GROUP)["pending"] == 0


def test_a_hostile_constraint_in_redis_fails_its_request_alone(spawn_worker, client: QueueClient) -> None:
    spawn_worker("guard")
    model = client.settings.model
    client.ensure_groups(model)
    good = client.submit(model, prompt(1), spec(1), priority=0)
    doc = json.loads(QueuedRequest(id="hostile", model=model, prompt_token_ids=prompt(2), priority=0).to_json())
    doc["sampling"]["constraint"] = {"type": "regex", "value": "(unclosed"}  # skipped the client's check
    client.redis.xadd(client.keys.stream(model, 0), {STREAM_FIELD: json.dumps(doc)})
    also_good = client.submit(model, prompt(3), spec(3), priority=0)

    for request_id in (good, also_good):
        validate(client.result(request_id, timeout=120).text, INVENTORY)
    events = list(client.stream("hostile", timeout=60))  # read after: by now the worker has judged it
    assert isinstance(events[-1], ErrorEvent) and events[-1].error_type == "generation"
    assert "regex" in events[-1].message
