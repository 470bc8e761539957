"""Request and response bodies of TGI's API (/generate, /generate_stream, /, /tokenize, /info).

Field names and shapes follow TGI so huggingface_hub's InferenceClient parses them unchanged."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from producer_api.models_common import RequestOptions, StrictModel
from shared.schemas import Seed

MAX_BEST_OF = 4

FinishReason = Literal["length", "eos_token", "stop_sequence"]


class Grammar(StrictModel):
    type: Literal["json", "regex", "json_object"]
    value: Any = None


class GenerateParameters(RequestOptions, StrictModel):
    best_of: int | None = Field(
        None,
        ge=1,
        le=MAX_BEST_OF,
        description="Sample this many sequences, return the one of highest cumulative logprob; the others "
        "in details.best_of_sequences. Needs sampling, no seed, no stream (as TGI).",
    )
    decoder_input_details: bool = Field(False, description="Return the prompt tokens (without logprobs).")
    details: bool = Field(False, description="Return tokens, logprobs, finish reason and seed.")
    do_sample: bool = Field(False, description="Sample instead of greedy decoding.")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    grammar: Grammar | None = Field(
        None, description="Structured output: {'type': 'json', 'value': schema} or {'type': 'regex', 'value': pattern}."
    )
    adapter_id: str | None = Field(
        None, description="A LoRA adapter of the model, by its registered name (POST /v1/load_lora_adapter)."
    )
    max_new_tokens: int | None = Field(None, ge=1, examples=[32])
    repetition_penalty: float | None = Field(None, gt=0.0)
    return_full_text: bool = Field(False, description="Prepend the prompt to generated_text.")
    seed: Seed | None = None
    stop: list[str] = Field(default_factory=list, description="Stop sequences (not included in the output).")
    temperature: float | None = Field(None, gt=0.0, le=100.0)
    top_k: int | None = Field(None, gt=0)
    top_n_tokens: int | None = Field(None, ge=0, le=20, description="Most likely alternatives per token.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    truncate: int | None = Field(None, ge=1, description="Keep only the last `truncate` prompt tokens.")
    typical_p: float | None = Field(None, gt=0.0, le=1.0)
    watermark: bool = Field(
        False, description="TGI's green-list watermark (Kirchenbauer et al.; gamma 0.5, delta 2.0, hash key 15485863)."
    )

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # TGI (serde Option) reads null as "not given"; so do we.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class GenerateRequest(StrictModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "inputs": "What is Deep Learning?",
                    "parameters": {"max_new_tokens": 32, "details": True, "priority": 0, "timeout": 30},
                }
            ]
        }
    )

    inputs: str = Field(min_length=1, examples=["What is Deep Learning?"])
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = Field(False, description="Only read by POST /: true streams like /generate_stream.")


class Token(StrictModel):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(StrictModel):
    id: int
    text: str
    logprob: float | None = None


class BestOfSequence(StrictModel):
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None


class Details(StrictModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None
    best_of_sequences: list[BestOfSequence] | None = None


class GenerateResponse(StrictModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(StrictModel):
    finish_reason: FinishReason
    generated_tokens: int
    input_length: int
    seed: int | None


class StreamResponse(StrictModel):
    """One SSE event of /generate_stream; the last carries generated_text and details."""

    index: int
    token: Token
    top_tokens: list[Token] | None = None
    generated_text: str | None = None
    details: StreamDetails | None = None


class SimpleToken(StrictModel):
    id: int
    text: str
    start: int
    stop: int


class Info(StrictModel):
    model_id: str
    model_sha: str | None = None
    model_pipeline_tag: str = "text-generation"
    models: list[str]
    max_best_of: int = MAX_BEST_OF
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    max_new_tokens: int
    max_queue_depth: int
    priority_levels: int
    default_priority: int
    router: str = "inflightq"
    version: str
    sha: str | None = None
    docker_label: str | None = None


class QueueView(StrictModel):
    model: str
    waiting: dict[str, int] = Field(
        description="Requests no worker has taken yet, per priority (p0 most urgent): every tenant's lane and "
        "every offer stream counted, as inflightq_queue_depth counts them. What an autoscaler scales on."
    )
    waiting_total: int
    oldest_waiting_age_s: float = Field(description="How long the oldest waiting request has waited (0 if none).")


class Health(StrictModel):
    status: Literal["ok", "unavailable"]
    redis: bool
    workers: dict[str, int] = Field(description="Live workers per served model.")
