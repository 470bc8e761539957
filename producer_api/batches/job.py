"""The RQ job behind ``/v1/batches``: one run of one batch (``producer_api/batches/runner.py``).

RQ calls ``run_batch`` by name with JSON arguments. It never touches a model or torch: it
tokenizes lines and queues them at the lowest priority, as the API does for its own requests.

It lives with the API because a batch line's body is an OpenAI request body: it is checked by
the very code the routes use (request models, chat template, token limits), so a line fails in
a batch exactly when it would fail over HTTP. Those modules are imported lazily, and warmed up
before RQ forks a run."""

from __future__ import annotations

import importlib
import logging
import re
import time
from typing import Any

import pydantic

from producer_api.batches.runner import BatchRunner, PreparedRequest
from producer_api.batches.store import BatchStore
from shared.adapters import NAME_PATTERN, lookup
from shared.client import QueueClient
from shared.errors import ModelNotFoundError, UnsupportedParameterError, ValidationError
from shared.keys import Keys
from shared.model_source import load_tokenizer
from shared.request_builder import sampling_spec
from shared.schemas import FinalResult
from shared.settings import Settings, get_settings
from shared.valid_text import check_text

log = logging.getLogger("inflightq.batch")

# Tokenizers by model, shared by every run in this process. The batch worker fills it before
# it forks a run (``warm_up``), so a run starts without loading transformers again.
_TOKENIZERS: dict[str, Any] = {}


def warm_up(settings: Settings) -> None:
    """Import what a run needs and load the served models' tokenizers, once, before RQ forks."""
    for module in ("producer_api.openai.models", "producer_api.tokenization", "producer_api.validation"):
        importlib.import_module(module)
    for model in settings.served_models:
        try:
            _TOKENIZERS.setdefault(model, load_tokenizer(model))
        except Exception:  # a model that cannot load here fails its lines later, with a message
            log.warning("no tokenizer for %s yet; lines naming it will load it or fail", model, exc_info=True)


def run_batch(batch_id: str, key_prefix: str) -> str:
    """Run (or resume) a batch until it is completed, cancelled, expired or failed."""
    settings = get_settings().model_copy(update={"key_prefix": key_prefix})
    client = QueueClient(settings)
    try:
        store = BatchStore(settings, client.redis)
        status = BatchRunner(store, client, ApiLineHandler(settings, client.redis), batch_id).run()
        log.info("batch %s: %s", batch_id, status.value)
        return status.value
    finally:
        client.close()


def _field_error(exc: pydantic.ValidationError) -> ValidationError:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or "body"
    return ValidationError(f"{field}: {err['msg']}", field=field)


class ApiLineHandler:
    """Line bodies -> queue requests, and results -> response bodies, with the API's own code."""

    def __init__(self, settings: Settings, redis: Any = None) -> None:
        """``redis``: where the deployment's LoRA adapters are registered (None: lines name served models only)."""
        self.settings = settings
        self.redis = redis
        self._loaded = _TOKENIZERS

    def _model_and_adapter(self, name: str) -> tuple[str, str | None]:
        """A line's model: a served model, or a registered LoRA adapter's name (run on its base model)."""
        if name in self.settings.served_models or self.redis is None or not re.match(NAME_PATTERN, name):
            return name, None
        record = lookup(self.redis, Keys.for_prefix(self.settings.key_prefix), name)
        if record is None or record.base not in self.settings.served_models:
            return name, None  # _tokenizers names it in its 404
        return record.base, record.name

    def _tokenizers(self, model: str) -> Any:
        from producer_api.tokenization import Tokenizers

        if model not in self.settings.served_models:
            raise ModelNotFoundError(
                f"model {model!r} is not served here; served: {', '.join(self.settings.served_models)}",
                field="model",
            )
        if model not in self._loaded:
            self._loaded[model] = load_tokenizer(model)
        return Tokenizers(self.settings, self._loaded)

    def prepare(self, endpoint: str, body: dict[str, Any], model: str | None) -> PreparedRequest:
        from producer_api.openai.models import ChatCompletionRequest, CompletionRequest
        from producer_api.openai.structured import response_format_constraint
        from producer_api.tokenization import enforce_limits
        from producer_api.validation import check_stops

        check_text(body)  # as the routes check every body
        if model:
            body = {**body, "model": model}
        request: ChatCompletionRequest | CompletionRequest
        try:
            if endpoint == "/v1/chat/completions":
                request = ChatCompletionRequest.model_validate(body)
            else:
                request = CompletionRequest.model_validate(body)
        except pydantic.ValidationError as exc:
            raise _field_error(exc) from None
        _refuse_unsupported(request)
        request.model, adapter = self._model_and_adapter(request.model)
        tokenizers = self._tokenizers(request.model)
        if isinstance(request, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text} for m in request.messages]
            ids = tokenizers.apply_chat_template(request.model, messages)
            max_new = request.max_completion_tokens or request.max_tokens
            prompt_field = "messages"
        else:
            ids = _completion_prompt(tokenizers, request)
            max_new = request.max_tokens
            prompt_field = "prompt"
        ids, max_new = enforce_limits(
            self.settings, ids, max_new, prompt_field=prompt_field, max_new_tokens_field="max_tokens"
        )
        spec = sampling_spec(
            max_new_tokens=max_new,
            temperature=1.0 if request.temperature is None else request.temperature,  # OpenAI's default, as the API
            top_p=request.top_p,
            top_k=request.top_k,
            min_p=request.min_p,
            repetition_penalty=request.repetition_penalty,
            frequency_penalty=request.frequency_penalty,
            presence_penalty=request.presence_penalty,
            seed=request.seed,
            stop=check_stops(self.settings, request.stop_list),
            ignore_eos=request.ignore_eos,
            constraint=response_format_constraint(request.response_format),
        )
        return PreparedRequest(model=request.model, prompt_token_ids=ids, sampling=spec, adapter=adapter)

    def response_body(self, endpoint: str, request_id: str, result: FinalResult) -> dict[str, Any]:
        from producer_api.openai.formatting import system_fingerprint
        from producer_api.openai.models import (
            AssistantMessage,
            ChatChoice,
            ChatCompletion,
            Completion,
            CompletionChoice,
            Usage,
        )

        finish = "length" if result.finish_reason == "length" else "stop"
        created = int(result.timings.finished_at or time.time())
        usage = Usage(**result.usage.model_dump())
        if endpoint == "/v1/chat/completions":
            return ChatCompletion(
                id=f"chatcmpl-{request_id}",
                created=created,
                model=result.model,
                choices=[ChatChoice(index=0, message=AssistantMessage(content=result.text), finish_reason=finish)],
                usage=usage,
                # As the live route answers: a batch's body is what the same request over HTTP returns.
                system_fingerprint=system_fingerprint(result.model),
            ).model_dump(mode="json")
        return Completion(
            id=f"cmpl-{request_id}",
            created=created,
            model=result.model,
            choices=[CompletionChoice(index=0, text=result.text, finish_reason=finish)],
            usage=usage,
        ).model_dump(mode="json")


def _refuse_unsupported(request: Any) -> None:
    """What a batch line cannot ask for: one choice, no streaming, no logprobs (not in results).
    A 400 naming the parameter in the line's response, as the live routes answer what they do not take."""
    if request.n != 1:
        raise UnsupportedParameterError("n must be 1 in a batch line", field="n")
    if request.stream:
        raise UnsupportedParameterError("stream is not available in a batch", field="stream")
    if getattr(request, "logit_bias", None):
        raise UnsupportedParameterError("logit_bias is not supported", field="logit_bias")
    if getattr(request, "tools", None):  # response_format works; tool calls only on the live routes
        raise UnsupportedParameterError("tools are not supported in a batch", field="tools")
    logprobs = getattr(request, "logprobs", None)
    if logprobs:
        raise UnsupportedParameterError("logprobs are not available in batch results", field="logprobs")
    if getattr(request, "echo", False):
        raise UnsupportedParameterError("echo is not supported in a batch", field="echo")
    if getattr(request, "suffix", None):
        raise UnsupportedParameterError("suffix is not supported", field="suffix")
    if (getattr(request, "best_of", None) or 1) > 1:
        raise UnsupportedParameterError("best_of must be 1", field="best_of")


def _completion_prompt(tokenizers: Any, request: Any) -> list[int]:
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a list is still one request
    if isinstance(prompt, str):
        return list(tokenizers.encode(request.model, prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        vocab = len(tokenizers.get(request.model))
        if any(not 0 <= t < vocab for t in prompt):
            raise ValidationError(f"prompt holds token ids outside the vocabulary (0..{vocab - 1})", field="prompt")
        return list(prompt)
    raise ValidationError("a batch line takes one prompt (a string or a list of token ids)", field="prompt")
