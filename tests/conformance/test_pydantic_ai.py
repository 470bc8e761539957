"""pydantic-ai's typed extraction against the stack, as its docs show for an OpenAI-compatible
server: an ``OpenAIChatModel`` on an ``OpenAIProvider(base_url=...)`` and an ``Agent`` whose
``output_type`` is a pydantic model. The tiny random model's values mean nothing, but the
grammar-constrained answer must validate into the model on the first request (a retry would
mean the server let through an answer that does not fit the schema)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput, ToolOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings


class CityLocation(BaseModel):
    city: str = Field(max_length=16)
    country: str = Field(max_length=16)
    population_millions: int = Field(ge=0, le=50)


@pytest.fixture(scope="module")
def chat_model(live_api, model: str) -> OpenAIChatModel:
    return OpenAIChatModel(model, provider=OpenAIProvider(base_url=f"{live_api.url}/v1", api_key="unused"))


@pytest.mark.parametrize(
    "output_type",
    [ToolOutput(CityLocation), NativeOutput(CityLocation)],
    ids=["tool-output", "native-output"],  # tool_choice=required / response_format json_schema
)
def test_agent_output_type_validates_first_time(chat_model: OpenAIChatModel, output_type: object) -> None:
    agent = Agent(chat_model, output_type=output_type, retries=0)
    # Room for the whole object: an answer cut off by max_tokens could never validate.
    result = agent.run_sync("Where were the olympics held in 2012?", model_settings=ModelSettings(max_tokens=200))
    assert isinstance(result.output, CityLocation)
    assert result.usage().requests == 1


def test_agent_stream_output(chat_model: OpenAIChatModel) -> None:
    agent = Agent(chat_model, output_type=NativeOutput(CityLocation), retries=0)

    async def run() -> CityLocation:
        async with agent.run_stream("Where were the olympics held in 2012?", model_settings={"max_tokens": 200}) as r:
            return await r.get_output()

    import asyncio

    assert isinstance(asyncio.run(run()), CityLocation)
