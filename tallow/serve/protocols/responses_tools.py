"""Responses tools beyond `function`, as Codex sends them, mapped onto the chat template's function tools.

- `namespace`: a group of function (or custom) tools. The model sees each member as a function
  named `<namespace>__<name>` (the double underscore of MCP tool names in Codex and Claude Code);
  a call to that name comes back as a function_call item with `namespace` and the member's own
  `name`, as OpenAI answers it.
- `custom`: free-form input. The model sees a function with one string argument, `input`; a call
  comes back as a custom_tool_call item whose `input` is that string. A grammar in the tool's
  `format` ({"type": "grammar", "syntax": "lark" | "regex", "definition"}) is compiled here (an
  invalid one: a 400 naming `tools[i].format.definition`, llguidance's reason) and enforced on
  the input whenever the reply is constrained: under a forced tool_choice, and under "auto" too,
  where such a tool counts as strict (free text, and every call the model opens well-formed).
  How the grammar sits inside each tool-call format, and what cannot be enforced (a 400 naming
  `tools[i].format`): tallow/output/tool_parsers/input_grammar.py. The description also tells
  the model the syntax.
- hosted tools the server cannot run (web_search, file_search, code_interpreter,
  image_generation, computer_use_preview, mcp, local_shell, ...): dropped from what the model
  sees; the names go into the X-Tallow-Dropped-Tools response header and the server log. This is
  the one place tallow ignores a field that changes meaning, because Codex always sends
  web_search; `--strict-tools` makes them a 400 instead.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from tallow.output.tool_parsers.input_grammar import InputGrammar, check_definition

log = logging.getLogger(__name__)

NAMESPACE_SEPARATOR = "__"
DROPPED_TOOLS_HEADER = "X-Tallow-Dropped-Tools"

# Hosted tool types (their dated variants too: web_search_preview_2025_03_11, web_search_2025_08_26).
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                "computer_use_preview", "computer_use", "computer", "mcp", "local_shell", "shell", "apply_patch",
                "tool_search", "programmatic_tool_calling")

_CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


def is_hosted(tool_type: str) -> bool:
    return any(tool_type == t or tool_type.startswith(t + "_20") for t in HOSTED_TOOLS)


@dataclass(frozen=True)
class ToolRef:
    """What a name the model sees stands for."""

    kind: str  # "function" or "custom"
    name: str
    namespace: str | None = None


@dataclass
class ToolSet:
    """A request's tools as the chat template takes them, and how to map the model's calls back."""

    chat_tools: list[dict[str, Any]] = field(default_factory=list)
    refs: dict[str, ToolRef] = field(default_factory=dict)  # flat name -> tool
    dropped: list[str] = field(default_factory=list)  # hosted tool types left out
    input_grammars: dict[str, InputGrammar] = field(default_factory=dict)  # flat name -> custom tool's grammar
    # Function tools sent without strict (or strict null): strict by default on /v1/responses, as
    # OpenAI's (responses_grammar holds them to their schemas where it can), and of those, the
    # ones whose schema could not be enforced (the model's call format unknown, or keywords the
    # grammar cannot express), which run lenient instead of failing the request
    strict_by_default: set[str] = field(default_factory=set)
    lenient: set[str] = field(default_factory=set)

    def flat_name(self, name: str, namespace: str | None) -> str:
        return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name

    def ref(self, flat_name: str) -> ToolRef:
        return self.refs.get(flat_name) or ToolRef("function", flat_name)


class ToolError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def build_tool_set(tools: list[dict[str, Any]], *, strict: bool) -> ToolSet:
    """The chat template's function tools for a request's `tools` (raw dicts). Raises ToolError."""
    out = ToolSet()

    def add(tool: dict[str, Any], param: str, namespace: str | None, namespace_description: str | None) -> None:
        kind = tool.get("type")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"{param}.name: Field required", f"{param}.name")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{param}.description: Input should be a valid string", f"{param}.description")
        if namespace_description:
            description = f"{namespace_description}\n\n{description or ''}".strip()
        if kind == "function":
            parameters = tool.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise ToolError(f"{param}.parameters: Input should be an object", f"{param}.parameters")
            parameters = parameters or {"type": "object", "properties": {}}
        else:  # custom
            fmt = tool.get("format")
            if fmt is not None and not isinstance(fmt, dict):
                raise ToolError(f"{param}.format: Input should be an object", f"{param}.format")
            grammar = _input_grammar(fmt, param)
            if grammar is not None:
                out.input_grammars[out.flat_name(name, namespace)] = grammar
            description = _custom_description(description, fmt)
            parameters = _CUSTOM_PARAMETERS
        flat = out.flat_name(name, namespace)
        if flat in out.refs:
            raise ToolError(f"{param}.name: the tool name {flat!r} is defined twice", f"{param}.name")
        out.refs[flat] = ToolRef(kind, name, namespace)
        function = {"name": flat, "parameters": parameters}
        if description:
            function["description"] = description
        if kind == "function" and tool.get("strict") is True:
            function["strict"] = True  # its arguments follow the schema under auto too (serve/structured.py)
        elif kind == "function" and tool.get("strict") is None:
            out.strict_by_default.add(flat)
        out.chat_tools.append({"type": "function", "function": function})

    for k, tool in enumerate(tools):
        param = f"tools[{k}]"
        kind = tool.get("type")
        if kind in ("function", "custom"):
            add(tool, param, None, None)
        elif kind == "namespace":
            namespace = tool.get("name")
            members = tool.get("tools")
            if not isinstance(namespace, str) or not namespace:
                raise ToolError(f"{param}.name: Field required", f"{param}.name")
            if not isinstance(members, list) or not members:
                raise ToolError(f"{param}.tools: a namespace holds at least one tool", f"{param}.tools")
            for j, member in enumerate(members):
                if not isinstance(member, dict) or member.get("type") not in ("function", "custom"):
                    raise ToolError(f"{param}.tools[{j}].type: a namespace holds function and custom tools",
                                    f"{param}.tools[{j}].type")
                add(member, f"{param}.tools[{j}]", namespace, tool.get("description"))
        elif isinstance(kind, str) and is_hosted(kind):
            if strict:
                raise ToolError(f"{param}: the hosted tool type {kind!r} cannot run on this server "
                                "(--strict-tools); only function, custom and namespace tools can",
                                f"{param}.type")
            out.dropped.append(kind)
        else:
            raise ToolError(f"{param}.type: the tool type {kind!r} is not supported; function, custom, "
                            "namespace and the hosted tools (dropped) are", f"{param}.type")
    if out.dropped:
        log.warning("Responses request: hosted tools dropped (this server cannot run them): %s",
                    ", ".join(out.dropped))
    return out


def _input_grammar(fmt: dict[str, Any] | None, tool_param: str) -> InputGrammar | None:
    """A custom tool's format: None for free text ({"type": "text"} or none), else its grammar,
    compiled once to refuse an invalid one. Raises ToolError."""
    if fmt is None or fmt.get("type") == "text":
        return None
    param = f"{tool_param}.format"
    if fmt.get("type") != "grammar":
        raise ToolError(f"{param}.type: Input should be 'text' or 'grammar'", f"{param}.type")
    syntax, definition = fmt.get("syntax"), fmt.get("definition")
    if syntax not in ("lark", "regex"):
        raise ToolError(f"{param}.syntax: Input should be 'lark' or 'regex'", f"{param}.syntax")
    if not isinstance(definition, str) or not definition.strip():
        raise ToolError(f"{param}.definition: a non-empty string is required", f"{param}.definition")
    try:
        reason = check_definition(syntax, definition)
    except ImportError as e:
        raise ToolError(f"{param}: grammar tools need the llguidance package, which is not installed ({e})",
                        param) from None
    if reason is not None:
        raise ToolError(f"{param}.definition: invalid {syntax} grammar: {reason}", f"{param}.definition")
    return InputGrammar(syntax, definition, tool_param)


def _custom_description(description: str | None, fmt: dict[str, Any] | None) -> str:
    text = description or ""
    if fmt and fmt.get("type") == "grammar":
        syntax, definition = fmt.get("syntax"), fmt.get("definition")
        text += f"\n\nThe input must follow this {syntax} grammar:\n{definition}"
    return (text + "\n\nPut the tool's whole free-form input in the `input` string.").strip()


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments the model wrote ({"input": "..."}), or the
    arguments themselves when they are not that shape."""
    try:
        value = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments if not isinstance(value, str) else value
