"""OpenAI's Batch API: create, retrieve, cancel, list. Thin over ``shared/batch_queue.py``
(the RQ side) and ``shared/batch_store.py`` (the records)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field

from producer_api.auth import authenticate
from producer_api.routes_files import batch_store, owner_of
from shared.batch_queue import cancel_batch, create_batch
from shared.batch_store import BatchObject, BatchPage, BatchStore

router = APIRouter(tags=["Batch"], dependencies=[Depends(authenticate)])


class BatchCreate(BaseModel):
    # SDKs add fields over time (output_expires_after, ...); unknown ones are ignored, not refused.
    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str = Field(examples=["/v1/chat/completions"])
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    model: str | None = Field(None, description="Extension: run every line on this model, whatever it names.")


@router.post("/v1/batches", response_model=BatchObject, summary="Create a batch from an uploaded file")
def create(
    body: BatchCreate, store: BatchStore = Depends(batch_store), owner: str | None = Depends(owner_of)
) -> BatchObject:
    return create_batch(
        store.settings,
        store,
        input_file_id=body.input_file_id,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        metadata=body.metadata,
        model=body.model,
        owner=owner,
        connection=store.redis,
    )


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
