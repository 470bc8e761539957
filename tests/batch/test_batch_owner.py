"""With API keys on, a key sees only its own files and batches; another key gets not-found."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from producer_api.app import create_app
from shared.settings import Settings
from tests.batch.conftest import chat_line


@pytest.fixture
def app_client(redis_url: str, key_prefix: str, tiny_model_dir: Path) -> Iterator[TestClient]:
    settings = Settings(
        redis_url=redis_url, key_prefix=key_prefix, model=str(tiny_model_dir), api_keys=["alpha", "beta"]
    )
    with TestClient(create_app(settings)) as client:
        yield client
    # The runs no batch worker took stay in RQ's keys, under the run's prefix: the run's cleanup takes them.


def _sdk(app_client: TestClient, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=app_client, max_retries=0)


def test_files_and_batches_belong_to_the_key_that_made_them(app_client: TestClient, tiny_model_dir: Path) -> None:
    alpha, beta = _sdk(app_client, "alpha"), _sdk(app_client, "beta")
    uploaded = alpha.files.create(file=("a.jsonl", chat_line("x", str(tiny_model_dir), "hi").encode()), purpose="batch")
    batch = alpha.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")

    assert alpha.files.retrieve(uploaded.id).id == uploaded.id
    assert alpha.batches.retrieve(batch.id).id == batch.id
    assert [b.id for b in alpha.batches.list()] == [batch.id]
    for call in (
        lambda: beta.files.retrieve(uploaded.id),
        lambda: beta.files.content(uploaded.id),
        lambda: beta.batches.retrieve(batch.id),
        lambda: beta.batches.cancel(batch.id),
        lambda: beta.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(beta.batches.list()) == [] and list(beta.files.list()) == []
    with pytest.raises(openai.AuthenticationError):
        _sdk(app_client, "gamma").files.list()
    # No batch worker runs here: a batch nobody started is cancelled at once.
    assert alpha.batches.cancel(batch.id).status == "cancelled"
