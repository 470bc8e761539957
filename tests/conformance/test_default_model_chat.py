"""The openai SDK's chat client against the default model (smollm2-135m-instruct through the API,
Redis and a worker), as OpenAI streams and answers: a tool call's arguments streamed piece by piece."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import OpenAI

from tests.api.conftest import ApiServer
from tests.api.test_default_model import stack  # noqa: F401  (the default model's stack fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(stack: tuple[ApiServer, str]) -> OpenAI:  # noqa: F811
    return OpenAI(base_url=f"{stack[0].url}/v1", api_key="unused", timeout=120)


def test_a_streamed_tool_call_arrives_piece_by_piece_and_reassembles_into_the_whole_call(
    client: OpenAI, default_model_name: str
) -> None:
    kwargs: dict[str, Any] = {
        "model": default_model_name,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": NAMED,
        "temperature": 0,
        "max_tokens": 60,
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    (expected,) = whole.message.tool_calls or []

    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    first, rest = pieces[0], pieces[1:]
    # OpenAI's shape: the first delta names the call with empty arguments, the others add arguments.
    assert (first.id or "").startswith("call_") and first.type == "function"
    assert first.function.name == expected.function.name and first.function.arguments == ""
    assert len(rest) > 1 and all(p.index == first.index == 0 and p.id is None for p in rest)
    arguments = "".join(p.function.arguments or "" for p in rest)
    assert arguments == expected.function.arguments and json.loads(arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
