"""The batch store on real Redis: OpenAI-shaped records, files in Redis or on disk, status moves
that never undo each other, and per-line facts written once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from producer_api.batches.files import INLINE_FILE_BYTES
from producer_api.batches.lines import parse_lines
from producer_api.batches.store import BatchStatus, BatchStore
from shared.errors import NotFoundError, PayloadTooLargeError, ValidationError
from shared.redis_connect import connect
from shared.settings import Settings
from tests.conftest import RedisBackend

_CHAT = "/v1/chat/completions"


@pytest.fixture
def store(redis_backend: RedisBackend, key_prefix: str) -> BatchStore:
    """On the standalone Redis here; on the Cluster in ``test_batch_store_on_cluster.py``."""
    backend = {"redis_url": redis_backend.url, "redis_cluster": redis_backend.cluster}
    settings = Settings(**backend, key_prefix=key_prefix, result_ttl_s=600)  # type: ignore[arg-type]
    return BatchStore(settings, connect(settings, decode_responses=False))  # type: ignore[arg-type]


def _line(custom_id: str, url: str = "/v1/chat/completions") -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_small_files_live_in_redis_with_a_ttl(store: BatchStore) -> None:
    made = store.files.put(b'{"a": 1}\n', filename="in.jsonl", purpose="batch")
    assert made.id.startswith("file-") and made.bytes == 9 and made.object == "file"
    assert store.files.get(made.id) == made
    assert store.files.content(made.id) == b'{"a": 1}\n'
    assert 0 < store.redis.ttl(store.keys.file_content(made.id)) <= 600


def test_a_batch_keeps_its_input_file_alive_for_its_window(store: BatchStore) -> None:
    made = store.files.put(_line("a").encode(), filename="in.jsonl", purpose="batch")
    store.create(input_file_id=made.id, endpoint=_CHAT)
    assert store.redis.ttl(store.keys.file_content(made.id)) > 24 * 3600
    assert (store.files.get(made.id).expires_at or 0) > made.created_at + 24 * 3600


def test_large_files_go_to_the_configured_directory(store: BatchStore, tmp_path: Path) -> None:
    store.files.settings = store.settings.model_copy(update={"batch_file_dir": str(tmp_path)})
    content = b"x" * (INLINE_FILE_BYTES + 1)
    made = store.files.put(content, filename="big.jsonl", purpose="batch")
    assert (tmp_path / made.id).read_bytes() == content
    assert not store.redis.exists(store.keys.file_content(made.id))
    assert store.files.content(made.id) == content


def test_files_on_disk_go_when_their_record_expires(store: BatchStore, tmp_path: Path) -> None:
    store.files.settings = store.settings.model_copy(update={"batch_file_dir": str(tmp_path)})
    kept = store.files.put(b"k" * (INLINE_FILE_BYTES + 1), filename="k", purpose="batch")
    gone = store.files.put(b"g" * (INLINE_FILE_BYTES + 1), filename="g", purpose="batch")
    store.redis.delete(store.keys.file(gone.id))  # what its TTL does
    assert store.files.sweep_disk() == [gone.id]
    assert (tmp_path / kept.id).exists() and not (tmp_path / gone.id).exists()


def test_files_list_newest_first_by_purpose(store: BatchStore) -> None:
    inputs = [store.files.put(b"{}", filename=f"in-{i}", purpose="batch") for i in range(3)]
    output = store.files.put(b"{}", filename="out", purpose="batch_output")
    page = store.files.list(purpose="batch", limit=2)
    assert [f.id for f in page.data] == [inputs[2].id, inputs[1].id] and page.has_more
    rest = store.files.list(purpose="batch", after=page.last_id)
    assert [f.id for f in rest.data] == [inputs[0].id] and not rest.has_more
    assert store.files.list().data[0].id == output.id
    store.redis.delete(store.keys.file(inputs[1].id))  # expired
    assert [f.id for f in store.files.list(purpose="batch").data] == [inputs[2].id, inputs[0].id]


def test_file_limits_and_purpose(store: BatchStore) -> None:
    with pytest.raises(ValidationError):
        store.files.put(b"x", filename="f", purpose="fine-tune")
    store.files.settings = store.settings.model_copy(update={"batch_file_dir": None})
    with pytest.raises(PayloadTooLargeError):
        store.files.put(b"x" * (store.files.max_bytes() + 1), filename="f", purpose="batch")
    with pytest.raises(NotFoundError):
        store.files.get("file-nope")


def test_batches_list_newest_first_with_cursor(store: BatchStore) -> None:
    file_id = store.files.put(_line("a").encode(), filename="f", purpose="batch").id
    made = [store.create(input_file_id=file_id, endpoint="/v1/chat/completions") for _ in range(5)]
    first = store.list(limit=2)
    assert [b.id for b in first.data] == [made[4].id, made[3].id] and first.has_more
    rest = store.list(limit=10, after=first.last_id)
    assert [b.id for b in rest.data] == [made[2].id, made[1].id, made[0].id] and not rest.has_more


def test_create_refuses_unknown_endpoints_and_windows(store: BatchStore) -> None:
    file_id = store.files.put(b"{}", filename="f", purpose="batch").id
    with pytest.raises(ValidationError):
        store.create(input_file_id=file_id, endpoint="/v1/embeddings")
    with pytest.raises(ValidationError):
        store.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="1h")
    with pytest.raises(NotFoundError):
        store.create(input_file_id="file-missing", endpoint="/v1/completions")


def test_a_move_happens_only_from_an_allowed_status(store: BatchStore) -> None:
    file_id = store.files.put(b"{}", filename="f", purpose="batch").id
    batch = store.create(input_file_id=file_id, endpoint="/v1/completions")
    assert store.move(batch.id, BatchStatus.IN_PROGRESS, allowed_from=(BatchStatus.VALIDATING,))
    assert store.cancel(batch.id).status == BatchStatus.CANCELLING
    # The job's own "completed" cannot overwrite a cancel that came first.
    assert store.move(batch.id, BatchStatus.FINALIZING, allowed_from=(BatchStatus.IN_PROGRESS,)) is None
    got = store.get(batch.id)
    assert got.status == BatchStatus.CANCELLING and got.in_progress_at and got.cancelling_at


def test_an_outcome_is_written_and_counted_once(store: BatchStore) -> None:
    file_id = store.files.put(b"{}", filename="f", purpose="batch").id
    batch = store.create(input_file_id=file_id, endpoint="/v1/completions")
    assert store.record_outcome(batch.id, 3, {"custom_id": "a"}, ok=True)
    assert not store.record_outcome(batch.id, 3, {"custom_id": "a"}, ok=True)
    assert store.record_outcome(batch.id, 1, {"custom_id": "b"}, ok=False)
    counts = store.get(batch.id).request_counts
    assert (counts.completed, counts.failed) == (1, 1)
    assert [row[0] for row in store.outcomes(batch.id)] == [1, 3]


def test_a_custom_id_maps_to_one_request_id_forever(store: BatchStore) -> None:
    first, created = store.claim_request_id("batch_x", "row-1")
    again, created_again = store.claim_request_id("batch_x", "row-1")
    assert created and not created_again and first == again
    assert store.request_ids("batch_x") == {"row-1": first}


def test_the_lease_admits_one_run(store: BatchStore) -> None:
    assert store.acquire_lease("batch_y", "run-1", 5)
    assert not store.acquire_lease("batch_y", "run-2", 5)
    assert store.renew_lease("batch_y", "run-1", 5) and not store.renew_lease("batch_y", "run-2", 5)
    store.release_lease("batch_y", "run-1")
    assert store.acquire_lease("batch_y", "run-2", 5)


def test_bad_lines_carry_their_error_and_good_ones_their_body() -> None:
    content = "\n".join(
        [
            _line("ok-1"),
            "{not json",
            _line("ok-1"),  # duplicate custom_id
            _line("other", url="/v1/completions"),
            "",
            json.dumps({"custom_id": "nobody", "method": "POST", "url": "/v1/chat/completions"}),
            _line("ok-2"),
        ]
    ).encode()
    lines = parse_lines(content, "/v1/chat/completions")
    assert [line.line_no for line in lines] == [1, 2, 3, 4, 6, 7]
    assert [line.error is None for line in lines] == [True, False, False, False, False, True]
    assert "custom_id" in (lines[2].error or "") and "url" in (lines[3].error or "")


def test_a_batch_past_its_window_expires_without_queueing_anything(store: BatchStore) -> None:
    from producer_api.batches.job import ApiLineHandler
    from producer_api.batches.runner import BatchRunner
    from shared.client import QueueClient

    line = _line("late").encode()
    batch = store.create(input_file_id=store.files.put(line, filename="f", purpose="batch").id, endpoint=_CHAT)
    store.set_fields(batch.id, expires_at=int(time.time()) - 1)
    client = QueueClient(store.settings)
    try:
        status = BatchRunner(store, client, ApiLineHandler(store.settings), batch.id).run()
    finally:
        client.close()
    done = store.get(batch.id)
    assert status == BatchStatus.EXPIRED and done.expired_at and done.request_counts.total == 1
    assert store.request_ids(batch.id) == {}  # nothing was queued
