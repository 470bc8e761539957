"""OpenAI's Files API, as much of it as batches need: upload a JSONL file, read it back.

Thin over ``shared/batch_store.py``. Handlers are plain functions (FastAPI runs them in its
thread pool) over one synchronous Redis connection pool per app."""

from __future__ import annotations

from email.message import Message
from email.parser import BytesParser
from email.policy import HTTP
from typing import Literal

import redis
from anyio import to_thread
from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel

from producer_api.auth import ApiKey, authenticate
from producer_api.state import state_of
from shared.batch_files import FileObject, FilePage
from shared.batch_store import BatchStore
from shared.errors import ValidationError

router = APIRouter(tags=["Batch"], dependencies=[Depends(authenticate)])


def batch_store(request: Request) -> BatchStore:
    """The app's batch store, made on first use (the app's own Redis client is asyncio)."""
    store: BatchStore | None = getattr(request.app.state, "batch_store", None)
    if store is None:
        settings = state_of(request).settings
        store = BatchStore(settings, redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2.0))
        request.app.state.batch_store = store
    return store


def owner_of(key: ApiKey | None = Depends(authenticate)) -> str | None:
    """Files and batches belong to the API key that made them; with auth off, to everyone.
    (FastAPI runs ``authenticate`` once per request, though the router depends on it too.)"""
    return key.key_id if key else None


def _form_parts(content_type: str, body: bytes) -> dict[str, Message]:
    """multipart/form-data -> parts by field name, with the standard library's MIME parser
    (the body is already capped by the API's body-size limit, so reading it whole is fine)."""
    if not content_type.startswith("multipart/form-data"):
        raise ValidationError("upload the file as multipart/form-data", field="file")
    message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    parts: dict[str, Message] = {}
    for part in message.iter_parts():  # type: ignore[attr-defined]
        name = part.get_param("name", header="content-disposition")
        if name:
            parts[str(name)] = part
    return parts


@router.post("/v1/files", response_model=FileObject, summary="Upload a JSONL file (purpose=batch)")
async def create_file(request: Request, owner: str | None = Depends(owner_of)) -> FileObject:
    body = await request.body()
    parts = _form_parts(request.headers.get("content-type", ""), body)
    if "file" not in parts:
        raise ValidationError("the form needs a 'file' part", field="file")
    purpose_part = parts.get("purpose")
    purpose = (purpose_part.get_payload(decode=True) or b"").decode().strip() if purpose_part else ""
    if purpose != "batch":
        raise ValidationError("purpose must be 'batch'", field="purpose")
    file_part = parts["file"]
    content = file_part.get_payload(decode=True) or b""
    filename = file_part.get_filename() or "upload.jsonl"
    store = batch_store(request)
    return await to_thread.run_sync(lambda: store.files.put(content, filename=filename, purpose=purpose, owner=owner))


@router.get("/v1/files", response_model=FilePage, summary="Files, newest first")
def list_files(
    purpose: str | None = Query(None, description="Only files of this purpose (batch, batch_output)."),
    limit: int = Query(100, ge=1, le=10_000),
    after: str | None = Query(None, description="The last id of the previous page."),
    store: BatchStore = Depends(batch_store),
    owner: str | None = Depends(owner_of),
) -> FilePage:
    return store.files.list(purpose=purpose, limit=limit, after=after, owner=owner)


@router.get("/v1/files/{file_id}", response_model=FileObject, summary="A file's metadata")
def retrieve_file(
    file_id: str, store: BatchStore = Depends(batch_store), owner: str | None = Depends(owner_of)
) -> FileObject:
    return store.files.get(file_id, owner=owner)


@router.get("/v1/files/{file_id}/content", summary="A file's bytes (input, output or error JSONL)")
def file_content(
    file_id: str, store: BatchStore = Depends(batch_store), owner: str | None = Depends(owner_of)
) -> Response:
    return Response(store.files.content(file_id, owner=owner), media_type="application/jsonl")


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, summary="Delete a file")
def delete_file(
    file_id: str, store: BatchStore = Depends(batch_store), owner: str | None = Depends(owner_of)
) -> FileDeleted:
    store.files.delete(file_id, owner=owner)
    return FileDeleted(id=file_id)
