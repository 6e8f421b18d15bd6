"""The three chat protocols (OpenAI Chat Completions, Anthropic Messages, OpenAI Responses) map
the same conversation to the same prompt: greedy decoding of the default model gives the same
text, and the same prompt and completion token counts, through each of them."""

import json

import anthropic
import openai
import pytest
from serve_utils import scripted_reply

MAX_TOKENS = 12


@pytest.mark.parametrize("system", [None, "You answer in one short sentence."])
def test_same_text_from_every_chat_protocol(real_server, system):
    server = real_server
    question = "What is the capital of France?"
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)

    chat = oai.chat.completions.create(
        model="m", temperature=0, max_tokens=MAX_TOKENS,
        messages=([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}])
    message = claude.messages.create(model="m", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": question}],
                                     **({"system": system} if system else {}))
    response = oai.responses.create(model="m", temperature=0, max_output_tokens=MAX_TOKENS, input=question,
                                    instructions=system, store=False)

    text = chat.choices[0].message.content
    assert text and message.content[0].text == text and response.output_text == text
    prompt_tokens = chat.usage.prompt_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt_tokens
    assert response.usage.input_tokens == prompt_tokens
    assert chat.usage.completion_tokens == message.usage.output_tokens == response.usage.output_tokens
    finish = chat.choices[0].finish_reason
    assert (message.stop_reason, response.status) == (
        ("max_tokens", "incomplete") if finish == "length" else ("end_turn", "completed"))


def test_same_prompt_for_a_tool_conversation_in_every_shape(agent_replay_server):
    """A tool call and its result, written in each protocol's own shape, render the same prompt
    (the replay model, Qwen3's template: tools section, <tool_call> and <tool_response>)."""
    server = agent_replay_server
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    question, said, result = "What is the weather in Paris?", "I will look it up.", "22 °C, sunny"
    arguments = {"city": "Paris", "days": [1, 2]}
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}

    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}
    chat = oai.chat.completions.create(
        model="m", max_tokens=50, reasoning_effort="none",
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": schema}}],
        messages=[{"role": "user", "content": question},
                  {"role": "assistant", "content": said, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": result}])
    message = claude.messages.create(
        model="m", max_tokens=50, tools=[{"name": "get_weather", "input_schema": schema}],
        messages=[{"role": "user", "content": question},
                  {"role": "assistant", "content": [{"type": "text", "text": said}, {
                      "type": "tool_use", "id": "call_1", "name": "get_weather", "input": arguments}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": result}]}])
    response = oai.responses.create(
        model="m", max_output_tokens=50, reasoning={"effort": "none"}, store=False,
        tools=[{"type": "function", "name": "get_weather", "parameters": schema}],
        input=[{"role": "user", "content": question},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": said}]},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": json.dumps(arguments)},
               {"type": "function_call_output", "call_id": "call_1", "output": result}])

    assert chat.choices[0].message.content == scripted_reply("<tool_response>")
    assert message.content[0].text == response.output_text == chat.choices[0].message.content
    prompt_tokens = chat.usage.prompt_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt_tokens
    assert response.usage.input_tokens == prompt_tokens
