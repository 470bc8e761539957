"""/v1/responses with ``text.format`` (structured output) and function ``tools``, through the official
openai SDK against a real stack (API + Redis + a worker with the tiny random model). A random model
under the grammar still produces valid JSON and well-formed calls; that is what is asserted."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest

from tests.api import test_structured_output as chat
from tests.api.conftest import ApiServer
from tests.api.test_responses import drop_and_resume, sdk, wait_status
from tests.structured_cases import validate

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
    },
    "required": ["name", "kind", "age"],
    "additionalProperties": False,
}
# The chat tests' functions, in the Responses API's flat shape.
WEATHER = {"type": "function", **chat.WEATHER["function"], "strict": True}  # type: ignore[dict-item]
TIME = {"type": "function", **chat.TIME["function"]}  # type: ignore[dict-item]
# tool_choice "required" over both functions: one or more calls.
CALL_BOTH: dict[str, Any] = {"tools": [WEATHER, TIME], "tool_choice": "required", "max_output_tokens": 300}
PARAMETERS = {"get_weather": WEATHER["parameters"], "get_time": TIME["parameters"]}
CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
]


def check_calls(output: list[Any], names: set[str]) -> None:
    """Every item a whole function call to one of ``names``, its arguments valid for that function."""
    assert output and all(item.type == "function_call" for item in output)
    assert len({item.id for item in output}) == len({item.call_id for item in output}) == len(output)
    for item in output:
        assert item.status == "completed" and item.call_id.startswith("call_") and item.name in names
        validate(item.arguments, PARAMETERS[item.name])  # type: ignore[arg-type]


def check_call_events(events: list[Any]) -> None:
    """Numbered from 0 without gap; four events per call, each call's item the one the response has."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    middle = types[2:-1]
    assert middle and len(middle) % 4 == 0 and all(middle[i : i + 4] == CALL_EVENTS for i in range(0, len(middle), 4))
    final = events[-1].response
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.model_dump() for e in done] == [item.model_dump() for item in final.output]
    for i, e in enumerate(done):
        delta, args_done = events[events.index(e) - 2], events[events.index(e) - 1]
        assert e.output_index == i and delta.item_id == args_done.item_id == e.item.id
        assert delta.delta == args_done.arguments == e.item.arguments


# text.format -----------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_format_gives_valid_json(live_api: ApiServer, temperature: float) -> None:
    client = sdk(live_api)
    fmt = {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}
    r = client.responses.create(
        input="Describe a pet.", text={"format": fmt}, max_output_tokens=200, temperature=temperature
    )
    assert r.status == "completed", r.incomplete_details
    validate(r.output_text, PET)
    assert r.text.format.type == "json_schema" and r.text.format.name == "pet" and r.text.format.strict is True
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()

    events = list(client.responses.create(input="Another.", text={"format": fmt}, max_output_tokens=200, stream=True))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    validate(final.output_text, PET)


def test_sdk_parse_with_a_pydantic_model(live_api: ApiServer) -> None:
    parsed = sdk(live_api).responses.parse(input="Describe a pet.", text_format=chat.Pet, max_output_tokens=200)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, chat.Pet)
    assert parsed.output_parsed == chat.Pet.model_validate_json(parsed.output_text)


def test_json_object_format(live_api: ApiServer) -> None:
    r = sdk(live_api).responses.create(
        input="Some JSON.", text={"format": {"type": "json_object"}}, max_output_tokens=300, temperature=0
    )
    assert r.text.format.type == "json_object"
    if r.status == "completed":  # a random model may nest objects until the limit
        assert isinstance(json.loads(r.output_text), dict)


# Function tools --------------------------------------------------------------------------------


def test_required_and_named_tool_choice_return_function_calls(live_api: ApiServer) -> None:
    client = sdk(live_api)
    r = client.responses.create(input="Weather in Paris, and the time?", **CALL_BOTH, extra_body={"seed": 5})
    assert r.status == "completed"
    check_calls(r.output, {"get_weather", "get_time"})
    assert r.tool_choice == "required" and [t.name for t in r.tools] == ["get_weather", "get_time"]

    named = client.responses.create(
        input="Weather in Paris?",
        tools=[TIME, WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=200,
        extra_body={"seed": 5},
    )
    check_calls(named.output, {"get_weather"})
    assert len(named.output) == 1 and named.parallel_tool_calls is False
    assert named.tool_choice.type == "function" and named.tool_choice.name == "get_weather"


def test_auto_tool_choice_gives_text_or_well_formed_calls(live_api: ApiServer) -> None:
    client = sdk(live_api)
    for seed in range(4):
        r = client.responses.create(
            input="Weather in Paris?", tools=[WEATHER], max_output_tokens=60, extra_body={"seed": seed}
        )
        if r.output and r.output[0].type == "function_call":
            assert r.status == "completed"
            check_calls(r.output, {"get_weather"})
        else:
            assert [item.type for item in r.output] == ["message"]
            assert not r.output_text.lstrip().startswith("<tool_call>")


def test_auto_tool_choice_with_a_json_schema_answers_in_calls_or_that_json(live_api: ApiServer) -> None:
    client = sdk(live_api)
    fmt = {"type": "json_schema", "name": "pet", "schema": PET}
    for seed in range(4):
        r = client.responses.create(
            input="A pet, or the weather?",
            tools=[WEATHER],
            text={"format": fmt},
            max_output_tokens=200,
            extra_body={"seed": seed},
        )
        assert r.status == "completed", r.incomplete_details
        if r.output[0].type == "function_call":
            check_calls(r.output, {"get_weather"})
        else:
            assert [item.type for item in r.output] == ["message"]
            validate(r.output_text, PET)


def test_streamed_function_call_events(live_api: ApiServer) -> None:
    client = sdk(live_api)
    # Seeded: unseeded, the random model's sampled calls now and then ran past max_output_tokens,
    # and the SDK's helper then gets response.incomplete, not response.completed (a CI run failed so).
    kwargs: dict[str, Any] = {"input": "Weather in Paris?", **CALL_BOTH, "extra_body": {"seed": 5}}
    events = list(client.responses.create(**kwargs, stream=True))
    check_call_events(events)
    check_calls(events[-1].response.output, {"get_weather", "get_time"})
    # The SDK's stream helper accumulates the same items.
    with client.responses.stream(model="tgi", **kwargs) as stream:
        helper_final = stream.get_final_response()
    check_calls(helper_final.output, {"get_weather", "get_time"})


def test_background_function_calls_resume_without_gap(live_api: ApiServer) -> None:
    client = sdk(live_api)
    created = client.responses.create(input="Weather?", **CALL_BOTH, background=True, extra_body={"seed": 5})
    assert created.status == "queued" and created.output == []
    seen = drop_and_resume(client, created.id, 3)  # the third: the first call's output_item.added
    check_call_events(seen)
    final = client.responses.retrieve(created.id)
    assert final.model_dump() == seen[-1].response.model_dump()
    check_calls(final.output, {"get_weather", "get_time"})
    # After the end, from any point: the same events.
    replay = list(client.responses.retrieve(created.id, stream=True, starting_after=3))
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in seen[4:]]


def test_function_call_outputs_continue_the_conversation(live_api: ApiServer) -> None:
    client = sdk(live_api)
    first = client.responses.create(
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
    )
    check_calls(first.output, {"get_weather"})
    assert len(first.output) == 1
    call = first.output[0]
    results = [{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}]
    # With the whole history as input items ...
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        *results,
    ]
    by_items = client.responses.create(
        input=history, tools=[WEATHER], tool_choice="none", max_output_tokens=8, temperature=0
    )
    assert [item.type for item in by_items.output] == ["message"]
    listed = client.responses.input_items.list(by_items.id, order="asc").data
    assert [item.type for item in listed] == ["message", "function_call", "function_call_output"]
    assert listed[1].call_id == call.call_id and listed[1].arguments == call.arguments
    assert listed[2].output == '{"temperature": 21}'
    # ... or chained: the earlier response's function call is in the context, the same prompt.
    chained = client.responses.create(
        input=results,
        previous_response_id=first.id,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    assert chained.usage.input_tokens == by_items.usage.input_tokens
    assert chained.output_text == by_items.output_text


def test_a_running_background_response_shows_its_text_so_far(live_api: ApiServer) -> None:
    client = sdk(live_api)
    created = client.responses.create(
        input="Go on.", max_output_tokens=2000, background=True, extra_body={"ignore_eos": True}
    )
    assert wait_status(client, created.id, {"in_progress", "completed", "incomplete"}) == "in_progress"
    give_up = time.monotonic() + 60
    partial = client.responses.retrieve(created.id)
    while partial.status == "in_progress" and not partial.output_text and time.monotonic() < give_up:
        partial = client.responses.retrieve(created.id)
    assert partial.status == "in_progress" and partial.output_text and partial.usage is None
    assert partial.output[0].type == "message" and partial.output[0].status == "in_progress"
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.output_text.startswith(partial.output_text)


def test_bad_formats_and_tools_are_400s_naming_the_parameter(live_api: ApiServer) -> None:
    client = sdk(live_api)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"text": {"format": {"type": "json_schema", "schema": PET}}}, "text.format.name"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wat"}}}}, "text.format"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "wat"}}]}, "tools"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 1}]}, "input[0].output"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**{"input": "x", "max_output_tokens": 4, **body})
        assert info.value.status_code == 400
        assert (info.value.body or {}).get("param", "").startswith(param), (body, info.value.body)
