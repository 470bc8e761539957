"""Prompts -> token ids, and the token limits TGI's router enforces before anything is queued.

One tokenizer per served model, loaded at startup; the API never loads weights. Tokenizing is
CPU work, so callers run it in a thread to keep the event loop free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.errors import ModelNotFoundError, ValidationError
from shared.model_source import load_tokenizer
from shared.settings import Settings

# Roles a chat template understands; "developer" is OpenAI's newer name for "system"; "tool"
# carries a tool call's result.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Token:
    id: int
    text: str
    start: int
    stop: int


class Tokenizers:
    def __init__(self, settings: Settings, loaded: dict[str, Any] | None = None) -> None:
        self._settings = settings
        self._by_model: dict[str, Any] = dict(loaded or {})

    @classmethod
    def load(cls, settings: Settings) -> Tokenizers:
        # Models that share a tokenizer source load it once.
        return cls(settings, {model: load_tokenizer(model) for model in settings.served_models})

    def get(self, model: str) -> Any:
        try:
            return self._by_model[model]
        except KeyError:
            raise ModelNotFoundError(
                f"model {model!r} is not served here; served: {', '.join(self._by_model)}", field="model"
            ) from None

    def encode(self, model: str, text: str) -> list[int]:
        return list(self.get(model)(text, add_special_tokens=True)["input_ids"])

    def tokenize(self, model: str, text: str) -> list[Token]:
        tokenizer = self.get(model)
        encoded = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        pieces = tokenizer.convert_ids_to_tokens(ids)
        return [
            Token(id=i, text=text[a:b] if b > a else piece, start=a, stop=b)
            for i, piece, (a, b) in zip(ids, pieces, encoded["offset_mapping"], strict=True)
        ]

    def decode(self, model: str, ids: list[int]) -> str:
        return self.get(model).decode(ids, skip_special_tokens=False)

    def special_ids(self, model: str) -> frozenset[int]:
        return frozenset(self.get(model).all_special_ids)

    def chat_template(self, model: str) -> str:
        return getattr(self.get(model), "chat_template", None) or ""

    def apply_chat_template(
        self, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        tokenizer = self.get(model)
        if not getattr(tokenizer, "chat_template", None):
            raise ValidationError(f"model {model!r} has no chat template; use a completion route", field="messages")
        for i, message in enumerate(messages):
            if message["role"] not in CHAT_ROLES:
                raise ValidationError(
                    f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}", field=f"messages.{i}.role"
                )
        templated = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
        try:
            text = tokenizer.apply_chat_template(templated, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # a template may raise on orders it forbids (e.g. two user turns)
            raise ValidationError(f"the chat template rejected these messages: {exc}", field="messages") from None
        # The template already wrote the special tokens; adding them again would double the BOS.
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def enforce_limits(
    settings: Settings,
    prompt_token_ids: list[int],
    max_new_tokens: int | None,
    *,
    prompt_field: str,
    max_new_tokens_field: str,
    truncate: int | None = None,
) -> tuple[list[int], int]:
    """(prompt ids, max_new_tokens) after TGI's checks: input and total token budgets, the cap."""
    if truncate is not None and len(prompt_token_ids) > truncate:
        prompt_token_ids = prompt_token_ids[-truncate:]  # keep the end: it is what the model continues
    n_input = len(prompt_token_ids)
    if n_input == 0:
        raise ValidationError(f"{prompt_field} must not be empty", field=prompt_field)
    if n_input > settings.max_input_tokens:
        raise ValidationError(
            f"{prompt_field} must have at most {settings.max_input_tokens} tokens; given {n_input}",
            field=prompt_field,
        )
    if max_new_tokens is None:
        room = settings.max_total_tokens - n_input
        if room < 1:
            raise ValidationError(
                f"{prompt_field} ({n_input} tokens) leaves no room under max_total_tokens {settings.max_total_tokens}",
                field=prompt_field,
            )
        return prompt_token_ids, min(settings.default_max_new_tokens, settings.max_new_tokens, room)
    if max_new_tokens < 1:
        raise ValidationError(f"{max_new_tokens_field} must be at least 1", field=max_new_tokens_field)
    if max_new_tokens > settings.max_new_tokens:
        raise ValidationError(
            f"{max_new_tokens_field} must be at most {settings.max_new_tokens}; given {max_new_tokens}",
            field=max_new_tokens_field,
        )
    if n_input + max_new_tokens > settings.max_total_tokens:
        raise ValidationError(
            f"{prompt_field} tokens + {max_new_tokens_field} must be <= {settings.max_total_tokens}; "
            f"given {n_input} + {max_new_tokens}",
            field=max_new_tokens_field,
        )
    return prompt_token_ids, max_new_tokens
