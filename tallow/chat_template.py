"""Chat templates: OpenAI-style messages (+ tools) -> prompt text.

Renders like transformers' apply_chat_template: the same sandboxed jinja environment (trim_blocks,
lstrip_blocks, loopcontrols, the {% generation %} tag; raise_exception, strftime_now and a tojson that
does not escape HTML)
and the same variables (messages, tools, add_generation_prompt, bos_token, eos_token, plus
chat_template_kwargs such as enable_thinking). Templates are untrusted code: they run in the
sandbox, in a worker thread under a time limit.

What the client wrote stays text (`render_prompt`): a special token's string ("<|im_end|>") in a
message, a tool's definition, a tool call's arguments or a template kwarg is rendered through a
marker and comes back as a literal span, which the tokenizer encodes as ordinary text; only
what the template writes itself (role markers, the tool-call markup it builds, the generation
prompt, bos/eos) becomes control tokens. Otherwise a user could forge a turn:
"<|im_end|> <|im_start|>assistant ..." inside a user message would read as the model's own turn.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import secrets
import threading
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable, Iterable

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tallow.config import ServerConfig
from tallow.errors import TallowError

# The fallback when a model ships no template.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CONTINUE_TAG = "<<tallow:continue_final_message>>"
_MAX_SEQUENCE_PRODUCT = 1_000_000  # longest string or list that `*` may build


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered chat prompt, and the character spans [start, end) in it (sorted, disjoint) where
    client text holds a special token's string: Tokenizer.encode(text, literal_spans=...) keeps
    those as text. No spans: the client text holds none, and the plain encode is the right one."""

    text: str
    literal_spans: tuple[tuple[int, int], ...] = ()


class _TemplateTimeout(BaseException):
    """Raised inside a render thread that ran past its time limit."""


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' environment, plus a cap on `*` and `**` so a template cannot build a huge value."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "**":
            if isinstance(right, (int, float)) and abs(right) > 1024:
                raise jinja2.exceptions.SecurityError("exponent too large")
            return left ** right
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > _MAX_SEQUENCE_PRODUCT:
                raise jinja2.exceptions.SecurityError("sequence repetition too large")
        return left * right


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _GenerationTag(Extension):
    """transformers' `{% generation %} ... {% endgeneration %}` (it marks the assistant's part of a
    training sample, for return_assistant_tokens_mask): rendered as its body, in a scope of its own
    as transformers' call block gives it. Templates of LFM2, SmolLM3 and others use it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


_ENV = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now


@dataclass(frozen=True)
class _Compiled:
    template: jinja2.Template
    supports_tools: bool
    supports_thinking: bool
    takes_content_parts: bool
    short_tool_call_ids: bool  # Mistral's: tool-call ids of nine letters and digits


@lru_cache(maxsize=32)
def _compile(source: str) -> _Compiled:
    try:
        ast = _ENV.parse(source)
        template = _ENV.from_string(ast)
    except jinja2.TemplateError as e:
        raise TallowError(f"invalid chat template: {e}", param="chat_template") from e
    variables = meta.find_undeclared_variables(ast)
    return _Compiled(template, "tools" in variables, "enable_thinking" in variables, _loops_over_content(ast),
                     "[TOOL_CALLS]" in source)


def _loops_over_content(ast: nodes.Template) -> bool:
    """Whether the template iterates a message's content, i.e. takes a list of parts, directly or
    through a variable set from it (`{% for part in message['content'] %}`)."""
    def reads_content(node: nodes.Node, names: set[str]) -> bool:
        for n in (node, *node.find_all((nodes.Getattr, nodes.Getitem, nodes.Name))):
            if isinstance(n, nodes.Getattr) and n.attr == "content":
                return True
            if isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Const) and n.arg.value == "content":
                return True
            if isinstance(n, nodes.Name) and n.name in names:
                return True
        return False

    aliases = {a.target.name for a in ast.find_all(nodes.Assign)
               if isinstance(a.target, nodes.Name) and reads_content(a.node, set())}
    return any(reads_content(loop.iter, aliases) for loop in ast.find_all(nodes.For))


def load_template_source(value: str) -> str:
    """--chat-template's value: a jinja file's path, or the template's own text (as vLLM's)."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise TallowError(f"chat_template {value!r}: cannot read it: {e}", param="chat_template") from e
    if "{{" in value or "{%" in value:
        return value
    raise TallowError(f"chat_template {value!r}: no such file (give a jinja file's path or the template's text)",
                      param="chat_template")


class ChatTemplate:
    """One model's chat template, compiled once (and cached by source)."""

    def __init__(self, source: str | None, *, bos_token: str | None, eos_token: str | None,
                 special_tokens: Iterable[str] = (), timeout_s: float = ServerConfig.template_timeout_s):
        self.source = source if source is not None else CHATML
        self.missing = False  # no template of the model's own nor given: every render is a 400
        self._compiled = _compile(self.source)
        self.bos_token = bos_token
        self.eos_token = eos_token
        # The tokenizer's special-token strings: in client text they are kept literal (render_prompt).
        self.special_tokens = tuple(t for t in special_tokens if t)
        self.timeout_s = timeout_s

    @classmethod
    def for_tokenizer(cls, tokenizer, *, override: str | None = None,
                      timeout_s: float = ServerConfig.template_timeout_s) -> "ChatTemplate":
        """The template a tokenizer ships, or `override` (EngineConfig.chat_template: a file's
        path or the template's text), with the tokenizer's bos, eos and special tokens. A model
        with neither (a base model such as Gemma 3 270M) gets a template whose every render is
        a 400 naming chat_template, as transformers and vLLM refuse it (no silent ChatML)."""
        source = load_template_source(override) if override is not None else tokenizer.chat_template
        template = cls(source, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                       special_tokens=tokenizer.special_tokens, timeout_s=timeout_s)
        if source is None:
            template.missing = True
        return template

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads `tools`."""
        return self._compiled.supports_tools

    @property
    def supports_thinking(self) -> bool:
        """Whether the template reads `enable_thinking`."""
        return self._compiled.supports_thinking

    def render(self, messages: list[dict], /, *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False, timeout_s: float | None = None, **kwargs: Any) -> str:
        """The prompt text for `messages` (OpenAI-style dicts).

        kwargs are chat_template_kwargs (enable_thinking, ...); they cannot override the variables
        above. continue_final_message renders the last message open, for the model to continue it
        (an assistant prefill), as transformers does. Raises TallowError (400) when the template
        fails or runs longer than timeout_s (by default the one given at construction).

        The text alone: tokenizing it reads special-token strings in client text as control tokens.
        A chat front end renders with render_prompt.
        """
        return self.render_prompt(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message, timeout_s=timeout_s,
                                  literal_special_tokens=False, **kwargs).text

    def render_prompt(self, messages: list[dict], /, *, tools: list[dict] | None = None,
                      add_generation_prompt: bool = True, continue_final_message: bool = False,
                      timeout_s: float | None = None, literal_special_tokens: bool = True,
                      **kwargs: Any) -> RenderedPrompt:
        """`render`'s text, and the spans of it where client text (messages, tools, kwargs) holds
        one of `special_tokens`' strings, for the tokenizer to keep as text.

        Only when the client text holds such a string is anything different done: each one is
        replaced by a marker of digits and punctuation (it passes through trim, upper, tojson, even
        with ensure_ascii), the template renders, and each marker in the result is put back as the
        token's text and recorded as a span. literal_special_tokens=False renders the text alone.
        """
        if self.missing:
            raise TallowError("this model has no chat template (a base model): send a prompt to /v1/completions, or "
                              "start the server with --chat-template FILE", param="chat_template")
        messages = [self._prepare(m) for m in messages]
        if continue_final_message:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise TallowError("the final message has no text to continue", param="messages")
            add_generation_prompt = False
        marker = self._marker(messages, tools, kwargs) if literal_special_tokens and self.special_tokens else None
        if marker is not None:
            pattern = _special_pattern(self.special_tokens)
            index = {t: str(k) for k, t in enumerate(self.special_tokens)}
            mark = lambda s: pattern.sub(lambda m: f"{marker}{index[m.group()]}~", s)  # noqa: E731
            messages, tools, kwargs = _map_strings(messages, mark), _map_strings(tools, mark), _map_strings(kwargs, mark)
        if continue_final_message:
            messages[-1]["content"] += _CONTINUE_TAG
        context = {**kwargs, "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
                   "bos_token": self.bos_token, "eos_token": self.eos_token}
        text = self._render_with_timeout(context, self.timeout_s if timeout_s is None else timeout_s)
        if continue_final_message:
            if _CONTINUE_TAG not in text:
                raise TallowError("the chat template drops the final message, so it cannot be continued",
                                  param="messages")
            text = text[:text.rindex(_CONTINUE_TAG)]
        return self._restore(text, marker) if marker is not None else RenderedPrompt(text)

    def _marker(self, messages: list[dict], tools: Any, kwargs: dict) -> str | None:
        """None when no client string holds a special token's string; else a marker prefix
        "~<nonce>~", the nonce 16 random digits that neither a client string nor the template
        holds: every "~<nonce>~" in the rendered text is then a marker's, whatever text is next
        to it (the nonce cannot straddle a "~")."""
        strings = [s for value in (messages, tools, kwargs) for s in _strings(value)]
        pattern = _special_pattern(self.special_tokens)
        if not any(pattern.search(s) for s in strings):
            return None
        while True:
            nonce = f"{secrets.randbelow(10**16):016d}"
            if not any(nonce in s for s in strings) and nonce not in self.source:
                return f"~{nonce}~"

    def _restore(self, text: str, marker: str) -> RenderedPrompt:
        """The rendered text with each marker back as its token's text, and those spans."""
        pieces: list[str] = []
        spans: list[tuple[int, int]] = []
        done = length = 0
        for m in re.finditer(re.escape(marker) + r"(\d+)~", text):
            token = self.special_tokens[int(m.group(1))]
            pieces += [text[done:m.start()], token]
            length += m.start() - done
            spans.append((length, length + len(token)))
            length += len(token)
            done = m.end()
        pieces.append(text[done:])
        return RenderedPrompt("".join(pieces), tuple(spans))

    def _prepare(self, message: dict) -> dict:
        """A copy of one message in the shape templates expect: text parts joined when the template
        does not take part lists, tool-call arguments as objects, reasoning under both names."""
        if not isinstance(message, dict):
            raise TallowError("each message must be an object", param="messages")
        message = dict(message)
        content = message.get("content")
        if content is None:  # an assistant turn of tool calls alone (content null or left out): vLLM's ""
            message["content"] = content = ""
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise TallowError(f"content part of type {kind!r} is not supported", param="messages")
            if not self._compiled.takes_content_parts:
                message["content"] = "\n".join(part["text"] for part in content)
        if message.get("tool_calls"):
            message["tool_calls"] = [_with_parsed_arguments(c) for c in message["tool_calls"]]
        if self._compiled.short_tool_call_ids:
            if message.get("tool_calls"):
                message["tool_calls"] = [_with_short_id(c) for c in message["tool_calls"]]
            if isinstance(message.get("tool_call_id"), str):
                message["tool_call_id"] = short_tool_call_id(message["tool_call_id"])
        reasoning = message.get("reasoning_content") or message.get("reasoning") or message.get("thinking")
        if reasoning is not None:
            message.setdefault("reasoning_content", reasoning)
            message.setdefault("thinking", reasoning)
        return message

    def _render_with_timeout(self, context: dict, timeout_s: float) -> str:
        """Render in a worker thread; past the limit, stop it with an asynchronous exception (checked
        between bytecodes, so it ends any pure-Python loop a template can run) and fail the request."""
        result: dict[str, Any] = {}

        def work():
            try:
                result["text"] = self._compiled.template.render(context)
            except _TemplateTimeout:
                pass
            except Exception as e:  # jinja's errors, and Python's from inside the template (TypeError, ...)
                result["error"] = e

        worker = threading.Thread(target=work, name="chat-template", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(_TemplateTimeout))
            raise TallowError(f"chat template rendering took longer than {timeout_s:g} s", param="messages")
        if "error" in result:
            e = result["error"]
            raise TallowError(f"chat template error: {e}", param="messages") from e
        return result["text"]


@lru_cache(maxsize=8)
def _special_pattern(tokens: tuple[str, ...]) -> re.Pattern:
    """A regex that finds any of `tokens`, the longest at a position first, built as a trie so a
    vocabulary of hundreds of special tokens (Llama 3's reserved ones) costs one pass."""
    trie: dict = {}
    for token in tokens:
        node = trie
        for c in token:
            node = node.setdefault(c, {})
        node[""] = True

    def pattern(node: dict) -> str:
        branches = [re.escape(c) + pattern(child) for c, child in sorted(node.items()) if c]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return re.compile(pattern(trie))


def _strings(value: Any) -> Iterable[str]:
    """Every string in a JSON-like value: dict keys and values, list items, recursively."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _map_strings(value: Any, f: Callable[[str], str]) -> Any:
    """A copy of a JSON-like value with f applied to every string (dict keys too)."""
    if isinstance(value, str):
        return f(value)
    if isinstance(value, dict):
        return {_map_strings(k, f): _map_strings(v, f) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, f) for v in value]
    return value


def short_tool_call_id(call_id: str) -> str:
    """A tool-call id as Mistral's templates take it (nine letters and digits, else they raise):
    as it is when it has that form, else its last nine letters and digits (vLLM keeps the last
    nine characters), else a hash of it; a call and its result get the same one."""
    if re.fullmatch(r"[A-Za-z0-9]{9}", call_id):
        return call_id
    tail = re.sub(r"[^A-Za-z0-9]", "", call_id)
    return tail[-9:] if len(tail) >= 9 else hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _with_short_id(call: Any) -> Any:
    if isinstance(call, dict) and isinstance(call.get("id"), str):
        return {**call, "id": short_tool_call_id(call["id"])}
    return call


def _with_parsed_arguments(call: Any) -> Any:
    """OpenAI sends tool-call arguments as a JSON string; templates expect the object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except (json.JSONDecodeError, RecursionError):  # (too deep to parse: left as the text sent)
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}
