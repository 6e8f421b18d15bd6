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

from dataclasses import dataclass, field
from typing import Protocol

from tallow.output.detokenizer import Detokenizer
from tallow.output.events import (ContentEvent, Event, ReasoningEvent, ToolCall, ToolCallDelta,
                                  ToolCallDeltaEvent, ToolCallsEvent)
from tallow.output.stop import StopMatcher
from tallow.output.thinking import ThinkingSplitter


class TokenRouter(Protocol):
    """Turns token ids into content text, withholding what belongs elsewhere.

    The seam for tool-call parsers: a parser-aware router keeps tool-call markup out of
    the content and reports the parsed calls at the end.
    """

    def push(self, token_id: int) -> str:
        """Content text released by this token."""

    def flush(self, cut: bool = False) -> str:
        """Content text still held, at the end of generation (cut: the token limit ended it)."""

    def take_reasoning(self) -> str:
        """Reasoning text the router found since the last call (and forgets it)."""

    def tool_calls(self) -> list[ToolCall]:
        """The tool calls parsed so far."""

    def take_tool_deltas(self) -> list[ToolCallDelta]:
        """The tool-call deltas parsed since the last call (and forgets them).

        Optional: the sink streams each call that no delta announced whole at the end. A router
        may instead offer take_placed_tool_deltas() -> [(offset, delta)]: each delta placed
        after the first `offset` characters of the text the last push/flush released.
        """


class PlainRouter:
    """A TokenRouter with no tool-call parsing: all text is content."""

    def __init__(self, detokenizer: Detokenizer):
        self._detokenizer = detokenizer

    def push(self, token_id: int) -> str:
        return self._detokenizer.push(token_id)

    def flush(self, cut: bool = False) -> str:
        return self._detokenizer.flush()

    def take_reasoning(self) -> str:
        return ""

    def tool_calls(self) -> list[ToolCall]:
        return []

    def take_tool_deltas(self) -> list[ToolCallDelta]:
        return []


@dataclass
class SinkResult:
    events: list[Event]  # the events of finish() itself, not repeated from push()
    content: str  # totals over the whole generation
    reasoning: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    stopped: bool = False
    stop_string: str | None = None
    # A call was announced while it streamed, then its markup broke off (generation cut, bad
    # JSON): its arguments are the JSON certain so far, completed.
    tool_call_repaired: bool = False


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
        self._emit_in_order(events, text, final=False)
        return events

    def finish(self, cut: bool = False) -> SinkResult:
        """The last events and the totals; cut: the token limit ended generation (a tool call's
        markup it cut short is dropped, not returned as content)."""
        events: list[Event] = []
        if not self._stopper.stopped:
            text = self._router.flush(cut)
            self._emit_reasoning(events, self._router.take_reasoning())
            self._emit_in_order(events, text, final=True)
        self._emit(events, self._thinking.flush())
        self._emit_tool_deltas(events, [delta for _, delta in self._take_placed_deltas(0)])
        tool_calls = self._router.tool_calls() if self._collect_tool_calls else []
        if tool_calls:
            if len(tool_calls) > self._announced_calls:  # a router that does not stream deltas
                events.append(ToolCallDeltaEvent([
                    delta for k in range(self._announced_calls, len(tool_calls))
                    for delta in ToolCallDelta.whole(k, tool_calls[k])]))
            events.append(ToolCallsEvent(tool_calls))
        return SinkResult(events=events, content="".join(self._content),
                          reasoning="".join(self._reasoning), tool_calls=tool_calls,
                          stopped=self._stopper.stopped, stop_string=self._stopper.matched,
                          tool_call_repaired=bool(tool_calls) and getattr(self._router, "repaired", False))

    def _emit(self, events: list[Event], parts: tuple[str, str]) -> None:
        content, reasoning = parts
        self._emit_reasoning(events, reasoning)
        if content:
            self._content.append(content)
            events.append(ContentEvent(content))

    def _emit_in_order(self, events: list[Event], text: str, final: bool) -> None:
        """The router's text through the stop matcher and the thinking splitter, with its tool-call
        deltas where they fall in it. Before a call's deltas, the stop matcher lets go of the text it
        holds: a stop string does not span a tool call, and the text before the call stays before
        it on the wire (so does the thinking splitter: a tag does not span a call either)."""
        placed = self._take_placed_deltas(len(text))
        at = 0
        while placed and not self._stopper.stopped:
            offset = placed[0][0]
            deltas = [delta for where, delta in placed if where == offset]
            placed = placed[len(deltas):]
            tail = self._stopper.push(text[at:offset])
            if not self._stopper.stopped:
                tail += self._stopper.flush()
            self._emit(events, self._thinking.push(tail))
            if not self._stopper.stopped:
                self._emit(events, self._thinking.flush())  # a tail held as a possible tag: text
                self._emit_tool_deltas(events, deltas)
            at = offset
        if self._stopper.stopped:
            return
        tail = self._stopper.push(text[at:])
        if final and not self._stopper.stopped:
            tail += self._stopper.flush()
        self._emit(events, self._thinking.push(tail))

    def _take_placed_deltas(self, end: int) -> list[tuple[int, ToolCallDelta]]:
        """The router's deltas with their offsets; a router that does not place them: at `end`."""
        if not self._collect_tool_calls:
            return []
        take = getattr(self._router, "take_placed_tool_deltas", None)  # optional, see TokenRouter
        if take is not None:
            return take()
        take = getattr(self._router, "take_tool_deltas", None)
        return [(end, delta) for delta in take()] if take is not None else []

    def _emit_tool_deltas(self, events: list[Event], deltas: list[ToolCallDelta]) -> None:
        if deltas:
            self._announced_calls = max(self._announced_calls, max(d.index for d in deltas) + 1)
            events.append(ToolCallDeltaEvent(deltas))

    def _emit_reasoning(self, events: list[Event], text: str) -> None:
        if text:
            self._reasoning.append(text)
            events.append(ReasoningEvent(text))
