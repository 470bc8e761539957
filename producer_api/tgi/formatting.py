"""Queue events -> TGI's wire shapes (/generate, /generate_stream and the jobs stream share them)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from producer_api import sse
from producer_api.errors import sse_error_payload
from shared.schemas import AnyEvent, DoneEvent, ErrorEvent, FinalResult, TokenEvent


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


async def stream_events(
    events: AsyncIterator[AnyEvent],
    *,
    path: str,
    seed: int | None,
    special_ids: frozenset[int],
    prefix: str = "",
    with_ids: bool = False,
) -> AsyncIterator[str]:
    """TGI's SSE: one event per token; the last token's event waits for the result so it can carry
    ``generated_text`` and ``details``. ``with_ids`` adds ``id: <index>`` for Last-Event-ID resume.

    Only the last token is held: the worker marks it with its ``finish_reason``, so every other
    token goes out the moment it arrives. (Holding each token until the next one showed whether it
    was the last cost every stream one inter-token latency of time to first token.)"""
    held: TokenEvent | None = None

    def frame(tok: TokenEvent, result: FinalResult | None) -> str:
        data = {
            "index": tok.index,
            "token": token(tok),
            "generated_text": prefix + result.text if result else None,
            "details": stream_details(result, seed) if result else None,
            "top_tokens": top_tokens(tok, special_ids),
        }
        return sse.event(data, event_id=tok.index if with_ids else None)

    try:
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            async for event in events:
                if isinstance(event, TokenEvent):
                    if held is not None:  # a token marked final was not: say it as it is
                        yield frame(held, None)
                        held = None
                    if event.finish_reason is None:
                        yield frame(event, None)
                    else:
                        held = event
                    continue
                if isinstance(event, DoneEvent):
                    result = event.result
                    if held is None:
                        # Resumed after the last token, or a result without token events: restate the last token.
                        index = max(0, len(result.token_ids) - 1)
                        last = result.token_ids[-1] if result.token_ids else 0
                        held = TokenEvent(request_id=result.request_id, index=index, token_id=last)
                    yield frame(held, result)
                    held = None
                elif isinstance(event, ErrorEvent):
                    if held is not None:
                        yield frame(held, None)
                        held = None
                    yield sse.event({"error": event.message, "error_type": event.error_type})
    except Exception as exc:
        # The status line is long gone: an error can only travel as an event (huggingface_hub raises it).
        if held is not None:
            yield frame(held, None)
        yield sse.event(sse_error_payload(path, exc))
