"""Queue events -> OpenAI's wire shapes: finish reasons, usage, logprobs, and the SSE chunk streams
of /v1/completions and /v1/chat/completions (n choices interleaved as their tokens arrive)."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from producer_api import sse
from producer_api.dispatch import Dispatcher, as_error, cancel_unfinished
from producer_api.errors import sse_error_payload
from producer_api.openai.structured import ToolCallStream
from producer_api.streaming import merge
from shared.schemas import ErrorEvent, FinalResult, TokenEvent


@dataclass(frozen=True)
class Reply:
    """What every chunk of one response repeats, and how its choices map to prompts."""

    id: str
    object: str  # "text_completion" or "chat.completion.chunk"
    created: int
    model: str
    prompts: list[list[int]]
    n: int  # choices per prompt: choice i answers prompt i // n
    include_usage: bool

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None, last: bool = False) -> str:
        data: dict[str, Any] = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        if self.object == "chat.completion.chunk":
            data["system_fingerprint"] = system_fingerprint(self.model)
        data["choices"] = choices
        if self.include_usage:
            data["usage"] = usage if last else None  # OpenAI: null on every chunk but the usage one
        return sse.event(data)


@functools.lru_cache(maxsize=64)
def system_fingerprint(model: str) -> str:
    """A string, as OpenAI and TGI send (TGI's own client requires one): the package version and the model."""
    return f"inflightq-{importlib.metadata.version('inflightq')}-{model}"


def finish_reason(result: FinalResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def usage(prompts: list[list[int]], results: list[FinalResult]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(r.usage.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(tokens: list[TokenEvent], offset: int, top: int) -> dict[str, Any]:
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{x.text: x.logprob for x in t.top_logprobs or []} for t in tokens] if top else None,
        "text_offset": offsets,
    }


def chat_logprobs(tokens: list[TokenEvent]) -> dict[str, Any]:
    def entry(text: str, logprob: float | None) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(t.text, t.logprob), "top_logprobs": [entry(x.text, x.logprob) for x in t.top_logprobs or []]}
            for t in tokens
        ]
    }


async def relay(
    reply: Reply,
    dispatcher: Dispatcher,
    request_ids: list[str],
    follow: dict[str, Any],
    path: str,
    *,
    prelude: list[str],
    on_token: Callable[[int, TokenEvent], str],
    on_finish: Callable[[int, FinalResult], str],
) -> AsyncIterator[str]:
    """The SSE body: prelude, a chunk per token and per finished choice, the usage chunk, [DONE].
    An error mid-way ends the stream with an error event; choices left unfinished are cancelled."""
    results: list[FinalResult] = []
    try:
        async with cancel_unfinished(dispatcher, request_ids) as finished:
            for chunk in prelude:
                yield chunk
            streams = [dispatcher.events(request_id, **follow) for request_id in request_ids]
            limit = dispatcher.settings.stream_buffer_events
            async with contextlib.aclosing(merge(streams, limit)) as merged:
                async for index, event in merged:
                    if isinstance(event, TokenEvent):
                        yield on_token(index, event)
                        continue
                    finished.add(event.request_id)
                    if isinstance(event, ErrorEvent):
                        yield sse.event(sse_error_payload(path, as_error(event)))
                        return
                    results.append(event.result)
                    yield on_finish(index, event.result)
    except Exception as exc:
        yield sse.event(sse_error_payload(path, exc))
        return
    if reply.include_usage:
        yield reply.chunk([], usage(reply.prompts, results), last=True)
    yield sse.DONE


def completion_stream(
    reply: Reply,
    dispatcher: Dispatcher,
    request_ids: list[str],
    follow: dict[str, Any],
    path: str,
    *,
    echoes: list[str],
    logprobs: int | None,
) -> AsyncIterator[str]:
    offsets = [len(echoes[i // reply.n]) for i in range(len(request_ids))]

    def choice(index: int, text: str, logprobs_: Any = None, finish: str | None = None) -> str:
        return reply.chunk([{"index": index, "text": text, "logprobs": logprobs_, "finish_reason": finish}])

    def on_token(index: int, event: TokenEvent) -> str:
        shown = None if logprobs is None else completion_logprobs([event], offsets[index], logprobs)
        offsets[index] += len(event.text)
        return choice(index, event.text, shown)

    prelude = [choice(i, echoes[i // reply.n]) for i in range(len(request_ids)) if echoes[i // reply.n]]
    return relay(
        reply,
        dispatcher,
        request_ids,
        follow,
        path,
        prelude=prelude,
        on_token=on_token,
        on_finish=lambda index, result: choice(index, "", None, finish_reason(result)),
    )


def chat_stream(
    reply: Reply,
    dispatcher: Dispatcher,
    request_ids: list[str],
    follow: dict[str, Any],
    path: str,
    *,
    logprobs: bool,
    tools: bool = False,
) -> AsyncIterator[str]:
    def choice(index: int, delta: dict[str, Any], logprobs_: Any = None, finish: str | None = None) -> str:
        # As TGI: every delta names its role and carries tool_calls (null without calls); TGI's own
        # client requires both, OpenAI's accepts them.
        delta = {"role": "assistant", **delta, "tool_calls": delta.get("tool_calls")}
        return reply.chunk([{"index": index, "delta": delta, "logprobs": logprobs_, "finish_reason": finish}])

    if not tools:
        on_token: Callable[[int, TokenEvent], str] = lambda index, event: choice(  # noqa: E731
            index, {"content": event.text}, chat_logprobs([event]) if logprobs else None
        )
        on_finish: Callable[[int, FinalResult], str] = lambda index, result: choice(  # noqa: E731
            index, {}, None, finish_reason(result)
        )
    else:  # text that may be a tool call is held back until it is a whole call (or plainly text)
        splitters = [ToolCallStream(request_id) for request_id in request_ids]

        def on_token(index: int, event: TokenEvent) -> str:
            return "".join(choice(index, delta) for delta in splitters[index].feed(event.text))

        def on_finish(index: int, result: FinalResult) -> str:
            splitter = splitters[index]
            tail = "".join(choice(index, delta) for delta in splitter.finish())
            called = splitter.made_calls and result.finish_reason != "length"
            return tail + choice(index, {}, None, "tool_calls" if called else finish_reason(result))

    return relay(
        reply,
        dispatcher,
        request_ids,
        follow,
        path,
        # OpenAI's first chunk of each choice names the role.
        prelude=[choice(i, {"role": "assistant", "content": ""}) for i in range(len(request_ids))],
        on_token=on_token,
        on_finish=on_finish,
    )
