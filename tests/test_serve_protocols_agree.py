"""The three chat protocols (OpenAI Chat Completions, Anthropic Messages, OpenAI Responses) map
the same conversation to the same prompt: greedy decoding of the default model gives the same
text, and the same prompt and completion token counts, through each of them."""

import anthropic
import openai
import pytest
from agent_servers import real_server

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server():
    return real_server()


@pytest.mark.parametrize("system", [None, "You answer in one short sentence."])
def test_same_text_from_every_chat_protocol(server, system):
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
