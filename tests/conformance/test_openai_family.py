"""The openai SDK, litellm and langchain-openai against the stack, each as its docs show."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import openai
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


def test_stop(client: OpenAI, model: str) -> None:
    greedy = {"model": model, "max_tokens": 12, "temperature": 0}
    free = client.chat.completions.create(messages=MESSAGES, **greedy).choices[0].message.content or ""
    assert len(free) >= 8, free  # premise: the greedy answer is long enough to stop inside it
    stop = free[4:7]
    stopped = client.chat.completions.create(messages=MESSAGES, stop=[stop], **greedy).choices[0]
    # The answer ends where the stop sequence first appears, which it does not include.
    assert stopped.finish_reason == "stop" and stopped.message.content == free[: free.index(stop)]

    text = client.completions.create(prompt="Once upon", **greedy).choices[0].text
    assert len(text) >= 8, text
    cut = client.completions.create(prompt="Once upon", stop=text[4:7], **greedy).choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(text[4:7])]


def test_chat_stream_usage(client: OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices  # OpenAI's usage chunk has no choices
    assert 1 <= usage.completion_tokens <= 5 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason in ("length", "stop")


def test_models_list_and_retrieve(client: OpenAI, model: str) -> None:
    assert model in [m.id for m in client.models.list().data]
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model" and card.created > 0
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    error = missing.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found" and error["param"] == "model"
    assert error["type"] == "invalid_request_error" and "no-such-model" in error["message"]


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


class GetWeather(BaseModel):
    """Weather in a city."""

    city: Literal["Paris", "London"]


def test_tools_streamed_and_parsed(client: OpenAI, model: str) -> None:
    """The SDK's stream helper assembles the streamed call and parses it into the pydantic tool."""
    named = {"type": "function", "function": {"name": "GetWeather"}}
    with client.chat.completions.stream(
        model=model,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice=named,
        max_tokens=60,
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    calls = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert isinstance(calls[0].function.parsed_arguments, GetWeather)


@pytest.mark.parametrize(
    ("call", "param"),
    [
        ("chat", "logit_bias"),
        ("completions", "logit_bias"),
        ("completions", "suffix"),
        ("completions", "best_of"),
    ],
)
def test_unsupported_parameters_are_400s_naming_them(client: OpenAI, model: str, call: str, param: str) -> None:
    value = {"logit_bias": {"1": 5.0}, "suffix": " the end", "best_of": 3}[param]
    with pytest.raises(openai.BadRequestError) as refused:
        if call == "chat":
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, **{param: value})
        else:
            client.completions.create(model=model, prompt="Hi", max_tokens=2, **{param: value})
    assert refused.value.param == param and param in refused.value.message


@pytest.mark.parametrize(
    ("call", "kwargs", "param"),
    [
        ("chat", {"temperature": 5}, "temperature"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
        ("completions", {"n": 0}, "n"),
        ("completions", {"top_p": 2}, "top_p"),
        ("responses", {"temperature": 5}, "temperature"),
    ],
)
def test_invalid_values_are_400s_the_sdk_raises_as_bad_request(
    client: OpenAI, model: str, call: str, kwargs: dict[str, object], param: str
) -> None:
    """As OpenAI and vLLM answer: a 400 invalid_request_error naming the parameter, never a 422."""
    with pytest.raises(openai.BadRequestError) as refused:
        if call == "chat":
            client.chat.completions.create(**{"model": model, "messages": MESSAGES, "max_tokens": 2, **kwargs})
        elif call == "completions":
            client.completions.create(**{"model": model, "prompt": "Hi", "max_tokens": 2, **kwargs})
        else:
            client.responses.create(**{"model": model, "input": "Hi", "max_output_tokens": 2, **kwargs})
    assert refused.value.status_code == 400 and refused.value.param == param
    assert refused.value.type == "invalid_request_error"


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
    assert isinstance(asyncio.run(llm.ainvoke("Hello")).content, str)
    assert [type(m.content) for m in llm.batch(["Hello", "Hi"])] == [str, str]
    assert list(llm.stream("Hello"))
    completions = langchain_openai.OpenAI(model=model, base_url=f"{live_api.url}/v1", api_key="unused", max_tokens=5)
    assert isinstance(completions.invoke("Once upon"), str)
    pet = llm.with_structured_output(Pet, method="json_schema").invoke("Describe a pet.")
    assert isinstance(pet, Pet)
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    message = llm.bind_tools(TOOLS, tool_choice=tool_choice).invoke("Weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
