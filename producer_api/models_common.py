"""Fields every route accepts besides its own: scheduling (priority, deadline) and vLLM-style extensions."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class RequestOptions(BaseModel):
    """Mixed into every generation request body."""

    # JSON's Infinity/NaN would pass range checks (or reach the worker as null): refuse them.
    model_config = ConfigDict(allow_inf_nan=False)

    priority: int | None = Field(
        None, ge=0, description="0 is the most urgent; at most priority_levels - 1. Clamped to the API key's ceiling."
    )
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token (vLLM extension).")
    speculate: bool | None = Field(
        None,
        description="Speculative decoding from the request's own text (n-gram lookup): true or false; unset = "
        "the worker's speculate_by_default. The output is the same either way.",
    )
    timeout: float | None = Field(
        None, gt=0, description="Seconds from now after which the request is dropped (expired)."
    )
    deadline: float | None = Field(None, gt=0, description="Unix time after which the request is dropped (expired).")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class LimitInfo(BaseModel):
    """The limit a 429 hit: tenant_max_queued, requests_per_minute or tokens_per_minute, and its size."""

    name: str
    value: int | None = None


class ErrorBody(BaseModel):
    """TGI's error body (TGI routes and the jobs API)."""

    error: str
    error_type: str
    field: str | None = None
    limit: LimitInfo | None = None


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    limit: LimitInfo | None = None


class OpenAIErrorBody(BaseModel):
    error: OpenAIErrorDetail


TGI_ERRORS: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in (
        (401, "missing or invalid API key"),
        (413, "body larger than max_body_bytes"),
        (422, "validation failed; the body names the field"),
        (424, "generation failed"),
        (
            429,
            "overloaded (the model's queue too deep, or code tenant_overloaded: the tenant's own max_queued) or "
            "rate_limited (the API key's requests or tokens per minute); `limit` names the limit, Retry-After "
            "says when to retry",
        ),
        (408, "expired: the request's deadline or timeout passed before it finished"),
        (503, "Redis unreachable or no live worker for the model"),
    )
}
OPENAI_ERRORS: dict[int | str, dict[str, object]] = {
    status: {"model": OpenAIErrorBody, "description": spec["description"]} for status, spec in TGI_ERRORS.items()
}


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with its ``$defs`` written in place: for a schema embedded in a
    route's OpenAPI by hand (an SSE event's), where ``#/$defs/...`` would point at nothing
    (a schema reader such as schemathesis cannot resolve them)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node

    return resolve(schema)
