"""langchain-openai's tool binding against the default model (smollm2-135m-instruct through the
API, Redis and a worker), as its docs show: a pydantic model whose schema does not say
``additionalProperties`` is called, whole, within a small token budget (the schema is strict)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from tests.api.conftest import ApiServer
from tests.api.test_default_model import stack  # noqa: F401  (the default model's stack fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


class City(BaseModel):
    """A city and the country it is in."""

    name: str
    country: str


def test_langchain_binds_a_pydantic_tool_and_the_default_model_calls_it(
    stack: tuple[ApiServer, str],  # noqa: F811
    default_model_name: str,
) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    api, _ = stack
    llm = langchain_openai.ChatOpenAI(
        model=default_model_name, base_url=f"{api.url}/v1", api_key="unused", max_tokens=64, temperature=0
    )
    message = llm.bind_tools([City], tool_choice="City").invoke("Tell me about Paris")
    assert message.response_metadata["finish_reason"] == "tool_calls", message
    (call,) = message.tool_calls
    assert call["name"] == "City" and set(call["args"]) == {"name", "country"}
    City.model_validate(call["args"])
