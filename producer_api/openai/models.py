"""Request and response bodies of OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models).

Requests accept unknown fields (SDKs add new ones often) but reject known features this server
does not have (suffix, logit_bias) instead of silently ignoring them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from producer_api.models_common import RequestOptions
from shared.schemas import Seed

MAX_N = 16  # choices per request; each is a queued request of its own


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(RequestOptions):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(examples=["smollm2-135m-instruct"])
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="Extension (vLLM).")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="Extension (vLLM).")
    repetition_penalty: float | None = Field(None, gt=0.0, description="Extension (vLLM).")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "max_tokens": 32}]
        }
    )

    prompt: str | list[str] | list[int] | list[list[int]] = Field(examples=["Once upon a time"])
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = Field(None, description="Not supported; must be null.")
    response_format: dict[str, Any] | None = Field(
        None, description="{'type': 'text' | 'json_object'} or {'type': 'json_schema', 'json_schema': {...}}."
    )
    logit_bias: dict[str, float] | None = Field(None, description="Not supported; must be null or empty.")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(examples=["user"])
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model": "smollm2-135m-instruct",
                    "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_completion_tokens": 32,
                    "stream": False,
                    "priority": 1,
                }
            ]
        }
    )

    messages: list[ChatMessage] = Field(min_length=1, examples=[[{"role": "user", "content": "Say hello."}]])
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = Field(None, description="Functions the model may call (type 'function').")
    tool_choice: Any | None = Field(None, description="none, auto (default with tools), required, or a function.")
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = Field(
        None, description="{'type': 'text' | 'json_object'} or {'type': 'json_schema', 'json_schema': {...}}."
    )
    logit_bias: dict[str, float] | None = Field(None, description="Not supported; must be null or empty.")


# Responses --------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = Field(None, description="The package version and the model.")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = Field(None, description="The package version and the model.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "inflightq"
    parent: str | None = Field(None, description="A LoRA adapter's base model (vLLM's field); null for a model.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
