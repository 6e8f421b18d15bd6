"""The one sink for generated tokens: token ids in, semantic events out.

    token id -> router (incremental detokenizer; a tool router withholds tool-call markup)
             -> StopMatcher (stop strings on the decoded text)
             -> ThinkingSplitter (<think>...</think> into reasoning)
             -> events: ContentEvent | ReasoningEvent | ToolCallDeltaEvent | ToolCallsEvent

Every stage works incrementally and holds back only what it cannot decide yet: an
incomplete UTF-8 sequence, a tail that may begin a stop string, a tail that may begin a
tag. Whatever way the text is cut into pieces, the concatenated output is the same.
"""

from __future__ import annotations

import codecs
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string

    @classmethod
    def create(cls, name: str, arguments: str) -> ToolCall:
        """A tool call with a fresh OpenAI-style id ("call_" + 24 hex digits)."""
        return cls(id=f"call_{secrets.token_hex(12)}", name=name, arguments=arguments)


@dataclass(frozen=True)
class ContentEvent:
    text: str


@dataclass(frozen=True)
class ReasoningEvent:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of a streamed tool call, in OpenAI's incremental form.

    A call's first delta carries id and name (arguments ""); the next ones carry pieces of
    the arguments, whose concatenation is exactly the call's final `arguments`.
    """

    index: int
    id: str | None
    name: str | None
    arguments: str

    @staticmethod
    def whole(index: int, call: ToolCall) -> list[ToolCallDelta]:
        """A complete call as deltas: the header, then all of its arguments."""
        return [ToolCallDelta(index, call.id, call.name, ""), ToolCallDelta(index, None, None, call.arguments)]


@dataclass(frozen=True)
class ToolCallDeltaEvent:
    """Tool-call pieces as they are parsed, for streaming."""

    deltas: list[ToolCallDelta]


@dataclass(frozen=True)
class ToolCallsEvent:
    """Every tool call of the reply, once, at the end (after the last ToolCallDeltaEvent)."""

    calls: list[ToolCall]


Event = ContentEvent | ReasoningEvent | ToolCallDeltaEvent | ToolCallsEvent


def _partial_suffix_len(text: str, patterns: Iterable[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some pattern."""
    longest = 0
    for pattern in patterns:
        for n in range(min(len(pattern) - 1, len(text)), longest, -1):
            if text.endswith(pattern[:n]):
                longest = n
                break
    return longest


class Detokenizer:
    """Token ids -> text, incrementally, on bytes.

    Byte-level BPE and byte-fallback vocabularies split multi-byte characters across
    tokens, so decoding token by token would emit U+FFFD halves. This decodes the byte
    stream instead: push() returns only complete characters and holds an incomplete
    UTF-8 tail until the next token completes it. The concatenated output equals
    b"".join(bytes of every kept token).decode("utf-8", errors="replace").
    """

    def __init__(self, token_bytes: Callable[[int], bytes] | Sequence[bytes],
                 special_ids: frozenset[int], skip_special_tokens: bool = True):
        self._token_bytes = token_bytes if callable(token_bytes) else token_bytes.__getitem__
        self._skipped = special_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id in self._skipped:
            return ""
        return self._decoder.decode(self._token_bytes(token_id))

    def flush(self) -> str:
        """At the end of generation: an incomplete tail, decoded as U+FFFD."""
        return self._decoder.decode(b"", final=True)


class TokenRouter(Protocol):
    """Turns token ids into content text, withholding what belongs elsewhere.

    The seam for tool-call parsers: a parser-aware router keeps tool-call markup out of
    the content and reports the parsed calls at the end.
    """

    def push(self, token_id: int) -> str:
        """Content text released by this token."""

    def flush(self) -> str:
        """Content text still held, at the end of generation."""

    def take_reasoning(self) -> str:
        """Reasoning text the router found since the last call (and forgets it)."""

    def tool_calls(self) -> list[ToolCall]:
        """The tool calls parsed so far."""

    def take_tool_deltas(self) -> list[ToolCallDelta]:
        """The tool-call deltas parsed since the last call (and forgets them).

        Optional: the sink streams each call that no delta announced whole at the end.
        """


class PlainRouter:
    """A TokenRouter with no tool-call parsing: all text is content."""

    def __init__(self, detokenizer: Detokenizer):
        self._detokenizer = detokenizer

    def push(self, token_id: int) -> str:
        return self._detokenizer.push(token_id)

    def flush(self) -> str:
        return self._detokenizer.flush()

    def take_reasoning(self) -> str:
        return ""

    def tool_calls(self) -> list[ToolCall]:
        return []

    def take_tool_deltas(self) -> list[ToolCallDelta]:
        return []


class StopMatcher:
    """Cuts the text at the first stop string.

    Rule: the occurrence that starts earliest in the text wins; between stop strings
    that start at the same place, the shortest (it completes first). push() releases the
    text that can no longer be part of a stop string and holds back the rest: the
    longest tail that is a prefix of some stop string, and, when a match is found while
    an earlier-starting partial match is still open, everything from that earlier start
    until it resolves. On a match it releases the text before the stop string (plus the
    stop string with include_stop_str_in_output), sets `stopped` and `matched`, and
    ignores all later text. Empty stop strings are ignored.
    """

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False):
        self._stops = sorted({s for s in stops if s}, key=len)
        self._include = include_stop_str_in_output
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self._stops:
            return text
        text = self._held + text
        start, stop = self._first_match(text)
        held_from = len(text) - _partial_suffix_len(text, self._stops)
        # A match is final unless a stop string that starts earlier may still complete.
        if stop is not None and start <= held_from:
            return self._stop_at(text, start, stop)
        self._held = text[held_from:]
        return text[:held_from]

    def flush(self) -> str:
        """At the end of generation: the held text, cut at a stop string it holds."""
        if self.stopped:
            return ""
        text, self._held = self._held, ""
        start, stop = self._first_match(text)
        if stop is not None:
            return self._stop_at(text, start, stop)
        return text

    def _first_match(self, text: str) -> tuple[int, str | None]:
        best_start, best = len(text), None
        for stop in self._stops:  # shortest first: ties keep the shortest
            start = text.find(stop)
            if start != -1 and start < best_start:
                best_start, best = start, stop
        return best_start, best

    def _stop_at(self, text: str, start: int, stop: str) -> str:
        self.stopped, self.matched, self._held = True, stop, ""
        return text[:start] + (stop if self._include else "")


class ThinkingSplitter:
    """Splits text into content and reasoning at <think> ... </think>.

    One reasoning block: content until the open tag (or from the start with
    start_in_reasoning, when the chat template opened the block in the prompt),
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

    def push(self, text: str) -> tuple[str, str]:
        if not self._enabled:
            return text, ""
        content, reasoning = [], []
        text, self._held = self._held + text, ""
        while text and not self._closed:
            tag = self._close_tag if self._in_reasoning else self._open_tag
            out = reasoning if self._in_reasoning else content
            at = text.find(tag)
            if at == -1:
                keep = _partial_suffix_len(text, (tag,))
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


@dataclass
class SinkResult:
    events: list[Event]  # the events of finish() itself, not repeated from push()
    content: str  # totals over the whole generation
    reasoning: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    stopped: bool = False
    stop_string: str | None = None


class CompletionSink:
    """Generated token ids -> content / reasoning / tool-call events for one completion.

    Chat uses a tool-aware router, the stop matcher and a thinking splitter; text
    completions use a PlainRouter, a disabled splitter and collect_tool_calls=False.
    Once `done` (a stop string matched, or the last tool call allowed was parsed), the caller
    should end generation; tokens pushed after that are ignored.
    """

    def __init__(self, router: TokenRouter, stopper: StopMatcher, thinking: ThinkingSplitter,
                 collect_tool_calls: bool):
        self._router = router
        self._stopper = stopper
        self._thinking = thinking
        self._collect_tool_calls = collect_tool_calls
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._announced_calls = 0  # calls whose first delta has been emitted

    @property
    def stopped(self) -> bool:
        """A stop string matched."""
        return self._stopper.stopped

    @property
    def done(self) -> bool:
        """Generation should end: a stop string matched, or the router took the last tool call
        it may (parallel_tool_calls: false)."""
        return self._stopper.stopped or getattr(self._router, "closed", False)

    def push(self, token_id: int) -> list[Event]:
        if self.done:
            return []
        events: list[Event] = []
        text = self._router.push(token_id)
        self._emit_reasoning(events, self._router.take_reasoning())
        self._emit(events, self._thinking.push(self._stopper.push(text)))
        self._emit_tool_deltas(events)
        return events

    def finish(self) -> SinkResult:
        events: list[Event] = []
        if not self._stopper.stopped:
            text = self._router.flush()
            self._emit_reasoning(events, self._router.take_reasoning())
            tail = self._stopper.push(text)
            if not self._stopper.stopped:
                tail += self._stopper.flush()
            self._emit(events, self._thinking.push(tail))
        self._emit(events, self._thinking.flush())
        self._emit_tool_deltas(events)
        tool_calls = self._router.tool_calls() if self._collect_tool_calls else []
        if tool_calls:
            if len(tool_calls) > self._announced_calls:  # a router that does not stream deltas
                events.append(ToolCallDeltaEvent([
                    delta for k in range(self._announced_calls, len(tool_calls))
                    for delta in ToolCallDelta.whole(k, tool_calls[k])]))
            events.append(ToolCallsEvent(tool_calls))
        return SinkResult(events=events, content="".join(self._content),
                          reasoning="".join(self._reasoning), tool_calls=tool_calls,
                          stopped=self._stopper.stopped, stop_string=self._stopper.matched)

    def _emit(self, events: list[Event], parts: tuple[str, str]) -> None:
        content, reasoning = parts
        self._emit_reasoning(events, reasoning)
        if content:
            self._content.append(content)
            events.append(ContentEvent(content))

    def _emit_tool_deltas(self, events: list[Event]) -> None:
        take = getattr(self._router, "take_tool_deltas", None)  # optional, see TokenRouter
        if not self._collect_tool_calls or take is None:
            return
        deltas = take()
        if deltas:
            self._announced_calls = max(self._announced_calls, max(d.index for d in deltas) + 1)
            events.append(ToolCallDeltaEvent(deltas))

    def _emit_reasoning(self, events: list[Event], text: str) -> None:
        if text:
            self._reasoning.append(text)
            events.append(ReasoningEvent(text))
