"""What the output pipeline emits: content, reasoning and tool-call events, and ToolCall."""

from __future__ import annotations

import secrets
from dataclasses import dataclass


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string

    @classmethod
    def create(cls, name: str, arguments: str, id: str | None = None) -> ToolCall:
        """A tool call with the id given or a fresh OpenAI-style one ("call_" + 24 hex digits)."""
        return cls(id=id or f"call_{secrets.token_hex(12)}", name=name, arguments=arguments)


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
