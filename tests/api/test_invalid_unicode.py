"""Text no tokenizer can take (JSON's lone-surrogate escapes, such as "\\ud800") in any string field
of any generation route is a 4xx naming that field, in the route's own error shape; never a 5xx.

For each route, a valid body with every string field it takes filled in; hypothesis puts text with
lone surrogates into each of those fields in turn. No worker is needed: nothing gets queued."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.settings import Settings
from tests.api.conftest import ApiServer

MODEL = "tgi"  # the default model's placeholder name: the OpenAI routes take it
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Hello"}], "name": "ann"},
]
TOOL = {
    "type": "function",
    "function": {"name": "f", "description": "Does f.", "parameters": {"type": "object", "properties": {}}},
}
# (route, a valid body); every string in it is one field the fuzzing spoils.
BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/generate", {"inputs": "Hello", "parameters": {"stop": ["."], "max_new_tokens": 2}}),
    ("/generate_stream", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}),
    ("/", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}),
    ("/tokenize", {"inputs": "Hello"}),
    ("/v1/completions", {"model": MODEL, "prompt": ["Hello", "Bye"], "stop": ".", "max_tokens": 2, "user": "u"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "tools": [TOOL], "max_tokens": 2}),
    ("/v1/jobs", {"prompt": "Hello", "stop": ["."], "max_new_tokens": 2, "tenant": "t"}),
    ("/v1/jobs", {"messages": [{"role": "user", "content": "Hello"}], "max_new_tokens": 2}),
    ("/v1/responses", {"model": MODEL, "input": "Hello", "instructions": "Be brief.", "max_output_tokens": 2}),
    (
        "/v1/responses",
        {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]},
    ),
]


def string_fields(value: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """The path of every string in ``value``."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from string_fields(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from string_fields(item, (*path, i))


def replaced(value: Any, path: tuple[str | int, ...], new: str) -> Any:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = replaced(value[path[0]], path[1:], new)  # type: ignore[index]
    return copy


OPENAI_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/responses"}
CASES = [(route, body, path) for route, body in BODIES for path in string_fields(body)]
LONE_SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
# Text with at least one lone surrogate somewhere in it.
SPOILED = st.tuples(st.text(max_size=8), LONE_SURROGATES, st.text(max_size=8)).map("".join)


@pytest.fixture(scope="module")
def api(
    redis_url: str, module_prefix: str, tiny_model_dir: Path, start_api: Callable[[Settings], ApiServer]
) -> ApiServer:
    settings = Settings(redis_url=redis_url, key_prefix=module_prefix, model=str(tiny_model_dir), no_worker_wait_s=0.2)
    return start_api(settings)


@pytest.fixture(scope="module")
def http(api: ApiServer) -> Iterator[httpx.Client]:
    with api.client() as client:
        yield client


def test_every_route_takes_its_valid_body(http: httpx.Client) -> None:
    """The premise: without a worker, the valid bodies are answered (a job is queued) or get as far as
    waiting for a worker (503)."""
    for route, body in BODIES:
        response = http.post(route, json=body)
        assert response.status_code in (200, 202, 503), (route, response.text)


@pytest.mark.parametrize(("route", "body", "path"), CASES, ids=[f"{r} {'.'.join(map(str, p))}" for r, _, p in CASES])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=SPOILED)
def test_text_that_is_not_unicode_is_a_4xx_naming_its_field(
    http: httpx.Client, route: str, body: dict[str, Any], path: tuple[str | int, ...], text: str
) -> None:
    # json.dumps writes a lone surrogate as its \\ud8xx escape, as any JSON client may send it.
    content = json.dumps(replaced(body, path, text)).encode()
    response = http.post(route, content=content, headers={"content-type": "application/json"})
    assert response.status_code in (400, 422), (route, path, response.status_code, response.text)
    error = response.json()
    field = error["error"]["param"] if route in OPENAI_ROUTES else error["field"]
    assert field == ".".join(map(str, path)), error
