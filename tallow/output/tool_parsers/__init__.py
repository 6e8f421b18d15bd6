"""Tool-call parsers by name: one module per format the models write, and the router's factory.

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>   (Hermes, Qwen2.5, Qwen3)
    qwen3_coder  <tool_call><function=f><parameter=k>v</parameter></function></tool_call>
    llama3_json  <|python_tag|>{"name": "f", "parameters": {...}}; {...}   (the tag is optional
                 when the JSON begins the reply)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}]  or  [TOOL_CALLS]f[ARGS]{...}
    pythonic     [f(a=1), g(b="x")]   (begins the reply)

Each parser keeps the split-invariant contract of ToolParser.parse(markup, final) (base.py);
ToolCallRouter (router.py) streams the content around the markup.
"""

from __future__ import annotations

from typing import Any

from tallow.output.detokenizer import Detokenizer
from tallow.output.reasoning import ReasoningFormat, prompt_closes_reasoning, prompt_opens_reasoning
from tallow.output.tool_parsers.base import ToolParser, tool_schemas
from tallow.output.tool_parsers.hermes import HermesParser
from tallow.output.tool_parsers.llama3_json import Llama3JsonParser
from tallow.output.tool_parsers.mistral import MistralParser
from tallow.output.tool_parsers.pythonic import PythonicParser
from tallow.output.tool_parsers.qwen3_coder import Qwen3CoderParser
from tallow.output.tool_parsers.router import ToolCallRouter

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesParser, Qwen3CoderParser, Llama3JsonParser, MistralParser, PythonicParser)
}


def tool_parser_for_template(chat_template: str | None) -> str | None:
    """The parser a chat template's tool markup implies, or None when it shows none."""
    if not chat_template:
        return None
    for needle, name in (("<function=", "qwen3_coder"), ("<tool_call>", "hermes"),
                         ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
                         ('"parameters": dictionary of argument', "llama3_json"),
                         ("[func_name1(", "pythonic")):
        if needle in chat_template:
            return name
    return None


def make_tool_router(tokenizer, parser_name: str, *, tools: list[dict[str, Any]] | None = None,
                     reasoning: ReasoningFormat | None = None, prompt_text: str = "",
                     skip_special_tokens: bool = True, max_calls: int | None = None) -> ToolCallRouter:
    """A ToolCallRouter for a request.

    tokenizer: a tallow Tokenizer. The parser's marker tags stay visible even when special
    tokens are skipped (Mistral's [TOOL_CALLS] and Llama 3's <|python_tag|> are special
    tokens). reasoning: the format the sink's thinking splitter splits on (None when it does
    not split); prompt_text tells whether the reply starts inside a reasoning block. max_calls:
    the router closes after that many calls (parallel_tool_calls: false).
    """
    if parser_name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {parser_name!r}; known: {', '.join(TOOL_PARSERS)}")
    parser = TOOL_PARSERS[parser_name](tool_schemas(tools))
    markers = {tokenizer.token_to_id(tag) for tag in parser.markers}
    detokenizer = Detokenizer(tokenizer.token_bytes, tokenizer.special_token_ids - markers,
                              skip_special_tokens)
    if reasoning is not None and prompt_closes_reasoning(prompt_text, reasoning):
        reasoning = None  # thinking off: the reply is content and calls (the sink splits nothing either)
    start_in_reasoning = reasoning is not None and prompt_opens_reasoning(prompt_text, reasoning)
    # special-token markers kept visible only for the parser: skipped again in markup that turns
    # out to be content (Llama 3.1's <|python_tag|> before a built-in tool or code)
    hidden = tuple(tag for tag in parser.markers if skip_special_tokens
                   and tokenizer.token_to_id(tag) in tokenizer.special_token_ids)
    return ToolCallRouter(detokenizer, parser, reasoning, start_in_reasoning, max_calls, hidden)
