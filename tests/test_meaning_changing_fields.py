"""Fields that change what a reply means were accepted and ignored (issue 24). Each is now
honoured or a 400 naming it, as vLLM / OpenAI do where they do: through the HTTP app (httpx
ASGITransport) over the fake engine."""

import asyncio
import json

import httpx
import pytest

from serve_utils import ByteTokenizer, FakeEngine
from tallow.config import ServerConfig
from tallow.serve.app import build_app

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
RESPONSES = "/v1/responses"
USER = [{"role": "user", "content": "hi"}]


def post(app, path: str, body: dict) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


@pytest.fixture
def engine():
    return FakeEngine(max_model_len=256)


@pytest.fixture
def app(engine):
    return build_app(engine, ServerConfig())


REFUSED = [
    (CHAT, {"messages": USER, "chat_template": "{{ messages[0].content }}"}, "chat_template"),
    (CHAT, {"messages": USER, "functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    (CHAT, {"messages": USER, "function_call": "auto"}, "function_call"),
    (CHAT, {"messages": USER, "function_call": {"name": "f"}}, "function_call"),
    (CHAT, {"messages": USER, "best_of": 3}, "best_of"),
    (CHAT, {"messages": USER, "n": 2, "best_of": 1}, "best_of"),
    (TEXT, {"prompt": "Once", "best_of": 2}, "best_of"),
    (CHAT, {"messages": USER + [{"role": "assistant", "content": "The answer"}], "continue_final_message": True},
     "continue_final_message"),  # add_generation_prompt is true by default: vLLM refuses both
    (CHAT, {"messages": USER + [{"role": "assistant", "content": ""}], "continue_final_message": True,
            "add_generation_prompt": False}, "continue_final_message"),
    (RESPONSES, {"input": "hi", "background": True}, "background"),
    (RESPONSES, {"input": "hi", "truncation": "auto"}, "truncation"),
    (RESPONSES, {"input": "hi", "truncation": "middle"}, "truncation"),
    (RESPONSES, {"input": "hi", "top_logprobs": 3}, "top_logprobs"),
    (RESPONSES, {"input": "hi", "max_tool_calls": 0}, "max_tool_calls"),
    (CHAT, {"messages": USER, "web_search_options": {}}, "web_search_options"),
    (CHAT, {"messages": USER, "modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"messages": USER, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CHAT, {"messages": USER, "verbosity": "loud"}, "verbosity"),
    (CHAT, {"messages": USER, "reasoning_effort": "extreme"}, "reasoning_effort"),
    (RESPONSES, {"input": "hi", "conversation": "conv_123"}, "conversation"),
    (RESPONSES, {"input": "hi", "conversation": {"id": "conv_123"}}, "conversation"),
    (RESPONSES, {"input": "hi", "prompt": {"id": "pmpt_1", "variables": {"city": "Oslo"}}}, "prompt"),
    (RESPONSES, {"input": "hi", "text": {"verbosity": "loud"}}, "text.verbosity"),
    (RESPONSES, {"input": "hi", "tools": [{"type": "function", "name": "f"}],
                 "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name"),
    # vLLM's extras that change the reply and are not implemented here
    (TEXT, {"prompt": "Once", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    (CHAT, {"messages": USER, "allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    (TEXT, {"prompt": "Once", "bad_words": ["upon"]}, "bad_words"),
    (TEXT, {"prompt": "Once", "use_beam_search": True}, "use_beam_search"),
    (CHAT, {"messages": USER, "return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    (CHAT, {"messages": USER, "echo": True}, "echo"),
]


@pytest.mark.parametrize("path,body,param", REFUSED)
def test_unimplemented_meaning_is_a_400_naming_the_field(app, path, body, param):
    response = post(app, path, {"max_tokens": 4, **body} if path != RESPONSES else body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


ACCEPTED = [
    (CHAT, {"messages": USER, "best_of": 1}),
    (CHAT, {"messages": USER, "n": 2, "best_of": 2}),
    (TEXT, {"prompt": "Once", "best_of": 1}),
    (RESPONSES, {"input": "hi", "background": False}),
    (RESPONSES, {"input": "hi", "truncation": "disabled"}),
    (RESPONSES, {"input": "hi", "top_logprobs": 0}),
    (CHAT, {"messages": USER, "modalities": ["text"], "verbosity": "low"}),
    (RESPONSES, {"input": "hi", "text": {"verbosity": "high"}}),
    # every effort value of OpenAI's spec (Codex and Claude Code send xhigh / max when chosen)
    *[(CHAT, {"messages": USER, "reasoning_effort": e}) for e in ("minimal", "medium", "xhigh", "max")],
    *[(RESPONSES, {"input": "hi", "reasoning": {"effort": e}}) for e in ("none", "xhigh", "max")],
    (TEXT, {"prompt": "Once", "use_beam_search": False, "bad_words": None, "truncate_prompt_tokens": None}),
    # null where OpenAI's and vLLM's APIs take it (clients that write every field send it): the default
    (CHAT, {"messages": USER, "n": None, "stream": None, "logprobs": None, "presence_penalty": None,
            "frequency_penalty": None, "stream_options": None, "echo": None}),
    (CHAT, {"messages": USER, "stream": True, "stream_options": {"include_usage": None}}),
    (TEXT, {"prompt": "Once", "n": None, "echo": None, "stream": None, "presence_penalty": None}),
    (RESPONSES, {"input": "hi", "stream": None, "store": None}),
]


@pytest.mark.parametrize("path,body", ACCEPTED)
def test_values_that_change_nothing_are_accepted(app, path, body):
    response = post(app, path, {"max_tokens": 4, **body} if path != RESPONSES else {"max_output_tokens": 4, **body})
    assert response.status_code == 200, response.text


def test_continue_final_message_continues_the_assistant_text(app, engine):
    messages = USER + [{"role": "assistant", "content": "The answer is"}]
    response = post(app, CHAT, {"messages": messages, "max_tokens": 4, "continue_final_message": True,
                                "add_generation_prompt": False})
    assert response.status_code == 200, response.text
    prompt = engine.tokenizer.decode(engine.submitted[-1][0], skip_special_tokens=False)
    # The template's end of turn after the last message is cut off, and no new turn is opened.
    assert prompt.endswith("<|im_start|>assistant\nThe answer is"), prompt

    post(app, CHAT, {"messages": messages, "max_tokens": 4, "add_generation_prompt": False})
    plain = engine.tokenizer.decode(engine.submitted[-1][0], skip_special_tokens=False)
    assert plain.endswith("The answer is<|im_end|>\n")


TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.mark.parametrize("max_tool_calls,expected", [(None, 2), (1, 1), (2, 2)])
def test_responses_max_tool_calls_is_honoured(max_tool_calls, expected):
    app = build_app(FakeEngine(max_model_len=1024, reply=TWO_CALLS), ServerConfig())
    body = {"input": "weather in Oslo and Rome?", "tools": [WEATHER], "max_output_tokens": 200}
    if max_tool_calls is not None:
        body["max_tool_calls"] = max_tool_calls
    response = post(app, RESPONSES, body)
    assert response.status_code == 200, response.text
    calls = [item for item in response.json()["output"] if item["type"] == "function_call"]
    assert [json.loads(c["arguments"])["city"] for c in calls] == ["Oslo", "Rome"][:expected]
    assert response.json()["max_tool_calls"] == max_tool_calls


def test_continue_final_message_through_a_real_template_matches_transformers():
    """The chat route's render path hands continue_final_message to ChatTemplate (transformers'
    semantics; a special token's string in the continued text stays a literal span)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from pathlib import Path

    from tallow.chat_template import ChatTemplate
    from tallow.serve.chat_prompt import render_chat

    source = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
    template = ChatTemplate(source, bos_token="<|im_start|>", eos_token="<|im_end|>",
                            special_tokens=["<|im_start|>", "<|im_end|>"])
    messages = [{"role": "user", "content": "Count to 3."}, {"role": "assistant", "content": "1, 2, <|im_end|>"}]
    prompt = render_chat(template, messages, ServerConfig(), add_generation_prompt=False,
                         continue_final_message=True)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(tokenizers.models.BPE()),
                                              bos_token="<|im_start|>", eos_token="<|im_end|>")
    expected = hf.apply_chat_template(messages, chat_template=source, tokenize=False, continue_final_message=True)
    assert prompt.text == expected and prompt.text.endswith("1, 2, <|im_end|>")
    assert prompt.literal_spans == ((len(expected) - len("<|im_end|>"), len(expected)),)


def test_a_developer_message_reaches_the_template_as_the_system_prompt():
    """OpenAI's developer role is its system role under a newer name; Qwen's templates know only
    system and drop other roles without a word (as /v1/responses already maps it)."""
    from pathlib import Path

    from tallow.chat_template import ChatTemplate
    from tallow.serve.chat_prompt import render_chat
    from tallow.serve.protocols.openai_schemas import ChatMessage

    source = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
    template = ChatTemplate(source, bos_token="<|im_start|>", eos_token="<|im_end|>",
                            special_tokens=["<|im_start|>", "<|im_end|>"])
    wire = [{"role": "developer", "content": [{"type": "text", "text": "Answer only in French."}]},
            {"role": "user", "content": "hi"}]
    messages = [ChatMessage.model_validate(m).to_template() for m in wire]
    as_system = render_chat(template, [{"role": "system", "content": "Answer only in French."},
                                       {"role": "user", "content": "hi"}], ServerConfig())
    assert render_chat(template, messages, ServerConfig()).text == as_system.text
    assert "<|im_start|>system\nAnswer only in French.<|im_end|>" in as_system.text


class BosTokenizer(ByteTokenizer):
    """The fake engine's bytes, with BOS (<|im_start|>, 256) in front of a text where asked."""

    add_bos = True

    def encode(self, text: str, add_special_tokens: bool = False, literal_spans=()) -> list[int]:
        return ([self.bos_token_id] if add_special_tokens else []) + super().encode(text, literal_spans=literal_spans)


def test_completions_text_prompts_bos_and_echo():
    engine = FakeEngine(max_model_len=256)
    engine.tokenizer = BosTokenizer()
    app = build_app(engine, ServerConfig())
    post(app, TEXT, {"prompt": "Hi", "max_tokens": 2})
    assert engine.submitted[-1][0] == [256, *b"Hi"]
    # vLLM's add_special_tokens false: a prompt that holds its BOS already gets no second one
    post(app, TEXT, {"prompt": "<|im_start|>Hi", "max_tokens": 2, "add_special_tokens": False})
    assert engine.submitted[-1][0] == [256, *b"Hi"]
    assert post(app, TEXT, {"prompt": ["<|im_start|>Hi", "Ho"], "max_tokens": 2,
                            "add_special_tokens": False}).status_code == 200
    assert engine.submitted[-2][0] == [256, *b"Hi"] and engine.submitted[-1][0] == [*b"Ho"]
    # echo gives a text prompt back as sent (not its tokens' text, BOS and all); token ids decoded
    r = post(app, TEXT, {"prompt": ["Hi", "Ho"], "echo": True, "max_tokens": 2}).json()
    texts = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
    assert [t[:2] for t in texts] == ["Hi", "Ho"] and engine.submitted[-1][0] == [256, *b"Ho"]
    r = post(app, TEXT, {"prompt": [256, 72, 105], "echo": True, "max_tokens": 2}).json()
    assert r["choices"][0]["text"].startswith("<|im_start|>Hi")
    # chat: the template writes its own special tokens; vLLM's add_special_tokens true adds BOS too
    post(app, CHAT, {"messages": USER, "max_tokens": 2})
    plain = engine.submitted[-1][0]
    post(app, CHAT, {"messages": USER, "max_tokens": 2, "add_special_tokens": True})
    assert engine.submitted[-1][0] == [256, *plain]


def test_text_parts_reach_the_template_as_the_python_api_renders_them():
    """Chat's text parts joined on the server as ChatTemplate joins them for LLM.chat (and as vLLM
    does): the same conversation, the same prompt, whichever way it arrives."""
    from pathlib import Path

    from tallow.chat_template import ChatTemplate
    from tallow.serve.protocols.openai_schemas import ChatMessage

    source = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
    template = ChatTemplate(source, bos_token="<|im_start|>", eos_token="<|im_end|>")
    wire = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    served = template.render([ChatMessage.model_validate(m).to_template() for m in wire])
    assert served == template.render(wire) and "Hello\nthere" in served
