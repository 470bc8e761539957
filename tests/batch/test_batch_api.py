"""The Batch API through the ``openai`` package and the CLI, against a running API, a real queue
worker on the tiny model and a real RQ batch worker."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from producer_api.batches.store import BatchStore
from shared.client import QueueClient
from shared.settings import Settings
from tests.api.api_process import SpawnApi, spawn_api  # noqa: F401 - the fixture
from tests.batch.conftest import ROOT, Proc, chat_line, jsonl, wait_for

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.fixture
def oai(api_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_url + "/v1", api_key="unused", max_retries=0)


def _until(oai: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 120) -> openai.types.Batch:
    deadline = time.monotonic() + timeout
    while True:
        batch = oai.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}: {batch}"
        time.sleep(0.3)


def test_openai_files_and_batches_calls_work_unmodified(
    oai: openai.OpenAI, stack_settings: Settings, queue_worker: Proc, batch_worker: Proc
) -> None:
    model = stack_settings.model
    good = [f"req-{i}" for i in range(6)]
    lines = [chat_line(cid, model, f"Say {i}") for i, cid in enumerate(good[:3])]
    lines.append("{this is not json")
    lines.append(chat_line("bad-model", "no-such-model", "hello"))
    lines += [chat_line(cid, model, f"Say {i}") for i, cid in enumerate(good[3:])]
    content = ("\n".join(lines) + "\n").encode()

    uploaded = oai.files.create(file=("requests.jsonl", content), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(content) and uploaded.filename == "requests.jsonl"
    assert oai.files.retrieve(uploaded.id).id == uploaded.id
    assert oai.files.content(uploaded.id).content == content

    batch = oai.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"owner": "tests"},
    )
    assert batch.status == "validating" and batch.metadata == {"owner": "tests"}
    done = _until(oai, batch.id, {"completed", "failed"})

    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 6, 2)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.output_file_id and done.error_file_id
    assert done.usage is not None and done.usage.output_tokens >= 6 and done.usage.input_tokens > 0

    outputs = jsonl(oai.files.content(done.output_file_id).content)
    assert [o["custom_id"] for o in outputs] == good  # every good line once, in input order
    for out in outputs:
        assert out["error"] is None and out["response"]["status_code"] == 200
        body = out["response"]["body"]
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert isinstance(body["choices"][0]["message"]["content"], str)
        assert body["usage"]["completion_tokens"] >= 1
    errors = jsonl(oai.files.content(done.error_file_id).content)
    by_id = {e["custom_id"]: e for e in errors}
    assert set(by_id) == {None, "bad-model"}
    assert by_id[None]["error"]["code"] == "invalid_request" and by_id[None]["error"]["line"] == 4
    assert by_id["bad-model"]["response"]["status_code"] == 404  # OpenAI's model_not_found
    assert oai.files.retrieve(done.output_file_id).purpose == "batch_output"

    listed = oai.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]


def test_batches_page_newest_first(oai: openai.OpenAI, stack_settings: Settings, batch_worker: Proc) -> None:
    uploaded = oai.files.create(file=("one.jsonl", b"\n"), purpose="batch")
    made = [oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")]
    made.append(oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"))
    first = oai.batches.list(limit=1)
    assert [b.id for b in first.data] == [made[1].id] and first.has_more
    second = oai.batches.list(limit=1, after=made[1].id)
    assert [b.id for b in second.data] == [made[0].id]
    # An input file without a single request fails the batch rather than completing an empty one.
    failed = _until(oai, made[0].id, {"failed", "completed"})
    assert failed.status == "failed" and failed.failed_at
    assert failed.errors and failed.errors.data and failed.errors.data[0].code == "empty_file"


def test_unknown_ids_and_bad_uploads_are_openai_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve("file-nope")
    # The Files and Batch routes are OpenAI's: a request they cannot take is a 400, as OpenAI answers.
    with pytest.raises(openai.BadRequestError):
        oai.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
    uploaded = oai.files.create(file=("x.jsonl", b"{}"), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    assert uploaded.id in [f.id for f in oai.files.list(purpose="batch")]
    assert oai.files.delete(uploaded.id).deleted
    assert uploaded.id not in [f.id for f in oai.files.list()]
    with pytest.raises(openai.NotFoundError):
        oai.files.content(uploaded.id)


def test_batch_files_may_be_larger_than_an_ordinary_request_body(
    oai: openai.OpenAI, api_url: str, stack_settings: Settings
) -> None:
    line = chat_line("big", str(stack_settings.model), "x" * 200) + "\n"
    content = (line * (stack_settings.max_body_bytes // len(line) + 10)).encode()
    assert len(content) > stack_settings.max_body_bytes
    uploaded = oai.files.create(file=("big.jsonl", content), purpose="batch")
    assert uploaded.bytes == len(content)
    assert oai.files.content(uploaded.id).content == content
    oai.files.delete(uploaded.id)
    too_big = httpx.post(api_url + "/v1/completions", content=b" " * (stack_settings.max_body_bytes + 1))
    assert too_big.status_code == 413


def test_cancel_stops_the_batch_and_its_queued_requests(
    oai: openai.OpenAI, stack_settings: Settings, store: BatchStore, queue_worker: Proc, batch_worker: Proc
) -> None:
    model = stack_settings.model
    n = 24
    lines = [chat_line(f"c-{i}", model, f"Count to {i}", max_tokens=32, ignore_eos=True) for i in range(n)]
    uploaded = oai.files.create(file=("many.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(store, batch.id, lambda b: b.request_counts.completed >= 1)

    cancelling = oai.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = _until(oai, batch.id, {"cancelled"}, timeout=60)
    assert done.cancelled_at and done.cancelling_at
    assert done.request_counts is not None and done.request_counts.completed < n

    # Nothing of the batch is left queued or running in the model's queue.
    client = QueueClient(stack_settings)
    try:
        infos = [client.status(rid) for rid in store.request_ids(batch.id).values()]
    finally:
        client.close()
    assert infos and all(info is not None and info.status.is_final for info in infos)
    seen: list[str] = []
    for file_id in (done.output_file_id, done.error_file_id):
        if file_id:
            seen += [row["custom_id"] for row in jsonl(oai.files.content(file_id).content)]
    assert len(seen) == len(set(seen))
    assert any(row == "batch_cancelled" for row in _error_codes(oai, done.error_file_id))


def test_a_batch_outlives_the_api_process_that_created_it(
    stack_settings: Settings,
    queue_worker: Proc,
    batch_worker: Proc,
    spawn_api: SpawnApi,  # noqa: F811
) -> None:
    """The API process that took the file and the batch is SIGKILLed at once; another (started beside
    it, as in a rolling restart, used only after the kill) serves the file, the batch and its output."""
    first, second = spawn_api(stack_settings), spawn_api(stack_settings, ready=False)
    model = stack_settings.model
    lines = [chat_line(f"r-{i}", model, f"Say {i}", max_tokens=6, ignore_eos=True) for i in range(4)]
    content = "\n".join(lines).encode()
    before = openai.OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0)
    uploaded = before.files.create(file=("restart.jsonl", content), purpose="batch")
    batch = before.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    first.kill()

    after = openai.OpenAI(base_url=second.wait_ready().url + "/v1", api_key="unused", max_retries=0)
    assert after.files.content(uploaded.id).content == content
    done = _until(after, batch.id, {"completed"})
    assert done.request_counts is not None and done.request_counts.completed == 4
    assert done.output_file_id is not None
    rows = jsonl(after.files.content(done.output_file_id).content)
    assert sorted(row["custom_id"] for row in rows) == [f"r-{i}" for i in range(4)]
    assert all(row["response"]["body"]["usage"]["completion_tokens"] == 6 for row in rows)


def _error_codes(oai: openai.OpenAI, file_id: str | None) -> list[str]:
    if not file_id:
        return []
    return [(row.get("error") or {}).get("code", "") for row in jsonl(oai.files.content(file_id).content)]


def test_cli_submits_a_completions_batch_and_waits(
    tmp_path: Path, stack_settings: Settings, stack_env: dict[str, str], queue_worker: Proc, batch_worker: Proc
) -> None:
    source = tmp_path / "prompts.jsonl"
    rows = [
        {
            "custom_id": f"p-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": f"Hi {i}", "max_tokens": 4},
        }
        for i in range(3)
    ]
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out.jsonl"
    # No --endpoint: the CLI takes it from the lines' url.
    done = subprocess.run(
        [sys.executable, "-m", "inflightq_cli", "batch", "submit", str(source),
         "--model", stack_settings.model, "--wait", "--output", str(out)],
        cwd=ROOT, env=stack_env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    batch_id = done.stdout.splitlines()[0].strip()
    results = jsonl(out.read_bytes())
    assert [r["custom_id"] for r in results] == ["p-0", "p-1", "p-2"]
    assert all(r["response"]["body"]["object"] == "text_completion" for r in results)

    status = subprocess.run(
        [sys.executable, "-m", "inflightq_cli", "batch", "status", batch_id],
        cwd=ROOT, env=stack_env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    shown = json.loads(status.stdout)
    assert shown["status"] == "completed" and shown["request_counts"] == {"total": 3, "completed": 3, "failed": 0}


def test_interactive_requests_keep_priority_over_a_running_batch(
    stack_settings: Settings, store: BatchStore, queue_worker: Proc, batch_worker: Proc
) -> None:
    from producer_api.batches.queue import create_batch
    from shared.schemas import SamplingSpec, TokenEvent

    model, n = stack_settings.model, 32
    # Long enough lines that the batch is still mostly queued when the interactive request comes.
    lines = [chat_line(f"bulk-{i}", model, f"Item {i}", max_tokens=40, ignore_eos=True) for i in range(n)]
    uploaded = store.files.put("\n".join(lines).encode(), filename="bulk.jsonl", purpose="batch")
    batch = create_batch(stack_settings, store, input_file_id=uploaded.id, endpoint="/v1/chat/completions")
    client = QueueClient(stack_settings)

    def batch_statuses() -> dict[str, str | None]:
        return {r: client.redis.hget(client.keys.request(r), "status") for r in store.request_ids(batch.id).values()}

    try:
        # The worker's slots (max_num_seqs=4) run batch work and the rest of the batch waits in the queue.
        # (Read from Redis: the batch's own counts are updated by a poller and lag behind a fast worker.)
        deadline = time.monotonic() + 60
        while len(statuses := batch_statuses()) < n or not {"running", "done"} & set(statuses.values()):
            assert time.monotonic() < deadline, "the batch never started"
            time.sleep(0.01)
        request_id = client.submit(model, [1, 2, 3, 4, 5], SamplingSpec(max_new_tokens=4, ignore_eos=True))
        behind = [r for r, status in batch_statuses().items() if status == "queued"]  # queued before it
        first = next(ev for ev in client.stream(request_id, timeout=60) if isinstance(ev, TokenEvent))
        assert first.index == 0
        # Progress counted in the batch's own lines: how many of those queued before it are still
        # queued when its first token is out (instead of comparing its TTFT with the batch's span).
        still_queued = [r for r, status in batch_statuses().items() if r in behind and status == "queued"]
        wait_for(store, batch.id, lambda b: b.status == "completed", timeout=180)
        mine = client.status(request_id).started_at  # type: ignore[union-attr]
        overtook = [r for r in behind if client.status(r).started_at < mine]  # type: ignore[union-attr,operator]
    finally:
        client.close()

    # Served ahead of the batch's queued lines, not after them. Only lines the worker had already
    # read from the queue (at most its free slots) may start first; their status says "queued" until then.
    assert len(behind) >= n // 4, f"premise: much of the batch still queued ({len(behind)} of {n})"
    assert len(overtook) <= stack_settings.max_num_seqs, (len(overtook), len(behind))
    # It did not wait for the batch: all but the lines the worker already held still waited for it.
    assert len(still_queued) >= len(behind) - stack_settings.max_num_seqs, (len(still_queued), len(behind))
