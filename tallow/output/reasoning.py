"""Reasoning parsers: which tags mark a model's reasoning, chosen by name or by template."""

from __future__ import annotations

from dataclasses import dataclass

from tallow.output.thinking import ThinkingSplitter


@dataclass(frozen=True)
class ReasoningFormat:
    open_tag: str
    close_tag: str


_THINK = ReasoningFormat("<think>", "</think>")

REASONING_PARSERS: dict[str, ReasoningFormat | None] = {
    "deepseek_r1": _THINK,
    "qwen3": _THINK,
    "none": None,
}


def reasoning_parser_for_template(chat_template: str | None) -> str:
    """The parser a chat template implies: "qwen3" when it knows <think>, else "none"."""
    return "qwen3" if chat_template and _THINK.open_tag in chat_template else "none"


def prompt_opens_reasoning(turn: str, fmt: ReasoningFormat) -> bool:
    """Whether the model's turn so far ends inside an open reasoning block: its last open tag has
    no close tag after it. turn: the prompt from where the model's own turn begins (ChatPrompt.
    model_turn: the generation prompt, or the assistant message a reply continues), so a tag in a
    client's message ("what does <think> do?") opens nothing.

    Templates such as DeepSeek-R1's end the prompt with "<think>\\n", so the reply starts in the
    middle of the reasoning; so does a prefill that opens the block and stops inside it.
    """
    opened = turn.rfind(fmt.open_tag)
    return opened != -1 and turn.find(fmt.close_tag, opened) == -1


def prompt_closes_reasoning(turn: str, fmt: ReasoningFormat) -> bool:
    """Whether the template closed the reasoning block itself (thinking off: Qwen3's
    "<think>\\n\\n</think>\\n\\n", DeepSeek-V3.1's "<think></think>"): the reply is all
    content, a tag in it included. turn: as for prompt_opens_reasoning."""
    return turn.rstrip().endswith(fmt.close_tag)


def make_thinking_splitter(name: str | None, prompt_text: str, enabled: bool) -> ThinkingSplitter:
    """A ThinkingSplitter for the parser `name` (None or "none": reasoning not split).

    enabled=False (text completions, or a request that wants the raw text) gives a
    splitter that passes everything through as content.
    """
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    fmt = REASONING_PARSERS.get(name or "none")
    if fmt is None or not enabled or prompt_closes_reasoning(prompt_text, fmt):
        return ThinkingSplitter(enabled=False)
    return ThinkingSplitter(fmt.open_tag, fmt.close_tag,
                            start_in_reasoning=prompt_opens_reasoning(prompt_text, fmt))
