"""LoRA adapters on the API: which model and adapter a request's name means, and the admin routes that
add and remove adapters of the deployment at run time (vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``). The registry itself is ``shared.adapters``, in Redis."""

from __future__ import annotations

import re

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from producer_api.api_keys import ApiKey
from producer_api.auth import authenticate
from producer_api.models_common import OPENAI_ERRORS
from producer_api.routing import OpenAIRoute
from producer_api.state import AppState, state_of
from producer_api.validation import resolve_model
from shared.adapters import (
    NAME_PATTERN,
    AdapterRecord,
    all_adapters_async,
    lookup_async,
    register_async,
    unregister_async,
)
from shared.errors import AdapterNotFoundError, ModelNotFoundError, ValidationError
from shared.keys import Keys

router = APIRouter(prefix="/v1", tags=["OpenAI"], route_class=OpenAIRoute)


def _keys(st: AppState) -> Keys:
    return Keys.for_prefix(st.settings.key_prefix)


async def resolve_model_or_adapter(st: AppState, name: str, field: str = "model") -> tuple[str, str | None]:
    """``(model, adapter)`` a request's model name means: a served model (or the default's placeholder) runs
    as itself, a registered adapter's name on its base model; anything else is a 404 naming it (a name no
    adapter can have, one with a lone surrogate say, without asking Redis)."""
    model = resolve_model(st.settings, name)
    if model in st.settings.served_models:
        return model, None
    record = await lookup_async(st.redis, _keys(st), name) if re.match(NAME_PATTERN, name) else None
    if record is None or record.base not in st.settings.served_models:
        served = ", ".join(st.settings.served_models)
        raise AdapterNotFoundError(
            f"model {name!r} is neither served here nor a LoRA adapter of a served model; served: {served}",
            field=field,
        )
    return record.base, record.name


async def resolve_adapter_id(st: AppState, model: str, adapter_id: str, field: str) -> str:
    """TGI's ``adapter_id``: a registered adapter of ``model``, else a 404 naming it."""
    record = await lookup_async(st.redis, _keys(st), adapter_id) if re.match(NAME_PATTERN, adapter_id) else None
    if record is None or record.base != model:
        raise AdapterNotFoundError(f"adapter {adapter_id!r} is not a LoRA adapter of model {model!r}", field=field)
    return record.name


async def adapters_of(st: AppState) -> dict[str, AdapterRecord]:
    return await all_adapters_async(st.redis, _keys(st))


class LoadAdapter(BaseModel):
    lora_name: str = Field(pattern=NAME_PATTERN, description="What requests call it (the OpenAI `model`).")
    lora_path: str = Field(min_length=1, description="Its directory (PEFT's format) as the workers see it.")
    base_model: str | None = Field(None, description="The served model it adapts; unset = the default model.")


class UnloadAdapter(BaseModel):
    lora_name: str = Field(min_length=1)


@router.post(
    "/load_lora_adapter", response_model=AdapterRecord, responses=OPENAI_ERRORS, summary="Register a LoRA adapter"
)
async def load_lora_adapter(
    body: LoadAdapter, request: Request, key: ApiKey | None = Depends(authenticate)
) -> AdapterRecord:
    """Adds the adapter to the deployment's registry: every worker of its base finds it from the next
    request on (loading it on first use), every API replica routes its name."""
    st = state_of(request)
    base = resolve_model(st.settings, body.base_model or st.settings.model)
    if base not in st.settings.served_models:
        raise ModelNotFoundError(f"base_model {base!r} is not served here", field="base_model")
    if body.lora_name in st.settings.served_models:
        raise ValidationError(f"{body.lora_name!r} is a served model's name", field="lora_name")
    record = AdapterRecord(name=body.lora_name, base=base, path=body.lora_path)
    await register_async(st.redis, _keys(st), record)
    return record


@router.post(
    "/unload_lora_adapter",
    response_model=UnloadAdapter,
    responses={**OPENAI_ERRORS, 404: {"description": "no such adapter"}},
    summary="Remove a LoRA adapter",
)
async def unload_lora_adapter(
    body: UnloadAdapter, request: Request, key: ApiKey | None = Depends(authenticate)
) -> UnloadAdapter:
    """Removes the adapter from the registry: new requests naming it get a 404; running ones finish."""
    st = state_of(request)
    if not await unregister_async(st.redis, _keys(st), body.lora_name):
        raise AdapterNotFoundError(f"adapter {body.lora_name!r} is not registered", field="lora_name")
    return body
