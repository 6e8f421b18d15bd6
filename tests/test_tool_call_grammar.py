"""The tool-call grammars each parser builds (ToolParser.call_grammar), checked by llguidance itself
on the default model's tokenizer: the markup a template writes is accepted, what breaks a tool's
schema is refused, and every reply the grammar allows (random walks through its token masks) is
read back by the same parser as calls whose arguments validate (jsonschema)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

llguidance = pytest.importorskip("llguidance")

import grammar_walk  # noqa: E402
from grammar_walk import lltok, random_walk, tok  # noqa: E402,F401  (fixtures)
from tallow.output.tool_parsers import TOOL_PARSERS  # noqa: E402
from tallow.output.tool_parsers.grammar import UnenforceableSchema, grammar_tools  # noqa: E402

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city"], "additionalProperties": False}
NOTE_PARAMS = {"type": "object", "properties": {
    "text": {"type": "string", "maxLength": 20}, "urgent": {"type": "boolean"},
    "tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}, "maxItems": 2}},
    "required": ["text", "urgent"], "additionalProperties": False,
    "$defs": {"Tag": {"type": "string", "enum": ["home", "work"]}}}


def tool(name: str, params: dict, strict: bool | None = None) -> dict:
    fn = {"name": name, "parameters": params}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


TOOLS = [tool("get_weather", WEATHER_PARAMS), tool("add_note", NOTE_PARAMS)]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "add_note": NOTE_PARAMS}

# What each format's template writes for get_weather(city="Paris", days=3).
PARIS = {"city": "Paris", "days": 3}
WRITTEN = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    "pythonic": '[get_weather(city="Paris", days=3)]',
}
# The same call with days out of its bounds.
BAD_DAYS = {name: text.replace("3", "9") for name, text in WRITTEN.items()}


def matcher(lltok, lark: str):
    return grammar_walk.matcher(lltok, "lark", lark)


def accepts(lltok, tok, lark: str, text: str) -> bool:
    """The grammar takes the text (as the tokenizer cuts it) and may end there."""
    m = matcher(lltok, lark)
    return m.consume_tokens(tok.encode(text)) and m.is_accepting()


def parse(name: str, text: str) -> tuple[list[tuple[str, dict]], str]:
    """The calls and the content the parser reads from a whole reply."""
    from tallow.output.detokenizer import Detokenizer
    from tallow.output.tool_parsers.router import ToolCallRouter

    tokens = list(text.encode())
    router = ToolCallRouter(Detokenizer(lambda t: bytes([t]), frozenset(), True),
                            TOOL_PARSERS[name]({t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}))
    content = "".join(router.push(t) for t in tokens) + router.flush()
    return [(c.name, json.loads(c.arguments)) for c in router.tool_calls()], content


def random_reply(lltok, tok, lark: str, rng: random.Random, max_steps: int = 300) -> str:
    """A reply the grammar allows (grammar_walk.random_walk: eos a third of the time)."""
    reply = random_walk(lltok, tok, "lark", lark, rng, max_steps=max_steps)
    if reply is None:
        pytest.fail(f"the random walk did not end in {max_steps} tokens")
    return reply


def assert_valid_calls(calls, names=("get_weather", "add_note")) -> None:
    assert calls
    for name, args in calls:
        assert name in names
        jsonschema.validate(args, SCHEMAS[name])


FORMATS = sorted(WRITTEN)


@pytest.mark.parametrize("name", FORMATS)
def test_the_templates_markup_is_accepted_and_parsed(tok, lltok, name):
    lark = TOOL_PARSERS[name]().call_grammar(grammar_tools(TOOLS, constrain_all=True), required=True)
    assert accepts(lltok, tok, lark, WRITTEN[name]), lark
    assert parse(name, WRITTEN[name]) == ([("get_weather", PARIS)], "")


@pytest.mark.parametrize("name", FORMATS)
def test_arguments_against_the_schema_are_refused(tok, lltok, name):
    lark = TOOL_PARSERS[name]().call_grammar(grammar_tools(TOOLS, constrain_all=True), required=True)
    assert not accepts(lltok, tok, lark, BAD_DAYS[name])
    assert not accepts(lltok, tok, lark, "The weather is fine.")  # a forced call: no free text


@pytest.mark.parametrize("name", FORMATS)
def test_every_forced_reply_parses_to_valid_calls(tok, lltok, name):
    rng = random.Random(f"forced-{name}")
    for max_calls in (1, 3):
        lark = TOOL_PARSERS[name]().call_grammar(grammar_tools(TOOLS, constrain_all=True), required=True,
                                                 max_calls=max_calls)
        for _ in range(6):
            reply = random_reply(lltok, tok, lark, rng)
            calls, content = parse(name, reply)
            assert content.strip() == "", reply
            assert_valid_calls(calls)
            assert len(calls) <= max_calls, reply


@pytest.mark.parametrize("name", FORMATS)
def test_a_named_function_allows_only_that_one(tok, lltok, name):
    rng = random.Random(f"named-{name}")
    lark = TOOL_PARSERS[name]().call_grammar(grammar_tools(TOOLS[1:], constrain_all=True), required=True)
    assert not accepts(lltok, tok, lark, WRITTEN[name])
    for _ in range(4):
        calls, _ = parse(name, random_reply(lltok, tok, lark, rng))
        assert_valid_calls(calls, names=("add_note",))


@pytest.mark.parametrize("params", [None, {}])
def test_a_tool_without_parameters_is_called_with_empty_arguments(tok, lltok, params):
    # OpenAI: "omitting parameters defines a function with an empty parameter list"; a forced
    # call of such a tool wrote any object ({"length": 5}) before
    fn = {"name": "ping"} if params is None else {"name": "ping", "parameters": params}
    lark = TOOL_PARSERS["hermes"]().call_grammar(grammar_tools([{"type": "function", "function": fn}],
                                                               constrain_all=True), required=True)
    assert accepts(lltok, tok, lark, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
    assert not accepts(lltok, tok, lark, '<tool_call>\n{"name": "ping", "arguments": {"length": 5}}\n</tool_call>')


@pytest.mark.parametrize("name", FORMATS)
def test_strict_tools_under_auto_allow_text_and_valid_calls(tok, lltok, name):
    strict = [tool("get_weather", WEATHER_PARAMS, strict=True), tool("add_note", NOTE_PARAMS, strict=True)]
    lark = TOOL_PARSERS[name]().call_grammar(grammar_tools(strict, constrain_all=False), required=False)
    assert accepts(lltok, tok, lark, "It is sunny today.")
    assert accepts(lltok, tok, lark, WRITTEN[name])
    assert not accepts(lltok, tok, lark, BAD_DAYS[name])
    if TOOL_PARSERS[name].start_tags:  # formats that open calls in the middle of text
        text = "Let me check. " + WRITTEN[name].removeprefix("<|python_tag|>")
        if name == "llama3_json":
            text = "Let me check. <|python_tag|>" + WRITTEN[name]
        assert accepts(lltok, tok, lark, text), text
    rng = random.Random(f"auto-{name}")
    for _ in range(8):
        reply = random_reply(lltok, tok, lark, rng)
        calls, _ = parse(name, reply)
        for call_name, args in calls:
            jsonschema.validate(args, SCHEMAS[call_name])


@pytest.mark.parametrize("name", FORMATS)
def test_an_output_format_or_calls(tok, lltok, name):
    content = '%json {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}'
    lark = TOOL_PARSERS[name]().call_grammar(grammar_tools(TOOLS, constrain_all=False), required=False,
                                             content=content)
    assert accepts(lltok, tok, lark, '{"answer": 42}')
    assert accepts(lltok, tok, lark, WRITTEN[name])
    assert not accepts(lltok, tok, lark, "42")


def test_special_token_tags_are_matched_as_tokens(tok, lltok):
    """A tag that is a special token of the tokenizer is that token in the grammar, not its spelling:
    here <|im_start|> stands in for Mistral's [TOOL_CALLS]."""
    im_start = tok.token_to_id("<|im_start|>")
    lark = TOOL_PARSERS["mistral"]().call_grammar(grammar_tools(TOOLS, constrain_all=True), required=True,
                                                  special_ids={"[TOOL_CALLS]": im_start})
    call = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    m = matcher(lltok, lark)
    assert m.consume_tokens([im_start] + tok.encode(call)) and m.is_accepting()
    assert not accepts(lltok, tok, lark, "[TOOL_CALLS]" + call)


def test_the_mistral_template_with_args_tags_gets_the_named_form(tok, lltok):
    lark = TOOL_PARSERS["mistral"]().call_grammar(grammar_tools(TOOLS, constrain_all=True), required=True,
                                                  chat_template="... [TOOL_CALLS] ... [ARGS] ...")
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
    assert accepts(lltok, tok, lark, text)
    assert parse("mistral", text) == ([("get_weather", PARIS)], "")


@pytest.mark.parametrize("name", ["qwen3_coder", "pythonic"])
def test_a_strict_schema_the_format_cannot_write_is_an_error(name):
    params = {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}}}
    if name == "pythonic":
        params = {"type": "object", "properties": {"x": {"type": "object", "patternProperties": {"^a": {}}}}}
    with pytest.raises(UnenforceableSchema):
        TOOL_PARSERS[name]().call_grammar(grammar_tools([tool("f", params, strict=True)], constrain_all=True),
                                          required=True)
    # Not strict: the format writes what it can (the keyword is not enforced).
    TOOL_PARSERS[name]().call_grammar(grammar_tools([tool("f", params)], constrain_all=True), required=True)


def test_qwen3_coder_long_string_values_hold_their_length(tok, lltok):
    """Past a short maxLength the raw value is a lazy lexeme (the exact tag exclusion would be too
    big for llguidance's lexer): still held to its length."""
    params = {"type": "object", "properties": {"code": {"type": "string", "maxLength": 300}}, "required": ["code"]}
    lark = TOOL_PARSERS["qwen3_coder"]().call_grammar(grammar_tools([tool("run", params)], constrain_all=True),
                                                      required=True)

    def call(value: str) -> str:
        return f"<tool_call>\n<function=run>\n<parameter=code>\n{value}\n</parameter>\n</function>\n</tool_call>"

    assert accepts(lltok, tok, lark, call("print('<b>' * 40)\n" * 10))
    assert not accepts(lltok, tok, lark, call("x" * 301))
