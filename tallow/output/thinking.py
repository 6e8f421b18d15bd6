"""ThinkingSplitter: <think> ... </think> in streamed text into reasoning and content."""

from __future__ import annotations

from tallow.output.partial_match import partial_suffix_len


class ThinkingSplitter:
    """Splits text into content and reasoning at <think> ... </think>.

    One reasoning block: content until the open tag (or from the start with
    start_in_reasoning, when the chat template opened the block in the prompt: an open tag the
    model writes again there is dropped),
    reasoning until the close tag, then content to the end, with the newlines right
    after the close tag dropped (as Qwen's templates do). Without tags everything is
    content; an unclosed block is reasoning to the end. A tail that may begin a tag is
    held until it resolves. With enabled=False all text is content.

    push() returns (content, reasoning); when one piece of text crosses a tag, the order
    between the two is not kept (the sink emits reasoning first).
    """

    def __init__(self, open_tag: str = "<think>", close_tag: str = "</think>",
                 start_in_reasoning: bool = False, enabled: bool = True):
        self._open_tag = open_tag
        self._close_tag = close_tag
        self._enabled = enabled
        self._in_reasoning = start_in_reasoning
        self._closed = False  # the reasoning block has ended: the rest is content
        self._strip_newlines = False
        self._held = ""
        # The template opened the block and nothing of it has come yet: a model that writes the
        # open tag again (DeepSeek-R1 distills do) has it dropped, as vLLM's R1 parser does.
        self._repeat_open = start_in_reasoning

    def push(self, text: str) -> tuple[str, str]:
        if not self._enabled:
            return text, ""
        content, reasoning = [], []
        text, self._held = self._held + text, ""
        if self._repeat_open:
            lead = text.lstrip()
            if not lead or (self._open_tag.startswith(lead) and lead != self._open_tag):
                self._held = text  # only whitespace, or what may become the tag: wait for more
                return "", ""
            self._repeat_open = False
            if lead.startswith(self._open_tag):
                text = lead[len(self._open_tag):]
        while text and not self._closed:
            tag = self._close_tag if self._in_reasoning else self._open_tag
            out = reasoning if self._in_reasoning else content
            at = text.find(tag)
            if at == -1:
                keep = partial_suffix_len(text, (tag,))
                out.append(text[:len(text) - keep])
                self._held = text[len(text) - keep:]
                return "".join(content), "".join(reasoning)
            out.append(text[:at])
            text = text[at + len(tag):]
            if self._in_reasoning:
                self._in_reasoning, self._closed, self._strip_newlines = False, True, True
            else:
                self._in_reasoning = True
        if self._strip_newlines:
            text = text.lstrip("\n")
            self._strip_newlines = not text
        content.append(text)
        return "".join(content), "".join(reasoning)

    def flush(self) -> tuple[str, str]:
        """At the end of generation: a held partial tag is plain text after all."""
        held, self._held = self._held, ""
        return ("", held) if self._in_reasoning else (held, "")
