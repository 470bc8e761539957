"""Strict object schemas: a schema's object that lists its properties and says nothing about
``additionalProperties`` admits no other key, in tools, ``response_format`` and TGI's grammar, as
vLLM's default backend and OpenAI's ``strict: true`` do; an explicit ``additionalProperties`` is
honoured. Checked on the grammar the worker compiles, with the tokens a model would write."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel

from producer_api.openai.structured import response_format_constraint, tool_plan
from producer_api.strict_schema import strict_schema
from producer_api.tgi.models import Grammar
from producer_api.tgi.routes import grammar_constraint
from shared.schemas import Constraint
from worker.engine.sampling.structured import Constraint as EngineConstraint
from worker.engine.sampling.structured import StructuredOutput


class City(BaseModel):
    name: str
    country: str


CITY = City.model_json_schema()
PARIS = '{"name":"Paris","country":"France"}'
PARIS_AND_MORE = '{"name":"Paris","country":"France","description":"A city"}'


def as_response_format(schema: dict[str, Any]) -> Constraint | None:
    return response_format_constraint({"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})


def as_tgi_grammar(schema: dict[str, Any]) -> Constraint | None:
    return grammar_constraint(Grammar(type="json", value=schema))


def as_named_tool(schema: dict[str, Any]) -> Constraint | None:
    tools = [{"type": "function", "function": {"name": "City", "parameters": schema}}]
    plan = tool_plan(tools, {"type": "function", "function": {"name": "City"}}, None)
    return plan.constraint if plan else None


def as_call(arguments: str) -> str:
    return f'<tool_call>\n{{"name":"City","arguments":{arguments}}}\n</tool_call>'


ROUTES: dict[str, tuple[Callable[[dict[str, Any]], Constraint | None], Callable[[str], str]]] = {
    "response_format": (as_response_format, str),
    "tgi_grammar": (as_tgi_grammar, str),
    "tool": (as_named_tool, as_call),
}


@pytest.fixture(scope="module")
def structured(tiny_tokenizer: Any) -> StructuredOutput:
    return StructuredOutput(tiny_tokenizer, len(tiny_tokenizer), [tiny_tokenizer.eos_token_id])


def accepts(structured: StructuredOutput, constraint: Constraint | None, text: str) -> bool:
    """Whether the worker's matcher for ``constraint`` takes ``text`` whole."""
    assert constraint is not None
    matcher = structured.matcher(EngineConstraint(constraint.type, constraint.value))
    ids = structured.tokenizer.encode(text, add_special_tokens=False)
    return bool(matcher.consume_tokens(ids)) and bool(matcher.is_accepting())


@pytest.mark.parametrize("route", ROUTES)
def test_a_schema_that_does_not_say_additional_properties_refuses_extra_keys(
    structured: StructuredOutput, route: str
) -> None:
    build, wrap = ROUTES[route]
    assert "additionalProperties" not in CITY  # pydantic's schema, as langchain and the SDKs send it
    constraint = build(CITY)
    assert accepts(structured, constraint, wrap(PARIS))
    assert not accepts(structured, constraint, wrap(PARIS_AND_MORE))


@pytest.mark.parametrize("route", ROUTES)
def test_an_explicit_additional_properties_is_honoured(structured: StructuredOutput, route: str) -> None:
    build, wrap = ROUTES[route]
    open_city = build({**CITY, "additionalProperties": True})
    assert accepts(structured, open_city, wrap(PARIS_AND_MORE))
    strings_only = build({**CITY, "additionalProperties": {"type": "string"}})
    assert accepts(structured, strings_only, wrap(PARIS_AND_MORE))
    assert not accepts(structured, strings_only, wrap('{"name":"Paris","country":"France","size":3}'))


def test_nested_objects_are_closed_wherever_they_are() -> None:
    leaf = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {"inner": leaf, "many": {"type": "array", "items": leaf}, "either": {"anyOf": [leaf, {}]}},
        "$defs": {"Leaf": leaf},
        "patternProperties": {"^p": leaf},
    }
    before = copy.deepcopy(schema)
    strict = strict_schema(schema)
    assert schema == before  # the caller's schema (echoed back by the Responses API) is left as given
    closed = {**leaf, "additionalProperties": False}
    assert strict["additionalProperties"] is False
    assert strict["properties"]["inner"] == closed
    assert strict["properties"]["many"]["items"] == closed
    assert strict["properties"]["either"]["anyOf"] == [closed, {}]
    assert strict["$defs"]["Leaf"] == closed
    assert strict["patternProperties"]["^p"] == closed


def test_open_objects_and_intersections_stay_open() -> None:
    free_form = {"type": "object"}
    assert strict_schema(free_form) == free_form  # lists no keys: any object, as json_object
    mapping = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert strict_schema(mapping) == mapping
    part = {"type": "object", "properties": {"a": {"type": "integer"}}}
    combined = strict_schema({"allOf": [part, {"properties": {"b": {}}}]})
    assert combined["allOf"][0] == part  # closing one part of an allOf would forbid the other's keys
