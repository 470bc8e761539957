"""Request and response bodies of the Files and Batch routes that the store does not define
(``FileObject``, ``FilePage``, ``BatchObject`` and ``BatchPage`` are the stored shapes themselves)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class BatchCreate(BaseModel):
    # SDKs add fields over time (output_expires_after, ...); unknown ones are ignored, not refused.
    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str = Field(examples=["/v1/chat/completions"])
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    model: str | None = Field(None, description="Extension: run every line on this model, whatever it names.")


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True
