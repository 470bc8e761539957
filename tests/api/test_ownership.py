"""With API keys on, every object a key creates is that key's alone: another key is told it
does not exist (404) on every route that reads, streams, cancels or deletes it, and lists show
each key its own. Files and batches: also tests/batch/test_batch_owner.py."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from tests.api.conftest import ApiServer

A = {"authorization": "Bearer key-a"}
B = {"authorization": "Bearer key-b"}


def assert_not_found(response: httpx.Response) -> None:
    assert response.status_code == 404, response.text


def test_a_job_is_its_keys_only(keyed_api: ApiServer) -> None:
    with keyed_api.client() as http:
        job_id = http.post("/v1/jobs", json={"prompt": "hi"}, headers=A).json()["id"]
        assert_not_found(http.get(f"/v1/jobs/{job_id}", headers=B))
        assert_not_found(http.get(f"/v1/jobs/{job_id}/stream", headers=B))
        assert_not_found(http.delete(f"/v1/jobs/{job_id}", headers=B))
        assert http.get(f"/v1/jobs/{job_id}", headers=A).json()["status"] == "queued"  # B's cancel did nothing
        assert http.delete(f"/v1/jobs/{job_id}", headers=A).json()["cancelled"] is True
        assert http.get(f"/v1/jobs/{job_id}", headers=A).json()["status"] == "cancelled"


def test_a_response_is_its_keys_only(keyed_api: ApiServer) -> None:
    a = openai.OpenAI(base_url=keyed_api.url + "/v1", api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=keyed_api.url + "/v1", api_key="key-b", max_retries=0)
    model = keyed_api.settings.model
    made = a.responses.create(model=model, input="hi", background=True, store=True)
    calls: list[Callable[[], object]] = [
        lambda: b.responses.retrieve(made.id),
        lambda: list(b.responses.retrieve(made.id, stream=True)),
        lambda: b.responses.input_items.list(made.id),
        lambda: b.responses.cancel(made.id),
        lambda: b.responses.delete(made.id),
        lambda: b.responses.create(model=model, input="more", previous_response_id=made.id, background=True),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError):
            call()
    assert a.responses.retrieve(made.id).status == "queued"  # B's cancel and delete did nothing
    assert [item.id for item in a.responses.input_items.list(made.id)]
    assert a.responses.cancel(made.id).status == "cancelled"
    a.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(made.id)


def test_a_file_is_its_keys_only(keyed_api: ApiServer) -> None:
    with keyed_api.client() as http:
        files = {"file": ("a.jsonl", b"{}\n")}
        file_id = http.post("/v1/files", files=files, data={"purpose": "batch"}, headers=A).json()["id"]
        assert_not_found(http.delete(f"/v1/files/{file_id}", headers=B))
        assert [f["id"] for f in http.get("/v1/files", headers=B).json()["data"]] == []
        assert [f["id"] for f in http.get("/v1/files", headers=A).json()["data"]] == [file_id]
        assert http.delete(f"/v1/files/{file_id}", headers=A).json()["deleted"] is True


def test_without_keys_every_object_is_everyones(start_queue_api: Callable[..., ApiServer]) -> None:
    server = start_queue_api()
    with server.client() as http:
        job_id = http.post("/v1/jobs", json={"prompt": "hi", "tenant": "t1"}).json()["id"]
        assert http.get(f"/v1/jobs/{job_id}").status_code == 200
        assert http.delete(f"/v1/jobs/{job_id}").json()["cancelled"] is True
