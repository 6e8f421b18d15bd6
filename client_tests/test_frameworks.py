"""Structured output through the agent frameworks' own default paths, against a live server on
the default model (SmolLM2-135M: it cannot be trusted to write a schema's JSON on its own, so a
valid object each time is the server's grammar at work). Every string and list is bounded, so
no reply is cut by max_tokens: a cut reply would be the test's design failing, not the server.

Each framework is used as its documentation shows, pointed at tallow by base URL only; the
object it returns is its own parse and validation of the reply. What each path sends:
- instructor Mode.TOOLS: a named tool_choice (one call, arguments per the schema);
  Mode.JSON_SCHEMA: response_format json_schema.
- pydantic-ai: output_type=Model is a forced tool call (tool_choice "required" with an output
  tool); NativeOutput is response_format json_schema; OpenAIResponsesModel uses the Responses API.
- OpenAI Agents SDK: output_type on the Chat Completions model (response_format json_schema,
  strict) and on the Responses model (text.format).
- LangChain: with_structured_output's default (json_schema), function_calling (a named
  tool_choice), and the Responses API.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

QUESTION = "Name a European capital and its population in millions."


class City(BaseModel):  # no additionalProperties in its schema, as pydantic writes it
    name: Literal["Paris", "London", "Rome"]
    population_millions: int = Field(ge=0, le=40)
    landmarks: list[Annotated[str, Field(max_length=30)]] = Field(max_length=2)


class Person(BaseModel):
    first_name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


class Team(BaseModel):  # nested models ($defs), an optional field
    lead: Person
    members: list[Person] = Field(min_length=1, max_length=2)
    motto: str | None = Field(default=None, max_length=20)


def check(value, model):
    assert isinstance(value, model), value
    model.model_validate(value.model_dump())  # the framework's object holds the schema's constraints
    return value


# ---- instructor ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
@pytest.mark.parametrize("model", [City, Team])
def test_instructor(base_url, mode, model):
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=base_url, api_key="unused"), mode=getattr(instructor.Mode, mode))
    for seed in range(3):
        out = client.chat.completions.create(model="default", response_model=model, max_retries=0, max_tokens=200,
                                             seed=seed, messages=[{"role": "user", "content": QUESTION}])
        check(out, model)


def test_instructor_streams_partial_objects(base_url):
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=base_url, api_key="unused"), mode=instructor.Mode.TOOLS)
    partials = list(client.chat.completions.create_partial(
        model="default", response_model=City, max_retries=0, max_tokens=200,
        messages=[{"role": "user", "content": QUESTION}]))
    assert len(partials) > 1  # arguments streamed as they were generated, not in one piece
    check(City.model_validate(partials[-1].model_dump()), City)


# ---- pydantic-ai -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["tool", "native", "responses"])
@pytest.mark.parametrize("model", [City, Team])
def test_pydantic_ai(base_url, path, model):
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=base_url, api_key="unused")
    llm = (OpenAIResponsesModel if path == "responses" else OpenAIChatModel)("default", provider=provider)
    agent = Agent(llm, output_type=NativeOutput(model) if path == "native" else model,
                  model_settings={"max_tokens": 200})
    check(agent.run_sync(QUESTION).output, model)


def test_pydantic_ai_streams_the_output(base_url):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    agent = Agent(OpenAIChatModel("default", provider=OpenAIProvider(base_url=base_url, api_key="unused")),
                  output_type=City, model_settings={"max_tokens": 200})

    async def run():
        async with agent.run_stream(QUESTION) as result:
            return await result.get_output()

    check(asyncio.run(run()), City)


# ---- OpenAI Agents SDK -----------------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("model", [City, Team])
def test_openai_agents(base_url, api, model):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace upload to OpenAI
    client = AsyncOpenAI(base_url=base_url, api_key="unused")
    llm = (OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel)("default", client)
    agent = Agent(name="extractor", instructions="Answer with the requested object.", model=llm,
                  output_type=model, model_settings=ModelSettings(max_tokens=200))
    check(Runner.run_sync(agent, QUESTION).final_output, model)


# ---- LangChain -------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "responses"])
@pytest.mark.parametrize("model", [City, Team])
def test_langchain(base_url, method, model):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key="unused", model="default", max_tokens=200,
                     use_responses_api=method == "responses")
    structured = llm.with_structured_output(model, method="json_schema" if method == "responses" else method)
    check(structured.invoke(QUESTION), model)
