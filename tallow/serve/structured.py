"""Structured output and enforced tool calls: a request's fields -> SamplingParams.grammar.

Every protocol maps its fields onto one GrammarSpec (tallow/engine/grammar.py), checked by the
backend on the planning thread; what the backend refuses is a 400 naming the field and giving
its reason, never a silent fallback to free text.

- Output formats (`OutputFormat`): Chat / Completions `response_format` (json_object,
  json_schema, text), vLLM's `structured_outputs` (json, regex, choice, grammar, json_object) and
  its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; Responses
  `text.format`; Anthropic `output_config.format` / `output_format`. At most one per request.
- JSON schemas compile with llguidance's options in an "x-guidance" key of the schema: written as
  json.dumps writes JSON (one line, ", " and ": "), and, unless strict is true, lenient (keywords
  the backend cannot enforce are ignored, as vLLM does); under strict: true they are a 400.
  The schema's text keeps the client's key order: llguidance writes properties in that order.
  A schema that admits no value (false, {"not": {}}, ...) is a 400 naming its field, strict or not.
- Tool calls (`tool_call_grammar`): tool_choice "required" (Anthropic "any") and a named function
  (Anthropic "tool") force the model's own tool-call markup (the tool parser's `call_grammar`),
  arguments valid against each tool's parameters; a named function is called once, "required"
  calls one or more (parallel_tool_calls: false: one). Object schemas that list properties and
  say nothing of other keys are closed to them (engine.grammar.closed_objects).
  Under "auto", a tool marked strict: true, a Responses custom tool with a grammar (which counts
  as strict), or an output format, constrains the reply too: free text (or the format's JSON) in
  which every call the model opens is well-formed.
- Custom tools' grammars (`input_grammars`): the input string of such a tool's call follows its
  Lark or regex grammar in every format (tallow/output/tool_parsers/input_grammar.py); one the
  format cannot hold is a 400 naming the tool's `format`.
- Reasoning: with a reasoning parser whose block the prompt does not close, the grammar starts
  after the end-of-reasoning tag (start_after): the reasoning is free. A prompt that closes it
  (thinking off: reasoning_effort "none", enable_thinking false) constrains from the first token.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, replace
from typing import Any

from tallow.engine.grammar import (GrammarError, GrammarSpec, check_grammar, compact_json, json_schema_object,
                                   json_schema_spec)
from tallow.output.reasoning import REASONING_PARSERS, prompt_closes_reasoning
from tallow.output.tool_parsers import TOOL_PARSERS
from tallow.output.tool_parsers.grammar import JSON_STYLE, UnenforceableSchema, grammar_tools
from tallow.output.tool_parsers.input_grammar import InputGrammar, UnenforceableInput
from tallow.serve.plan import Rejection

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputFormat:
    """What a request asks its reply's content to be: a grammar, and the field that asked."""

    spec: GrammarSpec
    param: str
    strict: bool = False


def json_schema_format(schema: Any, param: str, *, strict: bool = False) -> OutputFormat | Rejection:
    """A JSON schema (a dict, or its JSON text) as an OutputFormat."""
    try:
        schema = json_schema_object(schema)
    except ValueError as e:
        return Rejection.invalid(f"{param}: {e}", param)
    if admits_nothing(schema):
        # (A grammar of no value: strict would name the "not" it was written as, lenient drop it.)
        return no_value(param)
    return OutputFormat(json_schema_spec(schema, strict=strict), param, strict)


def admits_nothing(schema: Any, depth: int = 0) -> bool:
    """Whether no JSON value satisfies `schema`, as far as its own words say: false, "not" of a
    schema every value satisfies, an empty enum, an allOf with such a part, an anyOf / oneOf of
    only such parts, an object type with a required property of such a schema (looked for down to
    a bounded depth)."""
    if schema is False:
        return True
    if depth > 32 or not isinstance(schema, dict):
        return False
    if schema.get("not") is True or schema.get("not") == {}:
        return True
    if schema.get("enum") == []:
        return True
    if any(admits_nothing(part, depth + 1) for part in _list(schema.get("allOf"))):
        return True
    for key in ("anyOf", "oneOf"):
        parts = _list(schema.get(key))
        if parts and all(admits_nothing(part, depth + 1) for part in parts):
            return True
    properties = schema.get("properties")
    if schema.get("type") == "object" and isinstance(properties, dict):
        return any(admits_nothing(properties.get(name), depth + 1) for name in _list(schema.get("required"))
                   if isinstance(name, str))
    return False


def no_value(param: str) -> Rejection:
    """The 400 for a schema that admits no value (admits_nothing), naming its field."""
    return Rejection.invalid(f"{param}: the schema admits no value (it is false, or no JSON value satisfies it), "
                             "so no reply could follow it", param)


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def json_object_format(param: str) -> OutputFormat:
    return OutputFormat(GrammarSpec("json_object", ""), param)


def response_format(value: Any, param: str = "response_format") -> OutputFormat | Rejection | None:
    """OpenAI's response_format ({"type": "text" | "json_object" | "json_schema", "json_schema":
    {"name", "schema", "strict"}}), parsed by the wire model; None for text."""
    if value is None or value.type == "text":
        return None
    if value.type == "json_object":
        return json_object_format(param)
    spec = value.json_schema
    if spec is None:
        return Rejection.invalid(f"{param}.json_schema: Field required", f"{param}.json_schema")
    if spec.schema_ is None:
        return json_object_format(f"{param}.json_schema")
    return json_schema_format(spec.schema_, f"{param}.json_schema.schema", strict=bool(spec.strict))


def vllm_formats(req: Any) -> list[OutputFormat | Rejection]:
    """vLLM's structured_outputs and guided_* fields, each one set as an OutputFormat."""
    found: list[OutputFormat | Rejection] = []
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if so.structural_tag is not None:
            found.append(Rejection.invalid("structured_outputs.structural_tag is not supported; use tools with "
                                           "tool_choice, or structured_outputs.grammar",
                                           "structured_outputs.structural_tag"))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(so, name + "_" if name == "json" else name)
            if value is not None:
                found.append(_vllm_format(name, value, f"structured_outputs.{name}"))
        if so.json_object:
            found.append(json_object_format("structured_outputs.json_object"))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}", None)
        if value is not None:
            found.append(_vllm_format(name, value, f"guided_{name}"))
    return found


def _vllm_format(name: str, value: Any, param: str) -> OutputFormat | Rejection:
    if name == "json":
        return json_schema_format(value, param)
    if name == "regex":
        return OutputFormat(GrammarSpec("regex", value), param)
    if name == "choice":
        if not value:
            return Rejection.invalid(f"{param} must hold at least one string", param)
        return OutputFormat(GrammarSpec("choice", compact_json(list(value))), param)
    return OutputFormat(GrammarSpec("lark", value), param)  # Lark, or GBNF (the backend converts it)


def one_format(formats: list[OutputFormat | Rejection | None]) -> OutputFormat | Rejection | None:
    """The request's output format: at most one of the fields that set one."""
    formats = [f for f in formats if f is not None]
    for f in formats:
        if isinstance(f, Rejection):
            return f
    if len(formats) > 1:
        return Rejection.invalid(f"{formats[1].param} cannot be combined with {formats[0].param}: "
                                 "a request takes one output format", formats[1].param)
    return formats[0] if formats else None


# ---- tool calls ------------------------------------------------------------------------------


def tool_call_grammar(tokenizer, *, tools: list[dict[str, Any]] | None, tool_parser: str | None,
                      tool_choice: str | dict[str, Any] | None, max_calls: int | None,
                      output: OutputFormat | None, chat_template: str | None,
                      tool_field: str = "function.", schema_field: str = "parameters",
                      input_grammars: dict[str, InputGrammar] | None = None) -> OutputFormat | Rejection | None:
    """The grammar of a chat reply with tools: forced calls for "required" or a named function;
    under "auto" (None), the calls constrained when a tool is strict or an output format is set
    (the reply is then that format or calls). None when nothing constrains the reply beyond `output`.

    tools: the OpenAI-shaped tools rendered (None when tool_choice is "none"); tool_choice as
    OpenAI's ("required", {"type": "function", "function": {"name"}}). tool_field: where a tool's
    fields are in the request, for a 400's param ("function." in Chat's tools, "" in Responses'
    and Anthropic's), and the name of a tool's schema field ("input_schema" in Anthropic's).
    input_grammars: Responses custom tools' grammars by the tool's name: such a tool is held to
    its grammar, and counts as strict under "auto".
    """
    if not tools:
        return output
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    input_grammars = input_grammars or {}
    strict = [k for k, t in enumerate(tools) if t.get("function", t).get("strict") is True]
    grammar_tools_k = [k for k, t in enumerate(tools) if t.get("function", t).get("name") in input_grammars]
    if not forced and not strict and not grammar_tools_k and output is None:
        return None
    if forced:
        param = "tool_choice"
    elif strict:
        param = f"tools[{strict[0]}].{tool_field}strict"
    elif grammar_tools_k:
        first = tools[grammar_tools_k[0]]
        param = input_grammars[first.get("function", first)["name"]].param + ".format"
    else:
        param = output.param
    if tool_parser is None:
        return Rejection.invalid(f"{param}: the model's tool-call format is not known (no tool-call parser), "
                                 "so tool calls cannot be enforced", param)
    for k in strict:  # each strict tool's schema must be enforceable on its own
        rejection = strict_schema_rejection(tokenizer, tools, k, f"tools[{k}].{tool_field}{schema_field}")
        if rejection is not None:
            return rejection
    indices = list(range(len(tools)))
    if isinstance(tool_choice, dict):  # a named function: one call of it (as vLLM; instructor and
        # pydantic-ai read a single call), whatever parallel_tool_calls says
        name = tool_choice.get("function", tool_choice).get("name")
        indices = [k for k in indices if tools[k].get("function", tools[k]).get("name") == name]
        max_calls = 1
    for k in indices if forced else ():  # a forced call's arguments follow its tool's schema
        if admits_nothing(tools[k].get("function", tools[k]).get("parameters")):
            return no_value(f"tools[{k}].{tool_field}{schema_field}")
    content = None
    if not forced and output is not None:
        if output.spec.kind not in ("json_schema", "json_object"):
            return Rejection.invalid(f"{output.param} cannot be combined with tools under tool_choice 'auto'; "
                                     "only a JSON output format can", output.param)
        content = "%json " + (output.spec.text if output.spec.kind == "json_schema" else compact_json(
            {"type": "object", "x-guidance": {**JSON_STYLE, "lenient": True}}))
    parser = TOOL_PARSERS[tool_parser]()
    special_ids = {text: tokenizer.token_to_id(text) for text in getattr(tokenizer, "special_tokens", ())}
    try:
        lark = parser.call_grammar(grammar_tools([tools[k] for k in indices], constrain_all=forced,
                                                 input_grammars=input_grammars), required=forced,
                                   max_calls=max_calls, content=content, chat_template=chat_template,
                                   special_ids={t: i for t, i in special_ids.items() if i is not None})
    except UnenforceableSchema as e:
        k = next((k for k, t in enumerate(tools) if t.get("function", t).get("name") == e.tool), 0)
        where = f"tools[{k}].{tool_field}{schema_field}"
        return Rejection.invalid(f"{where}: {e}", where)
    except UnenforceableInput as e:
        where = f"{e.param}.format" if e.param else param
        return Rejection.invalid(f"{where}: {e}", where)
    except NotImplementedError as e:
        return Rejection.invalid(f"{param}: {e}", param)
    return OutputFormat(GrammarSpec("lark", lark), param, bool(strict) or (output is not None and output.strict))


def strict_schema_rejection(tokenizer, tools: list[dict[str, Any]], k: int, param: str) -> Rejection | None:
    """The 400 for tool k's schema when it cannot be enforced exactly (strict), else None."""
    params = tools[k].get("function", tools[k]).get("parameters") or {"type": "object"}
    fmt = json_schema_format(params, param, strict=True)
    return fmt if isinstance(fmt, Rejection) else check(fmt, tokenizer)


# ---- reasoning and the final check ---------------------------------------------------------------


def start_after(tokenizer, reasoning_parser: str | None, prompt_text: str) -> tuple[int, ...] | None:
    """The token ids after which the grammar applies: the end-of-reasoning tag's, when the reply
    may reason (a reasoning parser, and a prompt that does not close the reasoning block itself:
    thinking off renders an empty closed block); None: the grammar applies from the first token."""
    fmt = REASONING_PARSERS.get(reasoning_parser or "none")
    if fmt is None:
        return None
    if prompt_closes_reasoning(prompt_text, fmt):
        return None
    return tuple(tokenizer.encode(fmt.close_tag))


def check(fmt: OutputFormat, tokenizer) -> Rejection | None:
    """The backend's verdict on the grammar: a 400 naming the field and the backend's reason."""
    try:
        check_grammar(fmt.spec, tokenizer)
    except GrammarError as e:
        return Rejection.invalid(f"{fmt.param}: the grammar backend rejected it: {_first_line(e)}", fmt.param)
    except ImportError as e:
        return Rejection.invalid(f"{fmt.param}: structured output needs the llguidance package, which is not "
                                 f"installed ({e})", fmt.param)
    except Exception as e:  # noqa: BLE001 (a tokenizer the backend cannot read: this request only)
        log.warning("the grammar backend failed on a request's %s: %r", fmt.param, e)
        return Rejection.invalid(f"{fmt.param}: structured output is not available for this model: {e}", fmt.param)
    return None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    # llguidance appends its parser state and the whole grammar to some messages: the reason is first.
    for cut in ("\n<state>", "<state>", "\n<grammar>"):
        if cut in text:
            text = text[:text.index(cut)]
    return text.strip()[:2000]


def grammar_for(fmt: OutputFormat | Rejection | None, tokenizer, *, reasoning_parser: str | None = None,
                prompt_text: str = "") -> GrammarSpec | Rejection | None:
    """The checked GrammarSpec of a request (start_after set for a reply that may reason first)."""
    if fmt is None or isinstance(fmt, Rejection):
        return fmt
    after = start_after(tokenizer, reasoning_parser, prompt_text)
    if after:
        fmt = replace(fmt, spec=replace(_after_reasoning(fmt.spec), start_after=after))
    rejection = check(fmt, tokenizer)
    return rejection if rejection is not None else fmt.spec


_UNESCAPED_SLASH = re.compile(r"(?<!\\)((?:\\\\)*)/")


def _after_reasoning(spec: GrammarSpec) -> GrammarSpec:
    """The models write a blank line after the end of reasoning: an output format there takes a
    little whitespace first (the thinking splitter drops it from the content). A Lark grammar,
    the client's or a tool call's, says itself what comes first."""
    if spec.kind == "json_schema":
        body = "%json " + spec.text
    elif spec.kind == "json_object":
        body = "%json " + compact_json({"type": "object", "x-guidance": JSON_STYLE})
    elif spec.kind == "regex":
        body = "/" + _UNESCAPED_SLASH.sub(r"\1\\/", spec.text) + "/"
    elif spec.kind == "choice":
        body = "(" + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec.text)) + ")"
    else:
        return spec
    return GrammarSpec("lark", f"start: /[ \\t\\r\\n]{{0,8}}/ {body}\n", spec.start_after)
