"""Schemas as clients send them: a pydantic model's JSON schema lists its properties and says
nothing of other keys. Left open, a grammar lets a small model invent keys until max_tokens (the
first thing instructor, pydantic-ai and LangChain users met: "output incomplete"). tallow closes
such objects (as xgrammar, vLLM's default backend, and OpenAI's strict mode read them), and a
named tool_choice gives exactly one call. Checked with jsonschema (the closed schema) and with
llguidance's own matcher on the default model's tokenizer (the grammars the server builds)."""

from __future__ import annotations

import copy
import json
from typing import Annotated, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

llguidance = pytest.importorskip("llguidance")

from grammar_walk import lltok, tok  # noqa: E402,F401  (fixtures)
from tallow.engine.grammar import closed_objects, grammar_text  # noqa: E402
from tallow.serve.structured import json_schema_format, tool_call_grammar  # noqa: E402


class Person(BaseModel):
    first_name: Annotated[str, Field(max_length=12)]
    age: int = Field(ge=0, le=120)


class Team(BaseModel):
    lead: Person
    members: list[Person] = Field(max_length=2)
    motto: str | None = None


TEAM = Team.model_json_schema()  # $defs, anyOf with null, nested objects; no additionalProperties
VALID = {"lead": {"first_name": "Ada", "age": 36}, "members": [{"first_name": "Bo", "age": 7}], "motto": None}


def with_extra(path: tuple) -> dict:
    value = copy.deepcopy(VALID)
    node = value
    for step in path:
        node = node[step]
    node["extra"] = 1
    return value


def accepts(lltok, tok, grammar: str, text: str) -> bool:
    m = llguidance.LLMatcher(lltok, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(tok.encode(text)) and m.is_accepting()


@pytest.mark.parametrize("path", [(), ("lead",), ("members", 0)])
def test_closed_objects_refuse_extra_keys_at_every_level(path):
    assert "additionalProperties" not in json.dumps(TEAM)
    jsonschema.validate(with_extra(path), TEAM)  # the schema as written takes them
    closed = closed_objects(TEAM)
    jsonschema.validate(VALID, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(with_extra(path), closed)
    assert TEAM == Team.model_json_schema()  # the input is not modified


def test_what_a_schema_says_of_other_keys_is_kept():
    for key, value in (("additionalProperties", True), ("additionalProperties", {"type": "integer"}),
                       ("patternProperties", {"^x": {}})):
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, key: value}
        assert closed_objects(schema) == schema
    free = {"type": "object"}  # no properties: any object, as before
    assert closed_objects(free) == free
    both = {"allOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]}
    jsonschema.validate({"a": 1, "b": 2}, closed_objects(both))  # branches of a conjunction stay open
    # a property named like a keyword is a name, not a schema
    named = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}}}}
    closed = closed_objects(named)
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["properties"]["properties"]


def test_response_format_from_a_pydantic_model_refuses_extra_keys(tok, lltok):
    fmt = json_schema_format(TEAM, "response_format.json_schema.schema")
    grammar = grammar_text(fmt.spec)
    assert accepts(lltok, tok, grammar, json.dumps(VALID))
    for path in [(), ("lead",), ("members", 0)]:
        assert not accepts(lltok, tok, grammar, json.dumps(with_extra(path)))


def tools() -> list[dict]:
    return [{"type": "function", "function": {"name": "make_team", "parameters": TEAM}},
            {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]


def hermes_call(args: dict, name: str = "make_team") -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def call_grammar(tok, tool_choice) -> str:
    fmt = tool_call_grammar(tok, tools=tools(), tool_parser="hermes", tool_choice=tool_choice, max_calls=None,
                            output=None, chat_template=None)
    return grammar_text(fmt.spec)


def test_a_named_tool_choice_is_one_call_with_closed_arguments(tok, lltok):
    grammar = call_grammar(tok, {"type": "function", "function": {"name": "make_team"}})
    assert accepts(lltok, tok, grammar, hermes_call(VALID))
    assert not accepts(lltok, tok, grammar, hermes_call(VALID) + "\n" + hermes_call(VALID))
    assert not accepts(lltok, tok, grammar, hermes_call(with_extra(("lead",))))
    assert not accepts(lltok, tok, grammar, hermes_call({}, "noop"))


def test_required_still_takes_several_calls(tok, lltok):
    grammar = call_grammar(tok, "required")
    assert accepts(lltok, tok, grammar, hermes_call(VALID) + "\n" + hermes_call({}, "noop"))
    assert not accepts(lltok, tok, grammar, hermes_call(with_extra(())))
