"""Queue events -> OpenAI's wire shapes: finish reasons, usage, logprobs, and the SSE chunk streams
of /v1/completions and /v1/chat/completions (n choices interleaved as their tokens arrive)."""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass
from typing import Any

from producer_api import sse
from producer_api.dispatch import as_error
from producer_api.errors import OPENAI
from producer_api.openai.structured import ToolCallStream
from shared.errors import InflightqError
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


class ChoiceStream:
    """OpenAI's chunk streams (``relay.Formatter``): the opening chunks, a chunk per token and per
    finished choice, the usage chunk when asked for, ``[DONE]``. A choice that fails ends the stream
    with an error event and no ``[DONE]``."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.results: list[FinalResult] = []
        self.failed_choice = False

    def opening(self) -> list[str]:
        return []

    def token(self, choice: int, event: TokenEvent) -> list[str]:
        raise NotImplementedError

    def finish(self, choice: int, result: FinalResult) -> list[str]:
        raise NotImplementedError

    def done(self, choice: int, result: FinalResult) -> list[str]:
        self.results.append(result)
        return self.finish(choice, result)

    def failed(self, choice: int, event: ErrorEvent) -> list[str]:
        self.failed_choice = True
        return self.error(as_error(event))

    async def closing(self) -> list[str]:
        if self.failed_choice:
            return []
        if not self.reply.include_usage:
            return [sse.DONE]
        return [self.reply.chunk([], usage(self.reply.prompts, self.results), last=True), sse.DONE]

    def error(self, error: InflightqError) -> list[str]:
        return [sse.event(OPENAI.body(error))]


class CompletionStream(ChoiceStream):
    """/v1/completions: text chunks; the echoed prompt first; logprobs with text offsets."""

    def __init__(self, reply: Reply, *, choices: int, echoes: list[str], logprobs: int | None) -> None:
        super().__init__(reply)
        self.choices = choices
        self.echoes = echoes
        self.logprobs = logprobs
        self.offsets = [len(echoes[i // reply.n]) for i in range(choices)]

    def _choice(self, index: int, text: str, logprobs: Any = None, finish: str | None = None) -> str:
        return self.reply.chunk([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}])

    def opening(self) -> list[str]:
        n = self.reply.n
        return [self._choice(i, self.echoes[i // n]) for i in range(self.choices) if self.echoes[i // n]]

    def token(self, choice: int, event: TokenEvent) -> list[str]:
        shown = None if self.logprobs is None else completion_logprobs([event], self.offsets[choice], self.logprobs)
        self.offsets[choice] += len(event.text)
        return [self._choice(choice, event.text, shown)]

    def finish(self, choice: int, result: FinalResult) -> list[str]:
        return [self._choice(choice, "", None, finish_reason(result))]


class ChatStream(ChoiceStream):
    """/v1/chat/completions: delta chunks, the role with the first token; with tools, text that may be a tool call
    is held back until it is plainly text or a call's name is written, whose arguments then stream
    as the model writes them."""

    def __init__(self, reply: Reply, request_ids: list[str], *, logprobs: bool, tools: bool = False) -> None:
        super().__init__(reply)
        self.choices = len(request_ids)
        self.logprobs = logprobs
        self.splitters = [ToolCallStream(request_id, pieces=True) for request_id in request_ids] if tools else None
        self.opened = [False] * self.choices

    def _choice(self, index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> str:
        # As TGI: every delta names its role and carries tool_calls (null without calls); TGI's own
        # client requires both, OpenAI's accepts them.
        delta = {"role": "assistant", **delta, "tool_calls": delta.get("tool_calls")}
        return self.reply.chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])

    def _opened(self, choice: int, frames: list[str]) -> list[str]:
        """OpenAI's first chunk of each choice names the role; as vLLM, it goes out with the choice's
        first token, in the same write, so a client timing its first chunk times the first token
        (while queued, only keep-alive comments go out)."""
        if self.opened[choice]:
            return frames
        self.opened[choice] = True
        return ["".join([self._choice(choice, {"role": "assistant", "content": ""}), *frames])]

    def token(self, choice: int, event: TokenEvent) -> list[str]:
        if self.splitters is None:
            shown = chat_logprobs([event]) if self.logprobs else None
            return self._opened(choice, [self._choice(choice, {"content": event.text}, shown)])
        return self._opened(choice, [self._choice(choice, delta) for delta in self.splitters[choice].feed(event.text)])

    def finish(self, choice: int, result: FinalResult) -> list[str]:
        if self.splitters is None:
            return self._opened(choice, [self._choice(choice, {}, None, finish_reason(result))])
        splitter = self.splitters[choice]
        tail = [self._choice(choice, delta) for delta in splitter.finish()]
        called = splitter.made_calls and result.finish_reason != "length"
        last = self._choice(choice, {}, None, "tool_calls" if called else finish_reason(result))
        return self._opened(choice, [*tail, last])
