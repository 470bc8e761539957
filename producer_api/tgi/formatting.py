"""Queue events -> TGI's wire shapes (/generate, /generate_stream and the jobs stream share them)."""

from __future__ import annotations

from typing import Any

from producer_api import sse
from producer_api.errors import TGI
from shared.errors import InflightqError
from shared.schemas import ErrorEvent, FinalResult, TokenEvent


def token(event: TokenEvent) -> dict[str, Any]:
    return {"id": event.token_id, "text": event.text, "logprob": event.logprob, "special": event.special}


def top_tokens(event: TokenEvent, special_ids: frozenset[int]) -> list[dict[str, Any]] | None:
    if event.top_logprobs is None:
        return None
    return [
        {"id": t.token_id, "text": t.text, "logprob": t.logprob, "special": t.token_id in special_ids}
        for t in event.top_logprobs
    ]


def stream_details(result: FinalResult, seed: int | None) -> dict[str, Any]:
    return {
        "finish_reason": result.finish_reason,
        "generated_tokens": result.usage.completion_tokens,
        "input_length": result.usage.prompt_tokens,
        "seed": seed,
    }


class TgiStream:
    """TGI's SSE (``relay.Formatter``): one event per token; the last token's event waits for the
    result so it can carry ``generated_text`` and ``details``. ``with_ids`` adds ``id: <index>``
    for Last-Event-ID resume (the jobs stream).

    Only the last token is held: the worker marks it with its ``finish_reason``, so every other
    token goes out the moment it arrives, and time to first token is not one token longer."""

    def __init__(
        self, *, seed: int | None, special_ids: frozenset[int], prefix: str = "", with_ids: bool = False
    ) -> None:
        self.seed = seed
        self.special_ids = special_ids
        self.prefix = prefix
        self.with_ids = with_ids
        self.held: TokenEvent | None = None

    def _frame(self, tok: TokenEvent, result: FinalResult | None) -> str:
        data = {
            "index": tok.index,
            "token": token(tok),
            "generated_text": self.prefix + result.text if result else None,
            "details": stream_details(result, self.seed) if result else None,
            "top_tokens": top_tokens(tok, self.special_ids),
        }
        return sse.event(data, event_id=tok.index if self.with_ids else None)

    def _flush(self) -> list[str]:
        """The held token as it is, when it turned out not to be the last."""
        held, self.held = self.held, None
        return [self._frame(held, None)] if held is not None else []

    def opening(self) -> list[str]:
        return []

    def token(self, choice: int, event: TokenEvent) -> list[str]:
        frames = self._flush()
        if event.finish_reason is None:
            frames.append(self._frame(event, None))
        else:
            self.held = event
        return frames

    def done(self, choice: int, result: FinalResult) -> list[str]:
        held, self.held = self.held, None
        if held is None:
            # Resumed after the last token, or a result without token events: restate the last token.
            index = max(0, len(result.token_ids) - 1)
            last = result.token_ids[-1] if result.token_ids else 0
            held = TokenEvent(request_id=result.request_id, index=index, token_id=last)
        return [self._frame(held, result)]

    def failed(self, choice: int, event: ErrorEvent) -> list[str]:
        return [*self._flush(), sse.event({"error": event.message, "error_type": event.error_type})]

    async def closing(self) -> list[str]:
        return []

    def error(self, error: InflightqError) -> list[str]:
        # The status line is long gone: an error can only travel as an event (huggingface_hub raises it).
        return [*self._flush(), sse.event(TGI.body(error))]
