"""Structured output and tool calls through the whole stack (API + Redis + a real worker with the
tiny random model), with unmodified clients: the openai package's ``parse`` and tool-call types,
huggingface_hub's ``text_generation(grammar=...)``, jobs and the queue client. A random model
under a constraint still produces valid output; that is the point."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from pydantic import BaseModel, Field

from tests.api.conftest import ApiServer
from tests.structured_cases import SCHEMAS, validate

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Pet(BaseModel):
    name: str = Field(max_length=10)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


def model_of(oai: openai.OpenAI) -> str:
    return oai.models.list().data[0].id


def check_weather_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    validate(call.function.arguments, WEATHER["function"]["parameters"])  # type: ignore[index]


# response_format ---------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sdk_parse_returns_a_pydantic_object(oai: openai.OpenAI, temperature: float) -> None:
    completion = oai.chat.completions.parse(
        model=model_of(oai),
        messages=[{"role": "user", "content": "Describe a pet."}],
        response_format=Pet,
        max_completion_tokens=200,
        temperature=temperature,
        seed=1,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Pet)
    assert completion.choices[0].finish_reason == "stop"


def test_json_object_and_json_schema_on_completions(oai: openai.OpenAI) -> None:
    schema = SCHEMAS["refs_and_defs"]
    out = oai.completions.create(
        model=model_of(oai),
        prompt="Points:",
        max_tokens=200,
        temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}},
    )
    validate(out.choices[0].text, schema)
    chat = oai.chat.completions.create(
        model=model_of(oai),
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        max_completion_tokens=300,
        temperature=0,
    )
    if chat.choices[0].finish_reason == "stop":  # any object may be long; a cut one is reported as such
        assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)


def test_streamed_json_schema_concatenates_to_valid_json(oai: openai.OpenAI) -> None:
    schema = SCHEMAS["nested_objects"]
    stream = oai.chat.completions.create(
        model=model_of(oai),
        messages=[{"role": "user", "content": "An address"}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
        max_completion_tokens=200,
        temperature=0.7,
        seed=5,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    validate(text, schema)


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format", "nope"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}]}, "tools", "wat"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "get_weather"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
    ],
)  # fmt: skip
def test_an_invalid_constraint_is_a_400_naming_the_problem(
    api: ApiServer, body: dict[str, Any], field: str, words: str
) -> None:
    payload = {"model": "tgi", "messages": ASK, "max_tokens": 5, **body}
    response = httpx.post(f"{api.url}/v1/chat/completions", json=payload)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and words in error["message"]


# Tools -------------------------------------------------------------------------------------------


def assembled(deltas: list[Any]) -> list[Any]:
    """Streamed tool-call deltas joined by index: the first names the call, the rest add arguments."""
    calls: dict[int, Any] = {}
    for delta in deltas:
        if delta.index not in calls:
            calls[delta.index] = delta.model_copy(deep=True)
        else:
            calls[delta.index].function.arguments += delta.function.arguments or ""
    return list(calls.values())


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_returns_sdk_tool_calls(oai: openai.OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": model_of(oai),
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_completion_tokens": 200,
        "temperature": 0,
    }
    if not stream:
        choice = oai.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls or []
    else:
        chunks = list(oai.chat.completions.create(stream=True, **kwargs))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert not "".join(d.content or "" for d in deltas)
        calls = assembled([tc for d in deltas for tc in d.tool_calls or []])
    assert len(calls) == 1
    assert calls[0].function.name in ("get_weather", "get_time")
    tool = WEATHER if calls[0].function.name == "get_weather" else TIME
    validate(calls[0].function.arguments, tool["function"]["parameters"])  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_calls_that_function(oai: openai.OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": model_of(oai),
        "messages": ASK,
        "tools": [TIME, WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_completion_tokens": 200,
        "temperature": 0.8,
        "seed": 3,
    }
    if not stream:
        completion = oai.chat.completions.create(**kwargs)
        calls = completion.choices[0].message.tool_calls or []
    else:
        with oai.chat.completions.stream(**kwargs) as s:  # the SDK's own accumulation of tool-call deltas
            completion = s.get_final_completion()
        calls = completion.choices[0].message.tool_calls or []
    assert completion.choices[0].finish_reason == "tool_calls"
    assert len(calls) == 1
    check_weather_call(calls[0])


def auto_replies(oai: openai.OpenAI, seeds: int, max_tokens: int, **extra: Any) -> Iterator[Any]:
    """Sampled ``tool_choice: auto`` replies to ASK with the weather tool; a reply's calls are
    checked here, what it says without one is the caller's to check."""
    for seed in range(seeds):
        choice = oai.chat.completions.create(
            model=model_of(oai),
            messages=ASK,
            tools=[WEATHER],
            max_completion_tokens=max_tokens,
            temperature=1.0,
            seed=seed,
            **extra,
        ).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                check_weather_call(call)
        else:
            yield choice


def test_auto_tool_choice_gives_text_or_well_formed_calls(oai: openai.OpenAI) -> None:
    for choice in auto_replies(oai, 4, 40):
        assert "<tool_call>" not in (choice.message.content or "").lstrip()[:11]


def test_auto_tool_choice_beside_a_json_schema_gives_calls_or_that_json(oai: openai.OpenAI) -> None:
    # "Calls or that JSON": a reply without a call is the schema's JSON, never free text.
    # As OpenAI's strict mode asks (and the SDK's parse() writes): no properties beyond the schema's.
    pet = {**Pet.model_json_schema(), "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": pet, "strict": True}}
    for choice in auto_replies(oai, 6, 120, response_format=response_format):
        assert choice.finish_reason == "stop", choice
        Pet.model_validate_json(choice.message.content or "")


def test_a_conversation_with_tool_results_continues(oai: openai.OpenAI) -> None:
    first = oai.chat.completions.create(
        model=model_of(oai), messages=ASK, tools=[WEATHER], tool_choice="required", max_completion_tokens=200
    ).choices[0]
    call = (first.message.tool_calls or [])[0]
    history: list[Any] = [
        *ASK,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    follow = oai.chat.completions.create(
        model=model_of(oai), messages=history, tools=[WEATHER], tool_choice="none", max_completion_tokens=8
    ).choices[0]
    assert follow.message.tool_calls is None and isinstance(follow.message.content, str)


def test_the_template_sees_the_tools(api: ApiServer, tiny_tokenizer: Any) -> None:
    from producer_api.openai.structured import template_messages, tool_plan

    plan = tool_plan([WEATHER], "auto", None)
    messages = template_messages(ASK, plan, tiny_tokenizer.chat_template)
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert "<tools>" in text and "get_weather" in text and "<tool_call>" in text


# TGI, jobs ---------------------------------------------------------------------------------------


def test_inference_client_text_generation_with_grammar(api: ApiServer) -> None:
    client = InferenceClient(base_url=api.url)
    schema = SCHEMAS["enums"]
    text = client.text_generation("Colour?", max_new_tokens=50, grammar={"type": "json", "value": schema})
    validate(text, schema)
    pattern = r"[0-9]{3}-[A-Z]{2}"
    text = client.text_generation(
        "Code?", max_new_tokens=20, do_sample=True, seed=2, grammar={"type": "regex", "value": pattern}
    )
    assert re.fullmatch(pattern, text)
    streamed = "".join(
        client.text_generation("Code?", max_new_tokens=20, stream=True, grammar={"type": "regex", "value": pattern})
    )
    assert re.fullmatch(pattern, streamed)


def test_tgi_invalid_grammar_is_a_422(api: ApiServer) -> None:
    body = {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "(unclosed"}}}
    response = httpx.post(f"{api.url}/generate", json=body)
    assert response.status_code == 422
    assert "regex" in response.json()["error"]


def test_a_job_takes_the_same_constraint(api: ApiServer) -> None:
    schema = SCHEMAS["refs_and_defs"]
    with api.client() as http:
        created = http.post(
            "/v1/jobs",
            json={"prompt": "Numbers:", "max_new_tokens": 100, "constraint": {"type": "json_schema", "value": schema}},
        )
        assert created.status_code == 202, created.text
        job_id = created.json()["id"]
        with http.stream("GET", f"/v1/jobs/{job_id}/stream") as response:
            lines = [line[5:] for line in response.iter_lines() if line.startswith("data:")]
        validate(json.loads(lines[-1])["generated_text"], schema)
        bad = http.post("/v1/jobs", json={"prompt": "x", "constraint": {"type": "regex", "value": "[z-a]"}})
        assert bad.status_code == 422 and "constraint" in bad.text
