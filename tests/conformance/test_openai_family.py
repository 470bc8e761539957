"""The openai SDK, litellm and langchain-openai against the stack, each as its docs show."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.conformance.test_huggingface_hub import TOOLS


class Pet(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=30)


@pytest.fixture(scope="module")
def client(live_api) -> OpenAI:
    return OpenAI(base_url=f"{live_api.url}/v1", api_key="unused", timeout=120)


MESSAGES = [{"role": "user", "content": "Say something."}]


def test_chat_n_logprobs_seed(client: OpenAI, model: str) -> None:
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 3}
    a = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    b = client.chat.completions.create(**kwargs)
    assert len(a.choices) == 2 and [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert all(len(t.top_logprobs) == 2 for t in a.choices[0].logprobs.content)
    assert isinstance(a.system_fingerprint, str)


def test_chat_stop_and_stream_usage(client: OpenAI, model: str) -> None:
    free = client.completions.create(model=model, prompt="Once upon", max_tokens=10, temperature=0).choices[0].text
    words = [w for w in free.split() if w.isascii() and w.isalpha()]
    if len(words) > 1:  # a whole word the greedy text holds
        stopped = client.completions.create(
            model=model, prompt="Once upon", max_tokens=10, temperature=0, stop=[words[1]]
        )
        assert stopped.choices[0].finish_reason == "stop" and words[1] not in stopped.choices[0].text
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 5
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(text, str)


def test_completions(client: OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="Once upon", max_tokens=5, n=2, logprobs=2, seed=1)
    assert len(out.choices) == 2 and len(out.choices[0].logprobs.top_logprobs[0]) == 2
    chunks = list(
        client.completions.create(
            model=model, prompt="Once upon", max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.completion_tokens <= 4


def test_structured_output_parse(client: OpenAI, model: str) -> None:
    completion = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=Pet, max_tokens=60)
    assert isinstance(completion.choices[0].message.parsed, Pet)


def test_tools(client: OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60
    )
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "London")


def test_litellm(live_api, model: str) -> None:
    litellm = pytest.importorskip("litellm")
    kwargs = {"model": f"hosted_vllm/{model}", "api_base": f"{live_api.url}/v1", "api_key": "unused"}
    reply = litellm.completion(messages=MESSAGES, max_tokens=5, **kwargs)
    assert isinstance(reply.choices[0].message.content, str)
    chunks = list(litellm.completion(messages=MESSAGES, max_tokens=5, stream=True, **kwargs))
    assert chunks
    text = litellm.text_completion(prompt="Once upon", max_tokens=4, **kwargs)
    assert isinstance(text.choices[0].text, str)


def test_langchain_openai(live_api, model: str) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=model, base_url=f"{live_api.url}/v1", api_key="unused", max_tokens=60)
    assert isinstance(llm.invoke("Hello").content, str)
    assert list(llm.stream("Hello"))
    pet = llm.with_structured_output(Pet, method="json_schema").invoke("Describe a pet.")
    assert isinstance(pet, Pet)
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    message = llm.bind_tools(TOOLS, tool_choice=tool_choice).invoke("Weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
