"""The HTTP routes of batches: OpenAI's Files API, as much of it as batches need (upload a JSONL
file, read it back), and its Batch API (create, retrieve, cancel, list).

Thin over ``store.py`` (the records) and ``queue.py`` (the RQ side). Handlers are plain functions
(FastAPI runs them in its thread pool) over one synchronous Redis connection pool per app."""

from __future__ import annotations

import hashlib
from email.message import Message
from email.parser import BytesParser
from email.policy import HTTP

from anyio import to_thread
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse

from producer_api.api_keys import ApiKey
from producer_api.auth import authenticate
from producer_api.batches.files import FileObject, FilePage
from producer_api.batches.models import BatchCreate, FileDeleted
from producer_api.batches.queue import cancel_batch, create_batch
from producer_api.batches.store import BatchObject, BatchPage, BatchStore
from producer_api.idempotency import IdempotencyKey, once
from producer_api.ownership import owner_of
from producer_api.routing import OpenAIRoute
from producer_api.state import state_of
from shared.errors import ValidationError
from shared.redis_connect import connect

router = APIRouter(tags=["Batch"], dependencies=[Depends(authenticate)], route_class=OpenAIRoute)


def batch_store(request: Request) -> BatchStore:
    """The app's batch store, made on first use (the app's own Redis client is asyncio)."""
    store: BatchStore | None = getattr(request.app.state, "batch_store", None)
    if store is None:
        settings = state_of(request).settings
        store = BatchStore(settings, connect(settings, socket_connect_timeout=2.0))  # type: ignore[arg-type]
        request.app.state.batch_store = store
    return store


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
async def create_file(
    request: Request, owner: str | None = Depends(owner_of), idempotency_key: str | None = IdempotencyKey
) -> JSONResponse:
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

    async def upload() -> JSONResponse:
        def put() -> FileObject:
            return store.files.put(content, filename=filename, purpose=purpose, owner=owner)

        return JSONResponse((await to_thread.run_sync(put)).model_dump(mode="json"))

    fingerprint = ("/v1/files", filename, purpose, hashlib.sha256(content).hexdigest())
    return await once(state_of(request), owner, idempotency_key, fingerprint, upload)


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


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, summary="Delete a file")
def delete_file(
    file_id: str, store: BatchStore = Depends(batch_store), owner: str | None = Depends(owner_of)
) -> FileDeleted:
    store.files.delete(file_id, owner=owner)
    return FileDeleted(id=file_id)


@router.post("/v1/batches", response_model=BatchObject, summary="Create a batch from an uploaded file")
async def create(
    request: Request,
    body: BatchCreate,
    store: BatchStore = Depends(batch_store),
    owner: str | None = Depends(owner_of),
    key: ApiKey | None = Depends(authenticate),
    idempotency_key: str | None = IdempotencyKey,
) -> JSONResponse:
    tenant = state_of(request).tenants.resolve(request, key)

    def make() -> BatchObject:
        return create_batch(
            store.settings,
            store,
            input_file_id=body.input_file_id,
            endpoint=body.endpoint,
            completion_window=body.completion_window,
            metadata=body.metadata,
            model=body.model,
            owner=owner,
            tenant=tenant,
            connection=store.redis,
        )

    async def created() -> JSONResponse:
        return JSONResponse((await to_thread.run_sync(make)).model_dump(mode="json"))

    fingerprint = ("/v1/batches", body.model_dump(mode="json"))
    return await once(state_of(request), owner, idempotency_key, fingerprint, created)


@router.get("/v1/batches", response_model=BatchPage, summary="Batches, newest first")
def list_batches(
    limit: int = Query(20, ge=1, le=100),
    after: str | None = Query(None, description="The last id of the previous page."),
    store: BatchStore = Depends(batch_store),
    owner: str | None = Depends(owner_of),
) -> BatchPage:
    return store.list(limit=limit, after=after, owner=owner)


@router.get("/v1/batches/{batch_id}", response_model=BatchObject, summary="A batch's status and counts")
def retrieve(
    batch_id: str, store: BatchStore = Depends(batch_store), owner: str | None = Depends(owner_of)
) -> BatchObject:
    return store.get(batch_id, owner=owner)


@router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject, summary="Cancel a batch")
def cancel(
    batch_id: str, store: BatchStore = Depends(batch_store), owner: str | None = Depends(owner_of)
) -> BatchObject:
    return cancel_batch(store.settings, store, batch_id, connection=store.redis, owner=owner)
