"""Responses custom tools' grammars (Lark, regex) enforced on the call's input.

Grammar level, with llguidance itself as the reference: the grammar tallow builds for a custom
tool's input inside a tool-call format accepts the JSON encoding (or raw text) of exactly the
strings the client's own grammar accepts. End to end on the replay: model (its scripted input
breaks the grammar, so without enforcement the call would be wrong; masked, the replay samples
uniformly among the tokens the grammar allows: a random model): the custom_tool_call's input
follows the grammar, whole and streamed; a bad definition is a 400 naming the field.
"""

from __future__ import annotations

import json
import random
import re

import httpx
import pytest

llguidance = pytest.importorskip("llguidance")

from grammar_walk import lltok, matcher, random_walk, tok  # noqa: E402,F401  (fixtures)
from serve_utils import replay_server  # noqa: E402
from test_agent_clients import check_responses_stream, sse_events  # noqa: E402

from tallow.output.tool_parsers import TOOL_PARSERS  # noqa: E402
from tallow.output.tool_parsers.grammar import LarkGrammar, grammar_tools  # noqa: E402
from tallow.output.tool_parsers.input_grammar import (InputGrammar, UnenforceableInput,  # noqa: E402
                                                      string_value)
from tallow.serve.protocols.responses_tools import ToolError, build_tool_set  # noqa: E402

# Codex's apply_patch grammar (openai/codex, codex-rs/core/src/tools/handlers/tool_apply_patch.lark,
# Apache-2.0), as Codex sends it in the tool's format.definition.
APPLY_PATCH_LARK = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
'''
PATCHES = [
    "*** Begin Patch\n*** Add File: a.txt\n+say \"hi\"\n+C:\\dir\t\\n\n*** End Patch\n",
    "*** Begin Patch\n*** Update File: src/app.py\n*** Move to: src/main.py\n@@ def greet():\n"
    "-print(\"Hi\")\n+print(\"Hello, world!\")\n*** Delete File: old.txt\n*** End Patch",
]
NOT_PATCHES = ["*** Begin Patch\n*** End Patch\n", "*** Begin Patch\n*** Add File: a\nno plus\n*** End Patch\n",
               "*** Begin Patch\n*** Delete File: a\n\x01\n*** End Patch\n"]

# Small grammars whose random strings end soon: a patch without recursion (one regex), arithmetic
# (recursive: a nested %lark with escaped terminals), and a recursive one with quotes in literals.
SMALL_PATCH_LARK = r'''start: begin_patch hunk end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: "*** Delete File: " filename LF | "*** Add File: " filename LF add_line{1,2}
filename: /[a-z]{1,6}\.py/
add_line: "+" /[a-z "\\\t]{0,8}/ LF
%import common.LF
'''
ARITHMETIC_LARK = 'start: expr\n?expr: term (("+" | "-") term)*\n?term: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,3}/\n'
QUOTED_LIST_LARK = 'start: item\nitem: "[" item ("," item)? "]" | "\\"" /[a-z]{1,4}/ "\\""\n'
CODE_REGEX = r"[A-Z]{2}-[0-9]{3}( [a-z\"\\]{1,5})?"

GRAMMARS = {"small_patch": ("lark", SMALL_PATCH_LARK), "arithmetic": ("lark", ARITHMETIC_LARK),
            "quoted_list": ("lark", QUOTED_LIST_LARK), "code_regex": ("regex", CODE_REGEX)}


def follows(lltok, tok, syntax: str, definition: str, text: str) -> bool:
    """The client's own grammar takes the whole text (llguidance, as the reference)."""
    if syntax == "regex":
        return re.fullmatch(definition, text) is not None
    m = matcher(lltok, "lark", definition)
    return m.consume_tokens(tok.encode(text)) and m.is_accepting()


def random_text(lltok, tok, kind: str, grammar: str, rng: random.Random, max_steps: int = 200) -> str | None:
    """A random text the grammar allows, or None when the walk does not end in max_steps."""
    return random_walk(lltok, tok, kind, grammar, rng, max_steps=max_steps, eos_p=0.4, short=6)


def value_grammar(syntax: str, definition: str, quoting: str = "json") -> str:
    g = LarkGrammar()
    return g.text(string_value(g, "t", InputGrammar(syntax, definition, "tools[0]"), quoting))


# ---- the input's grammar inside a JSON string -------------------------------------------------

def test_codex_apply_patch_grammar_holds_the_json_string(tok, lltok):
    wrapped = value_grammar("lark", APPLY_PATCH_LARK)
    assert "%json" in wrapped  # no recursion: one regex, JSON-quoted by llguidance
    for patch in PATCHES:
        assert follows(lltok, tok, "lark", APPLY_PATCH_LARK, patch)
        assert follows(lltok, tok, "lark", wrapped, json.dumps(patch, ensure_ascii=False))
        assert follows(lltok, tok, "lark", wrapped, json.dumps(patch))  # \u escapes decode the same
    for text in NOT_PATCHES:
        assert not follows(lltok, tok, "lark", APPLY_PATCH_LARK, text)
        assert not follows(lltok, tok, "lark", wrapped, json.dumps(text, ensure_ascii=False))


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_the_json_string_holds_exactly_the_grammars_strings(tok, lltok, name):
    syntax, definition = GRAMMARS[name]
    wrapped = value_grammar(syntax, definition)
    rng = random.Random(name)
    own = "regex" if syntax == "regex" else "lark"
    checked = 0
    for _ in range(12):
        # The grammar's strings, JSON-encoded, are taken; the wrapped grammar's strings decode to
        # strings of the grammar.
        text = random_text(lltok, tok, own, definition, rng)
        if text is not None:
            assert follows(lltok, tok, "lark", wrapped, json.dumps(text, ensure_ascii=False)), text
            checked += 1
        encoded = random_text(lltok, tok, "lark", wrapped, rng)
        if encoded is not None:
            assert follows(lltok, tok, syntax, definition, json.loads(encoded)), encoded
            checked += 1
    assert checked >= 12


@pytest.mark.parametrize("definition", [
    'start: "(" start ")" | /[^()]+/',  # recursive, and a terminal that takes quotes and newlines
    'start: x\nx: "<" x ">" | WS\n%import common.WS',
    'start: x\nx: "\\"" x | "\\"\\n" | "a"',  # two literals apart only after an escape
    "start: <|im_end|>",
])
def test_what_the_json_string_cannot_hold_is_refused(definition):
    with pytest.raises(UnenforceableInput):
        value_grammar("lark", definition)


# ---- every tool-call format ------------------------------------------------------------------

FORMATS = ["hermes", "llama3_json", "mistral", "mistral_named", "pythonic", "qwen3_coder"]
CUSTOM = {"type": "function", "function": {"name": "apply_patch", "parameters": {
    "type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}


def parse_calls(name: str, text: str) -> list[tuple[str, dict]]:
    from tallow.output.detokenizer import Detokenizer
    from tallow.output.tool_parsers.router import ToolCallRouter

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (CUSTOM, WEATHER)}
    router = ToolCallRouter(Detokenizer(lambda t: bytes([t]), frozenset(), True), TOOL_PARSERS[name](schemas))
    "".join(router.push(t) for t in text.encode()) + router.flush()
    return [(c.name, json.loads(c.arguments)) for c in router.tool_calls()]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("grammar", ["small_patch", "code_regex"])
def test_forced_calls_in_every_format_carry_inputs_that_follow_the_grammar(tok, lltok, name, grammar):
    syntax, definition = GRAMMARS[grammar]
    grammars = {"apply_patch": InputGrammar(syntax, definition, "tools[0]")}
    template = "... [TOOL_CALLS] ... [ARGS] ..." if name == "mistral_named" else None  # NAME[ARGS]{...}
    name = name.removesuffix("_named")
    lark = TOOL_PARSERS[name]().call_grammar(grammar_tools([CUSTOM, WEATHER], constrain_all=True,
                                                           input_grammars=grammars), required=True, max_calls=1,
                                             chat_template=template)
    rng = random.Random(f"{name}-{grammar}")
    seen = 0
    for _ in range(16):
        reply = random_text(lltok, tok, "lark", lark, rng, max_steps=300)
        if reply is None:
            continue
        [(called, args)] = parse_calls(name, reply)
        if called == "apply_patch":
            assert follows(lltok, tok, syntax, definition, args["input"]), reply
            seen += 1
        else:
            assert set(args) == {"city"}
    assert seen >= 3


def test_under_auto_a_grammar_tool_counts_as_strict(tok, lltok):
    """Free text and calls of the plain tool pass; a call of the custom tool must follow its grammar."""
    grammars = {"apply_patch": InputGrammar("regex", CODE_REGEX, "tools[0]")}
    lark = TOOL_PARSERS["hermes"]().call_grammar(grammar_tools([CUSTOM, WEATHER], constrain_all=False,
                                                               input_grammars=grammars), required=False)

    def call(name, args):
        return f"Let me see.<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"

    assert follows(lltok, tok, "lark", lark, "Just text.")
    assert follows(lltok, tok, "lark", lark, call("get_weather", {"city": "Paris", "extra": 1}))
    assert follows(lltok, tok, "lark", lark, call("apply_patch", {"input": "AB-123 x\"y"}))
    assert not follows(lltok, tok, "lark", lark, call("apply_patch", {"input": "AB-12"}))


# ---- Responses: validation -------------------------------------------------------------------

def custom_tool(syntax: str, definition: str, name: str = "apply_patch") -> dict:
    return {"type": "custom", "name": name, "description": "Edit files.",
            "format": {"type": "grammar", "syntax": syntax, "definition": definition}}


@pytest.mark.parametrize("tool, param, reason", [
    (custom_tool("lark", "start: foo"), "tools[0].format.definition", "foo"),
    (custom_tool("lark", 'start: ("a"'), "tools[0].format.definition", ""),
    (custom_tool("regex", "[a-"), "tools[0].format.definition", ""),
    (custom_tool("ebnf", "x"), "tools[0].format.syntax", "lark"),
    ({"type": "namespace", "name": "ns", "tools": [custom_tool("regex", "(")]},
     "tools[0].tools[0].format.definition", ""),
])
def test_a_bad_definition_is_refused_naming_the_field(tool, param, reason):
    with pytest.raises(ToolError) as e:
        build_tool_set([tool], strict=False)
    assert e.value.param == param
    assert reason in str(e.value)


def test_the_grammars_are_kept_by_flat_name():
    tools = build_tool_set([{"type": "namespace", "name": "ns", "tools": [custom_tool("regex", "a+", "x")]},
                            {"type": "custom", "name": "free", "format": {"type": "text"}}], strict=False)
    assert tools.input_grammars == {"ns__x": InputGrammar("regex", "a+", "tools[0].tools[0]")}


# ---- Responses end to end ---------------------------------------------------------------------

BAD_INPUT = 'not a code "at" all\n'  # what the replay writes unconstrained


def scripted_call(name: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': {'input': BAD_INPUT}})}\n</tool_call>"


SCRIPT = [{"match": "enter the code", "reply": scripted_call("code")},
          {"match": "patch it", "reply": scripted_call("apply_patch")},
          {"reply": "Hello."}]


@pytest.fixture(scope="module")
def server():
    with replay_server(SCRIPT) as live:
        yield live


def respond(server, **body) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/responses", json={"model": "m", "max_output_tokens": 200, **body},
                      timeout=120)


def test_the_replays_own_input_breaks_the_grammars(tok, lltok):
    """Without enforcement the calls below would carry this input: the grammar is what fixes them."""
    assert not re.fullmatch(CODE_REGEX, BAD_INPUT)
    assert not follows(lltok, tok, "lark", SMALL_PATCH_LARK, BAD_INPUT)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_regex_tool_gets_a_matching_input(server, stream):
    inputs = []
    for _ in range(4):
        r = respond(server, input="enter the code", tools=[custom_tool("regex", CODE_REGEX, "code")],
                    tool_choice={"type": "custom", "name": "code"}, stream=stream)
        assert r.status_code == 200, r.text
        if stream:
            events = sse_events(r.text)
            response = check_responses_stream(events)
            streamed = "".join(d["delta"] for n, d in events if n == "response.custom_tool_call_input.delta")
            [done] = [d["input"] for n, d in events if n == "response.custom_tool_call_input.done"]
            assert streamed == done == response["output"][-1]["input"]
        else:
            response = r.json()
        call = response["output"][-1]
        assert (call["type"], call["name"]) == ("custom_tool_call", "code")
        assert re.fullmatch(CODE_REGEX, call["input"]), call["input"]
        inputs.append(call["input"])
    assert len(set(inputs)) > 1  # sampled among the grammar's strings, not a fixed answer


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_lark_tool_gets_an_input_the_grammar_parses(server, tok, lltok, stream):
    for _ in range(3):
        r = respond(server, input="patch it", tools=[custom_tool("lark", SMALL_PATCH_LARK)],
                    tool_choice={"type": "custom", "name": "apply_patch"}, stream=stream)
        assert r.status_code == 200, r.text
        if stream:
            events = sse_events(r.text)
            response = check_responses_stream(events)
            [done] = [d["input"] for n, d in events if n == "response.custom_tool_call_input.done"]
            assert done == response["output"][-1]["input"]
        else:
            response = r.json()
        call = response["output"][-1]
        assert call["type"] == "custom_tool_call"
        assert follows(lltok, tok, "lark", SMALL_PATCH_LARK, call["input"]), call["input"]


def test_required_with_a_grammar_tool_holds_it_too(server):
    r = respond(server, input="enter the code", tools=[custom_tool("regex", CODE_REGEX, "code")],
                tool_choice="required")
    assert r.status_code == 200, r.text
    assert re.fullmatch(CODE_REGEX, r.json()["output"][-1]["input"])


@pytest.mark.parametrize("tool, choice, param", [
    (custom_tool("lark", "start: bar"), "auto", "tools[0].format.definition"),
    (custom_tool("regex", "a{2"), {"type": "custom", "name": "apply_patch"}, "tools[0].format.definition"),
    (custom_tool("lark", 'start: "(" start ")" | /[^()]+/'), {"type": "custom", "name": "apply_patch"},
     "tools[0].format"),
    (custom_tool("regex", "a+"), {"type": "custom", "name": "nope"}, "tool_choice.name"),
])
def test_what_cannot_be_enforced_is_a_400_naming_it(server, tool, choice, param):
    r = respond(server, input="patch it", tools=[tool], tool_choice=choice)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
