"""The openai SDK's Files and Batch APIs against the stack, step by step as OpenAI's Batch guide
shows them: write a .jsonl file, upload it with purpose="batch", create the batch, poll it,
download the output and error files, list and cancel. Batches run on an RQ batch worker (the
fixture of tests/batch) beside the module's API and queue worker."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from openai.types import Batch
from openai.types.chat import ChatCompletion

from shared.settings import Settings
from tests.batch.conftest import batch_worker, batch_worker_factory, logs, stack_env  # noqa: F401

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def stack_settings(live_api) -> Settings:
    """tests/batch's batch worker, pointed at this module's stack (its prefix, Redis and model)."""
    return live_api.settings


@pytest.fixture(scope="module")
def client(live_api) -> OpenAI:
    return OpenAI(base_url=f"{live_api.url}/v1", api_key="unused", timeout=120)


def request_line(custom_id: str, model: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": model, **body}})


def poll(client: OpenAI, batch_id: str, until: set[str], timeout: float = 180) -> Batch:
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in until:
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}: {batch}"
        time.sleep(0.5)
    return batch


def test_chat_batch_output_and_error_files(
    client: OpenAI,
    model: str,
    batch_worker,  # noqa: F811
    tmp_path: Path,
) -> None:
    url = "/v1/chat/completions"
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    lines = [
        request_line("request-1", model, url, {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}),
        "{not json",  # a line that never becomes a request: it goes to the error file
        request_line(
            "request-2",
            model,
            url,
            {
                "messages": [{"role": "user", "content": "How old?"}],
                "max_tokens": 30,
                "seed": 7,
                "response_format": {"type": "json_schema", "json_schema": {"name": "age", "schema": schema}},
            },
        ),
        request_line("bad-param", model, url, {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 5}}),
        request_line("two", model, url, {"messages": [{"role": "user", "content": "x"}], "n": 2}),
    ]
    path = tmp_path / "batchinput.jsonl"
    path.write_text("\n".join(lines) + "\n")

    with path.open("rb") as f:
        batch_input_file = client.files.create(file=f, purpose="batch")
    assert batch_input_file.purpose == "batch" and batch_input_file.filename == "batchinput.jsonl"
    batch = client.batches.create(
        input_file_id=batch_input_file.id,
        endpoint=url,
        completion_window="24h",
        metadata={"description": "nightly eval job"},
    )
    assert batch.metadata == {"description": "nightly eval job"}

    done = poll(client, batch.id, {"completed", "failed", "expired", "cancelled"})
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 2, 3)
    assert done.output_file_id and done.error_file_id

    outputs = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in outputs] == ["request-1", "request-2"]
    # Each body is what the same request answers over HTTP: the SDK's own ChatCompletion model takes it.
    first, second = (ChatCompletion.model_validate(o["response"]["body"]) for o in outputs)
    assert first.usage and first.usage.completion_tokens <= 6 and isinstance(first.system_fingerprint, str)
    if second.choices[0].finish_reason == "stop":  # the tiny random model may run out of tokens first
        assert isinstance(json.loads(second.choices[0].message.content or "")["age"], int)

    errors = {e["custom_id"]: e for e in map(json.loads, client.files.content(done.error_file_id).text.splitlines())}
    assert errors[None]["response"] is None and errors[None]["error"]["line"] == 2
    # What is deliberately not supported answers a 400 naming the parameter, as the live routes do.
    for custom_id, param in (("bad-param", "logit_bias"), ("two", "n")):
        refused = errors[custom_id]["response"]
        assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == param
        assert param in refused["body"]["error"]["message"]

    assert batch.id in [b.id for b in client.batches.list(limit=10)]


def test_completions_batch_and_cancel(
    client: OpenAI,
    model: str,
    batch_worker,  # noqa: F811
) -> None:
    url = "/v1/completions"
    quick = "\n".join(request_line(f"q-{i}", model, url, {"prompt": f"Hi {i}", "max_tokens": 3}) for i in range(2))
    batch_input_file = client.files.create(file=("quick.jsonl", quick.encode()), purpose="batch")
    quick_batch = client.batches.create(input_file_id=batch_input_file.id, endpoint=url, completion_window="24h")
    done = poll(client, quick_batch.id, {"completed", "failed"})
    assert done.status == "completed" and done.output_file_id and done.error_file_id is None
    output = client.files.content(done.output_file_id).text
    bodies = [json.loads(line)["response"]["body"] for line in output.splitlines()]
    assert [b["object"] for b in bodies] == ["text_completion"] * 2

    # Long enough that the cancel lands while most of it is still queued.
    body = {"prompt": "Count", "max_tokens": 64, "ignore_eos": True}
    slow = "\n".join(request_line(f"s-{i}", model, url, body) for i in range(24))
    slow_file = client.files.create(file=("slow.jsonl", slow.encode()), purpose="batch")
    slow_batch = client.batches.create(input_file_id=slow_file.id, endpoint=url, completion_window="24h")
    poll(client, slow_batch.id, {"in_progress"}, timeout=60)
    assert client.batches.cancel(slow_batch.id).status in ("cancelling", "cancelled")
    cancelled = poll(client, slow_batch.id, {"cancelled"}, timeout=90)
    assert cancelled.cancelled_at and cancelled.request_counts and cancelled.request_counts.completed < 24
    assert cancelled.error_file_id
    errors = [json.loads(line)["error"] for line in client.files.content(cancelled.error_file_id).text.splitlines()]
    assert any(error and error["code"] == "batch_cancelled" for error in errors)

    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [slow_batch.id] and page.has_more
    assert quick_batch.id in [b.id for b in client.batches.list(limit=10, after=slow_batch.id)]
