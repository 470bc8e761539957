"""Anyone who can XADD can put anything in a request stream. Every hostile entry is dead-lettered
(bounded in size) with one log line, and nothing else notices: the worker keeps serving, a
request whose id a duplicate entry reuses finishes untouched, the API's /metrics and
``inflightq status`` keep answering."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import redis

from producer_api.queue_metrics import QueueCollector
from shared.keys import CONSUMER_GROUP
from shared.schemas import DEAD_LETTER_RAW_MAX, DeadLetter
from shared.work_queue import STREAM_FIELD
from tests.worker.conftest import ROOT, greedy
from tests.worker.test_worker import PROMPT, tokens_sent, wait_for


def good(model: str, **overrides: object) -> dict[str, object]:
    doc: dict[str, object] = {"model": model, "prompt_token_ids": PROMPT, "sampling": {"max_new_tokens": 2}}
    doc.update(overrides)
    return doc


def hostile_entries(model: str, running_id: str) -> dict[str, dict[bytes | str, bytes | str]]:
    """Kind -> stream entry fields. At least 25 kinds."""

    def req(doc: object) -> dict[bytes | str, bytes | str]:
        return {STREAM_FIELD: json.dumps(doc)}

    return {
        "non-utf8 value": {STREAM_FIELD: b"\xff\xfe"},
        "non-utf8 field name": {b"\xff\xfe": b"x"},
        "non-utf8 inside a json string": {
            STREAM_FIELD: json.dumps(good(model, tenant="T")).encode().replace(b'"T"', b'"\xff"')
        },
        "missing request field": {"other": "x"},
        "extra field": {STREAM_FIELD: json.dumps(good(model)), "extra": "1"},
        "empty request": {STREAM_FIELD: ""},
        "not json": {STREAM_FIELD: "{not json"},
        "json array": req([1, 2]),
        "json null": req(None),
        "json number": req(42),
        "json string": req("hello"),
        "missing model": req({"prompt_token_ids": PROMPT}),
        "missing prompt": req({"model": model}),
        "empty prompt": req(good(model, prompt_token_ids=[])),
        "prompt of wrong type": req(good(model, prompt_token_ids="abc")),
        "prompt of strings": req(good(model, prompt_token_ids=["a", "b"])),
        "prompt of floats": req(good(model, prompt_token_ids=[1.5, 2.5])),
        "token ids outside the vocabulary": req(good(model, prompt_token_ids=[10**9])),
        "negative priority": req(good(model, priority=-1)),
        "out-of-range priority": req(good(model, priority=99)),
        "priority of wrong type": req(good(model, priority="high")),
        "other model": req(good("someone-elses-model")),
        "sampling of wrong type": req(good(model, sampling=5)),
        "negative temperature": req(good(model, sampling={"temperature": -1})),
        "zero max_new_tokens": req(good(model, sampling={"max_new_tokens": 0})),
        "seed too large": req(good(model, sampling={"seed": 2**64})),
        "empty stop string": req(good(model, sampling={"stop": [""]})),
        "unknown key": req(good(model, evil=True)),
        "id too long": req(good(model, id="x" * 200)),
        "empty id": req(good(model, id="")),
        "deadline of wrong type": req(good(model, deadline="tomorrow")),
        "deeply nested": {STREAM_FIELD: "[" * 100_000},
        "huge garbage (3 MB)": {STREAM_FIELD: b"\x00garbage" * 400_000},
        "huge prompt (200k tokens)": req(good(model, prompt_token_ids=[7] * 200_000)),
        "duplicate id of a running request": req(good(model, id=running_id)),
    }


def test_hostile_entries_are_dead_lettered_and_nothing_else_notices(spawn_worker, client, reference, settings) -> None:
    model = client.settings.model
    client.ensure_groups(model)
    raw = redis.Redis.from_url(settings.redis_url)  # bytes in, bytes out
    stream = client.keys.stream(model, 1)

    # Before any worker runs: undecodable entries wait in the stream; readers must not break.
    raw.xadd(stream, {STREAM_FIELD: b"\xff\xfe"})
    raw.xadd(stream, {b"\xff": b"\xfe"})
    collector = QueueCollector(client.settings)
    families = {family.name: family for family in collector.collect()}
    assert families["inflightq_queue_redis_up"].samples[0].value == 1
    env = {**os.environ, "INFLIGHTQ_REDIS_URL": settings.redis_url, "INFLIGHTQ_KEY_PREFIX": settings.key_prefix}
    status = subprocess.run(
        [sys.executable, "-m", "inflightq_cli", "status", "--model", model],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    assert "queue" in status.stdout

    worker = spawn_worker("sturdy")
    running = client.submit(model, PROMPT, greedy(120))
    wait_for(lambda: tokens_sent(client, running) > 2)
    kinds = hostile_entries(model, running)
    for fields in kinds.values():
        raw.xadd(stream, fields)  # type: ignore[arg-type]
    fine = client.submit(model, PROMPT, greedy(3))
    assert client.result(fine, timeout=60).usage.completion_tokens == 3, "the intake kept serving"

    expected = len(kinds) + 2
    wait_for(lambda: client.redis.xlen(client.keys.dead_letters(model)) >= expected, timeout=60)
    # The original of the duplicate id ran on, untouched, to the tokens of an uninterrupted run.
    assert client.result(running, timeout=120).token_ids == reference(PROMPT, 120)
    info = client.status(running)
    assert info is not None and info.status.value == "done" and info.attempt == 0

    letters = [DeadLetter.model_validate_json(f["letter"]) for f in client.dead_letters(model, count=1000)]
    assert len(letters) == expected
    assert all(len(letter.raw) <= DEAD_LETTER_RAW_MAX + 64 for letter in letters), "dead letters are bounded"
    assert all(letter.reason for letter in letters)
    reasons = " | ".join(letter.reason for letter in letters)
    for needle in ("not UTF-8", "wrong model", "out of range", "oversized", "duplicate request id", "vocabulary"):
        assert needle in reasons, needle
    # The acks reach Redis after the dead letters they follow (the publisher sends the writes first).
    wait_for(lambda: client.redis.xpending(stream, CONSUMER_GROUP)["pending"] == 0, timeout=30)
    assert client.redis.xlen(stream) == 0
    log = worker.log_path.read_text(errors="replace")
    assert "unexpected error" not in log
    assert log.count("dead-lettering") == expected, "one log line per dead letter"
    families = {family.name: family for family in collector.collect()}
    assert families["inflightq_queue_redis_up"].samples[0].value == 1
    raw.close()
