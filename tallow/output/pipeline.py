"""OutputPipeline: one choice's engine outputs -> events, and when and why its generation ends.

The per-choice path every front end shares (LLM.generate / LLM.chat, `tallow generate`, the
server's CompletionExecutor):

    engine output (token ids, finish_reason) -> CompletionSink -> events
    the sink is done (a stop string matched, or the last tool call allowed was parsed)
        -> the engine's sequence is aborted; the caller stops reading it
    at the end: finish_reason "tool_calls" > "stop" (a stop string) > the engine's own reason

Only the way outputs arrive differs: the server reads an AsyncEngine's RequestStream in the
response's task; LLM and `tallow generate` step an EngineCore (see offline.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tallow.engine.sampling import SamplingParams
from tallow.output.detokenizer import Detokenizer
from tallow.output.events import Event
from tallow.output.reasoning import REASONING_PARSERS, make_thinking_splitter
from tallow.output.sink import CompletionSink, PlainRouter, SinkResult
from tallow.output.stop import StopMatcher
from tallow.output.tool_parsers import make_tool_router


def make_sink(tokenizer, params: SamplingParams, *, tool_parser: str | None = None,
              tools: list[dict[str, Any]] | None = None, reasoning_parser: str | None = None,
              prompt_text: str = "", split_reasoning: bool = False,
              max_tool_calls: int | None = None) -> CompletionSink:
    """The sink for one choice.

    params: its stop strings, include_stop_str_in_output and skip_special_tokens. tool_parser
    (a name in TOOL_PARSERS; None: no tool calls, all text is content) with the request's
    tools, whose schemas type parsed values; max_tool_calls ends generation after that many
    calls. reasoning_parser with split_reasoning splits <think> blocks out; prompt_text (the
    rendered prompt) tells whether the reply starts inside one. The defaults give plain text:
    detokenized and cut at the first stop string.
    """
    if tool_parser is not None:
        reasoning = REASONING_PARSERS.get(reasoning_parser or "none") if split_reasoning else None
        router = make_tool_router(tokenizer, tool_parser, tools=tools, reasoning=reasoning,
                                  prompt_text=prompt_text, skip_special_tokens=params.skip_special_tokens,
                                  max_calls=max_tool_calls)
    else:
        router = PlainRouter(Detokenizer(tokenizer.token_bytes, tokenizer.special_token_ids,
                                         params.skip_special_tokens))
    stopper = StopMatcher(params.stop, params.include_stop_str_in_output)
    thinking = make_thinking_splitter(reasoning_parser, prompt_text, split_reasoning)
    return CompletionSink(router, stopper, thinking, collect_tool_calls=tool_parser is not None)


class OutputPipeline:
    """One choice: feed() it the engine's outputs in order, then finish() once.

    abort: ends the engine's sequence (RequestStream.abort, or EngineCore.abort of the
    sequence); feed() calls it when the sink is done. After that the caller stops feeding.
    """

    __slots__ = ("sink", "_abort", "taken", "engine_finish")

    def __init__(self, sink: CompletionSink, abort: Callable[[], None]):
        self.sink = sink
        self._abort = abort
        self.taken = 0  # tokens of the last output fed that the sink consumed
        self.engine_finish: str | None = None  # the engine's finish_reason, unless the sink ended it

    @property
    def done(self) -> bool:
        """The sink ended generation (a stop string, or the last tool call allowed)."""
        return self.sink.done

    @property
    def finished(self) -> bool:
        """No more output will come: the sink is done or the engine finished the sequence."""
        return self.engine_finish is not None or self.sink.done

    def feed(self, out) -> list[Event]:
        """The events of one engine output (a TokenOutput). Its tokens go through the sink up to
        the one that makes the sink done (`taken` says how many); then the engine's sequence is
        aborted, and the rest of the output is dropped."""
        sink = self.sink
        events: list[Event] = []
        taken = 0
        for token_id in out.token_ids:
            taken += 1
            events += sink.push(token_id)
            if sink.done:
                self.taken = taken
                self._abort()
                return events
        self.taken = taken
        if out.finish_reason is not None:
            self.engine_finish = out.finish_reason
        return events

    def finish(self) -> tuple[SinkResult, str]:
        """The sink's final events and totals, and the choice's finish_reason: "length" when the
        engine's token limit ended it (calls made before the cut are kept; markup it cut short is
        dropped), "tool_calls" when it made calls, "stop" when a stop string ended it, else the
        engine's reason ("abort" if the engine gave none)."""
        cut = self.engine_finish == "length"
        result = self.sink.finish(cut)
        if cut and not result.stopped:
            return result, "length"  # OpenAI's: the limit was reached, calls or not
        reason = ("tool_calls" if result.tool_calls else "stop" if result.stopped
                  else self.engine_finish or "abort")
        return result, reason
