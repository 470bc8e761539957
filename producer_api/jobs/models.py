"""Bodies of the async jobs API (/v1/jobs): submit now, collect or stream later.

Sampling fields are shared.schemas.SamplingFields: the engine's SamplingParams names and ranges."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from producer_api.models_common import RequestOptions, StrictModel
from producer_api.openai.models import ChatMessage
from shared.request_lifecycle import RequestStatus
from shared.schemas import SamplingFields


class JobRequest(RequestOptions, SamplingFields, StrictModel):
    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        json_schema_extra={
            "examples": [
                {"prompt": "Write a haiku about queues.", "max_new_tokens": 64, "temperature": 0.7, "priority": 2}
            ]
        },
    )

    model: str | None = Field(None, description="A served model; the default model when omitted.")
    prompt: str | list[int] | None = Field(None, description="Text, or token ids.", examples=["Once upon a time"])
    messages: list[ChatMessage] | None = Field(None, description="Chat messages (the model's chat template).")
    max_new_tokens: int | None = Field(None, ge=1, examples=[64])
    # Checked against the model's vocabulary by the route, whose error names the field itself.
    stop_token_ids: list[int] = Field(default_factory=list)
    tenant: str | None = Field(
        None,
        max_length=128,
        description="The tenant whose fair share the job draws on; ignored when an API key names the tenant, "
        "and under tenant_source=header.",
    )

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _one_input(self) -> JobRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class JobCreated(StrictModel):
    id: str
    object: Literal["job"] = "job"
    status: RequestStatus
    model: str
    priority: int
    prompt_tokens: int
    max_new_tokens: int
    tenant: str | None = Field(None, description="The tenant it runs as (README: Tenants, weights and limits).")


class JobUsage(StrictModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class JobResult(StrictModel):
    generated_text: str
    token_ids: list[int]
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    usage: JobUsage
    queue_time_s: float
    inference_time_s: float


class JobError(StrictModel):
    error: str
    error_type: str


class Job(StrictModel):
    id: str
    object: Literal["job"] = "job"
    status: RequestStatus
    model: str | None = None
    priority: int | None = None
    submitted_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None
    attempt: int | None = None
    tenant: str | None = Field(None, description="The tenant it runs as.")
    result: JobResult | None = None
    error: JobError | None = None


class JobCancelled(StrictModel):
    id: str
    object: Literal["job"] = "job"
    cancelled: bool = Field(
        description="True for the one call that cancelled the job; False when it had already finished or "
        "another call had already cancelled it."
    )
