"""Wire shapes without a server: queue events -> TGI's SSE events (the relay with TGI's formatter),
and SSE framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from producer_api import sse
from producer_api.openai.formatting import ChatStream, Reply
from producer_api.relay import relay as relay_frames
from producer_api.tgi.formatting import TgiStream
from shared.errors import ExpiredError
from shared.schemas import AnyEvent, DoneEvent, ErrorEvent, FinalResult, Timings, TokenEvent, TopLogprob, Usage
from shared.settings import Settings

BUFFER = Settings(stream_buffer_events=16)


def token(index: int, token_id: int, text: str, **extra: object) -> TokenEvent:
    return TokenEvent(request_id="r", index=index, token_id=token_id, text=text, logprob=-0.5, **extra)  # type: ignore[arg-type]


def result(text: str, token_ids: list[int]) -> FinalResult:
    return FinalResult(
        request_id="r",
        model="m",
        text=text,
        token_ids=token_ids,
        finish_reason="length",
        usage=Usage(prompt_tokens=3, completion_tokens=len(token_ids), total_tokens=3 + len(token_ids)),
        timings=Timings(submitted_at=1.0, started_at=2.0, finished_at=3.0),
    )


def tgi_stream(source: AsyncIterator[AnyEvent], **kwargs: object) -> AsyncIterator[str]:
    options = {"seed": 7, "special_ids": frozenset({2})} | kwargs
    return relay_frames([source], TgiStream(**options), settings=BUFFER)  # type: ignore[arg-type]


def relay(events: list[AnyEvent] | AsyncIterator[AnyEvent], **kwargs: object) -> list[tuple[str | None, dict]]:
    async def source() -> AsyncIterator[AnyEvent]:
        if isinstance(events, list):
            for event in events:
                yield event
        else:
            async for event in events:
                yield event

    async def run() -> list[str]:
        return [frame async for frame in tgi_stream(source(), **kwargs)]

    parsed = []
    for frame in asyncio.run(run()):
        lines = frame.strip().split("\n")
        event_id = lines[0][4:] if lines[0].startswith("id: ") else None
        parsed.append((event_id, json.loads(lines[-1][6:])))
    return parsed


def test_the_last_token_event_carries_generated_text_and_details() -> None:
    frames = relay(
        [
            token(0, 10, "Hel"),
            token(1, 11, "lo", finish_reason="length"),
            DoneEvent(request_id="r", result=result("Hello", [10, 11])),
        ]
    )
    assert [f["index"] for _, f in frames] == [0, 1]
    first, last = frames[0][1], frames[1][1]
    assert first == {
        "index": 0,
        "token": {"id": 10, "text": "Hel", "logprob": -0.5, "special": False},
        "generated_text": None,
        "details": None,
        "top_tokens": None,
    }
    assert last["generated_text"] == "Hello"
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 2, "input_length": 3, "seed": 7}


def test_top_tokens_mark_special_ids_and_prefix_is_prepended() -> None:
    tops = [TopLogprob(token_id=2, text="</s>", logprob=-1.0), TopLogprob(token_id=5, text="a", logprob=-2.0)]
    frames = relay(
        [
            token(0, 5, "a", top_logprobs=tops, finish_reason="length"),
            DoneEvent(request_id="r", result=result("a", [5])),
        ],
        prefix="Q: ",
    )
    assert frames[0][1]["top_tokens"] == [
        {"id": 2, "text": "</s>", "logprob": -1.0, "special": True},
        {"id": 5, "text": "a", "logprob": -2.0, "special": False},
    ]
    assert frames[0][1]["generated_text"] == "Q: a"


def test_ids_are_token_indexes_for_resume() -> None:
    frames = relay(
        [
            token(3, 1, "x"),
            token(4, 2, "y", finish_reason="length"),
            DoneEvent(request_id="r", result=result("..xy", [0, 0, 0, 1, 2])),
        ],
        with_ids=True,
    )
    assert [event_id for event_id, _ in frames] == ["3", "4"]


def test_a_token_goes_out_before_the_next_one_exists() -> None:
    """Only the final token (marked by its finish_reason) waits for the result: the first frame must
    reach the client while the engine is still computing the second token, or TTFT grows by an ITL."""
    second_requested = asyncio.Event()

    async def run() -> list[str]:
        async def source() -> AsyncIterator[AnyEvent]:
            yield token(0, 10, "Hel")
            second_requested.set()
            yield token(1, 11, "lo", finish_reason="length")
            yield DoneEvent(request_id="r", result=result("Hello", [10, 11]))

        stream = tgi_stream(source(), seed=None, special_ids=frozenset())
        first = await anext(stream)
        assert not second_requested.is_set()
        return [first] + [frame async for frame in stream]

    frames = [json.loads(f.strip()[6:]) for f in asyncio.run(run())]
    assert [(f["index"], f["details"] is not None) for f in frames] == [(0, False), (1, True)]


def test_resuming_after_the_last_token_restates_it_with_the_result() -> None:
    frames = relay([DoneEvent(request_id="r", result=result("ab", [7, 8]))], with_ids=True)
    assert frames == [("1", frames[0][1])]
    assert frames[0][1]["token"]["id"] == 8 and frames[0][1]["generated_text"] == "ab"


def test_an_error_event_ends_the_stream_in_tgi_error_shape() -> None:
    frames = relay([token(0, 1, "x"), ErrorEvent(request_id="r", error_type="generation", message="engine broke")])
    assert frames[-1][1] == {"error": "engine broke", "error_type": "generation"}
    assert frames[0][1]["index"] == 0  # the token before the error still goes out


def test_a_failure_while_following_becomes_an_error_event() -> None:
    async def failing() -> AsyncIterator[AnyEvent]:
        yield token(0, 1, "x")
        raise ExpiredError("deadline passed")

    frames = relay(failing())
    assert frames[-1][1] == {"error": "deadline passed", "error_type": "expired"}


def test_sse_framing() -> None:
    assert sse.event({"a": 1}) == 'data: {"a":1}\n\n'
    assert sse.event("raw", event_id=4) == "id: 4\ndata: raw\n\n"
    assert sse.parse_last_event_id(" 12 ") == 12
    assert sse.parse_last_event_id("abc") is None
    assert sse.parse_last_event_id(None) is None


# The same relay with OpenAI's chat formatter: n choices, usage, [DONE], a failed choice ----------


def chat_frames(streams: list[list[AnyEvent]]) -> list[str]:
    """The SSE events the relay writes for ``streams``, the events of each choice."""
    reply = Reply("chatcmpl-r", "chat.completion.chunk", 1, "m", [[1, 2, 3]], n=len(streams), include_usage=True)
    closed: list[int] = []

    async def source(i: int, events: list[AnyEvent]) -> AsyncIterator[AnyEvent]:
        try:
            for event in events:
                yield event
                await asyncio.sleep(0)
            if not events or isinstance(events[-1], TokenEvent):
                await asyncio.Event().wait()  # a choice that has not finished yet
        finally:
            closed.append(i)

    async def run() -> list[str]:
        formatter = ChatStream(reply, [f"r{i}" for i in range(len(streams))], logprobs=False)
        sources = [source(i, events) for i, events in enumerate(streams)]
        return [frame async for frame in relay_frames(sources, formatter, settings=BUFFER)]  # type: ignore[arg-type]

    writes = asyncio.run(run())
    assert sorted(closed) == list(range(len(streams)))  # every choice's stream is closed at the end
    return [event + "\n\n" for write in writes for event in write.split("\n\n") if event]  # one write may hold several


def test_an_openai_stream_ends_with_usage_and_done_once_every_choice_finished() -> None:
    frames = chat_frames(
        [
            [token(0, 10, "a", finish_reason="length"), DoneEvent(request_id="r", result=result("a", [10]))],
            [token(0, 11, "b", finish_reason="length"), DoneEvent(request_id="r", result=result("b", [11]))],
        ]
    )
    assert frames[-1] == sse.DONE
    usage = json.loads(frames[-2][6:])
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    finishes = [
        json.loads(f[6:])["choices"][0] for f in frames[:-2] if json.loads(f[6:])["choices"][0]["finish_reason"]
    ]
    assert sorted(c["index"] for c in finishes) == [0, 1]


def test_a_failed_choice_ends_an_openai_stream_with_an_error_and_no_done() -> None:
    failure = ErrorEvent(request_id="r", error_type="generation", message="engine broke")
    frames = chat_frames([[token(0, 10, "a")], [token(0, 11, "b"), failure]])
    assert json.loads(frames[-1][6:]) == {
        "error": {"message": "engine broke", "type": "server_error", "param": None, "code": "generation"}
    }
    assert sse.DONE not in frames
