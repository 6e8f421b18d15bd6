"""CompletionExecutor: one planned request on the engine, from submission to usage accounting.

Every protocol runs through here. A run submits each prompt (params.n sibling streams
each), feeds every stream's outputs to its own OutputPipeline (tallow.output: the sink, and
the engine stream aborted as soon as a stop string matches), gathers logprobs, keeps a live
Usage and reports to the request's RequestStats (instrument.py) when given one. Updates from
all choices arrive on one async iterator in the order they are produced; leaving that
iterator early (a client that went away, a cancelled task) aborts every stream at once.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from tallow.errors import TallowError
from tallow.output.events import ContentEvent, Event, ReasoningEvent, ToolCall, ToolCallDeltaEvent
from tallow.output.pipeline import OutputPipeline, make_sink
from tallow.serve.instrument import RequestStats, SequenceStats
from tallow.serve.plan import RequestPlan


class CompletionAborted(Exception):
    """The run was aborted (its client went away) before it finished."""


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Output tokens a grammar forced and the engine appended without sampling them (jump-forward,
    # the seed's usage.fill); reported only when not 0. Counted in completion_tokens too.
    fill: int = 0
    # Speculative decoding: {"proposed": draft tokens verified, "accepted": of those, accepted}
    # over the request's sequences; None when none of them speculated.
    speculation: dict[str, int] | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add_speculation(self, proposed: int, accepted: int) -> None:
        if self.speculation is None:
            self.speculation = {"proposed": 0, "accepted": 0}
        self.speculation["proposed"] += proposed
        self.speculation["accepted"] += accepted

    def to_openai(self) -> dict:
        body = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.fill:
            body["fill"] = self.fill
        if self.speculation is not None:
            body["speculation"] = dict(self.speculation)
        return body


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # sorted by logprob, best first; empty unless top-k was asked


@dataclass
class ChoiceUpdate:
    """New events of one choice, with the logprobs of the tokens consumed since its last update."""

    index: int
    events: list[Event]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None  # set on the choice's last update
    stop_string: str | None = None  # on the last update: the stop string that ended the choice
    # On the choice's first update, when the request asked for them: the PromptLogprobs of prompt
    # tokens 1.. (tallow/engine/prompt_logprobs.py).
    prompt_logprobs: list | None = None


@dataclass
class ChoiceResult:
    index: int
    content: str
    reasoning: str
    tool_calls: list[ToolCall]
    finish_reason: str  # "tool_calls" > "stop" > "length"; "abort" when cut off
    logprobs: list[TokenLogprob] | None
    stop_string: str | None = None  # the stop string that ended it, if one did
    prompt_logprobs: list | None = None  # PromptLogprobs of prompt tokens 1.., when asked
    # The reply in the order it was generated, as a stream shows it: ["text", start, end] and
    # ["reasoning", start, end] (a span of content / reasoning; consecutive pieces of a kind
    # joined) and ["call", index into tool_calls, None].
    segments: list[list] = field(default_factory=list)


def ordered_segments(choice: ChoiceResult) -> list[tuple[str, Any]]:
    """The choice in the order generated: ("text", str), ("reasoning", str), ("call", index); for a
    result made without segments, reasoning, text, then the calls."""
    if not choice.segments:
        return ([("reasoning", choice.reasoning)] if choice.reasoning else []) + \
            ([("text", choice.content)] if choice.content else []) + [("call", k) for k in range(len(choice.tool_calls))]
    texts = {"text": choice.content, "reasoning": choice.reasoning}
    return [(kind, a if kind == "call" else texts[kind][a:b]) for kind, a, b in choice.segments]


def add_segments(segments: list[list], events) -> None:
    """Extend a ChoiceResult's segments by a pipeline's events (offsets only: no text is copied)."""
    for ev in events:
        if isinstance(ev, (ContentEvent, ReasoningEvent)):
            kind = "text" if isinstance(ev, ContentEvent) else "reasoning"
            if segments and segments[-1][0] == kind:
                segments[-1][2] += len(ev.text)
            else:  # starts where this kind's last span ended
                start = next((s[2] for s in reversed(segments) if s[0] == kind), 0)
                segments.append([kind, start, start + len(ev.text)])
        elif isinstance(ev, ToolCallDeltaEvent):
            segments += [["call", d.index, None] for d in ev.deltas if d.id is not None]


@dataclass
class CompletionSummary:
    choices: list[ChoiceResult]
    usage: Usage


@dataclass
class CompletionRun:
    """One request in flight. Iterate `updates()` once; `usage` is kept current throughout.

    With `stats`, the run reports its sequences' tokens, its finished choices and how it ended."""

    engine: object
    plan: RequestPlan
    request_id: str
    stats: RequestStats | None = None
    trace_prefill: bool = False  # submit with the engine's trace_prefill (a traced request, a real engine)
    usage: Usage = field(init=False)
    results: dict[int, ChoiceResult] = field(init=False, default_factory=dict)
    _streams: list = field(init=False, default_factory=list)
    _sequence_stats: list[SequenceStats | None] = field(init=False, default_factory=list)
    _pumps: list[asyncio.Task] = field(init=False, default_factory=list)
    _queue: asyncio.Queue = field(init=False, default_factory=asyncio.Queue)
    _aborted: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.usage = Usage(prompt_tokens=sum(len(ids) for ids in self.plan.prompts))

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Every choice's updates as they come; raises CompletionAborted after abort()."""
        stats = self.stats
        try:
            self._submit()
            if len(self._streams) == 1:
                # One choice (the common case): consumed right here, without a task or a queue
                # between the engine stream and the caller: each token wakes one task, not two.
                async with aclosing(self._choice_updates(0, self._streams[0], True)) as updates:
                    async for update in updates:
                        if self._aborted:
                            break
                        if update.finish_reason is not None and stats is not None:
                            stats.finished(update.finish_reason)
                        yield update
                if self._aborted:
                    raise CompletionAborted()
                return
            queue = self._queue
            n = self.plan.params.n
            for k, stream in enumerate(self._streams):
                self._pumps.append(asyncio.create_task(self._pump(k, stream, k % n == 0, queue)))
            unfinished = len(self._pumps)
            while unfinished:
                update = await queue.get()
                if isinstance(update, BaseException):
                    raise update
                if update.finish_reason is not None:
                    unfinished -= 1
                    if stats is not None:
                        stats.finished(update.finish_reason)
                yield update
        except (CompletionAborted, asyncio.CancelledError, GeneratorExit):  # the client went away
            if stats is not None:
                stats.aborted()
            raise
        except Exception:
            if stats is not None:
                stats.failed()
            raise
        finally:
            self.abort()

    def _submit(self) -> None:
        """Submit every prompt: params.n sibling streams each, choice p * n + j at _streams[p * n + j]."""
        for p, prompt_ids in enumerate(self.plan.prompts):
            request_id = self.request_id if len(self.plan.prompts) == 1 else f"{self.request_id}-{p}"
            if self.trace_prefill:
                streams = self.engine.submit(prompt_ids, self.plan.params_for(p), request_id, trace_prefill=True)
            else:
                streams = self.engine.submit(prompt_ids, self.plan.params_for(p), request_id)
            self._streams += streams
            self._sequence_stats += (self.stats.submitted(prompt_ids, streams) if self.stats is not None
                                     else [None] * len(streams))

    def abort(self) -> None:
        """Stop at once: abort every engine stream and end updates() (idempotent; needs no await).
        An aborted engine stream ends its iteration at once, which ends a single choice's
        updates(); with several choices the queue's CompletionAborted ends them."""
        self._aborted = True
        for stream, stats in zip(self._streams, self._sequence_stats):
            stream.abort()
            if stats is not None:
                stats.end("abort")
        for pump in self._pumps:
            pump.cancel()
        self._queue.put_nowait(CompletionAborted())

    def summary(self) -> CompletionSummary:
        return CompletionSummary([self.results[i] for i in sorted(self.results)], self.usage)

    async def _pump(self, index: int, stream, counts_cached: bool, queue: asyncio.Queue) -> None:
        try:
            async with aclosing(self._choice_updates(index, stream, counts_cached)) as updates:
                async for update in updates:
                    queue.put_nowait(update)
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait(e)

    async def _choice_updates(self, index: int, stream, counts_cached: bool) -> AsyncIterator[ChoiceUpdate]:
        """One choice's updates: its engine stream through its output pipeline; the last carries
        finish_reason."""
        plan = self.plan
        pipeline = OutputPipeline(
            make_sink(self.engine.tokenizer, plan.params, tool_parser=plan.tool_parser, tools=plan.tools,
                      reasoning_parser=plan.reasoning_parser, prompt_text=plan.prompt_text,
                      split_reasoning=plan.split_reasoning, max_tool_calls=plan.max_tool_calls),
            stream.abort)
        want_logprobs = plan.params.logprobs is not None
        all_logprobs: list[TokenLogprob] = []
        pending: list[TokenLogprob] = []
        first = True
        usage = self.usage
        stats = self._sequence_stats[index]
        filled = 0  # the sequence's jump-forward tokens counted so far (TokenOutput.fill is a running total)
        prompt_logprobs = unsent_prompt_logprobs = None
        engine_finish = None
        failure = None  # why the request's own input failed it (TokenOutput.error)
        segments: list[list] = []
        async for out in stream:
            failure = out.error or failure
            if stats is not None:
                stats.output(out)
            if first and counts_cached:
                usage.cached_tokens += out.num_cached_tokens
            first = False
            if out.fill != filled:
                usage.fill += out.fill - filled
                filled = out.fill
            if out.speculation is not None:
                usage.add_speculation(*out.speculation)
            if out.prompt_logprobs is not None:
                prompt_logprobs = unsent_prompt_logprobs = out.prompt_logprobs
            if plan.score_only:  # the one token computed for it is dropped: no text, no usage
                engine_finish = out.finish_reason or engine_finish
                continue
            events = pipeline.feed(out)
            taken = pipeline.taken
            usage.completion_tokens += taken
            if want_logprobs:
                for k in range(taken):
                    top = out.top_logprobs[k] if out.top_logprobs else []
                    pending.append(TokenLogprob(out.token_ids[k], out.logprobs[k], top))
            if events:
                add_segments(segments, events)
                update = ChoiceUpdate(index, events, pending, prompt_logprobs=unsent_prompt_logprobs)
                unsent_prompt_logprobs = None
                all_logprobs += pending
                pending = []
                yield update
            if pipeline.done:  # the pipeline aborted the stream
                if stats is not None:
                    stats.end("abort")
                break
        if (engine_finish if plan.score_only else pipeline.engine_finish) == "error":
            if failure is not None:  # the request's grammar (structured output, forced tool calls)
                raise TallowError(f"the request cannot be served: {failure}; simplify the schema, "
                                  "grammar or choices", status=400)
            raise TallowError(f"the engine failed while generating request {self.request_id}", status=500,
                              type="server_error")
        if plan.score_only:
            reason = "abort" if engine_finish == "abort" else "length"
            self.results[index] = ChoiceResult(index, "", "", [], reason, [] if want_logprobs else None, None,
                                               prompt_logprobs)
            yield ChoiceUpdate(index, [], [], reason, None, unsent_prompt_logprobs)
            return
        result, reason = pipeline.finish()
        all_logprobs += pending
        add_segments(segments, result.events)
        self.results[index] = ChoiceResult(index, result.content, result.reasoning, result.tool_calls, reason,
                                           all_logprobs if want_logprobs else None, result.stop_string,
                                           prompt_logprobs, segments)
        yield ChoiceUpdate(index, result.events, pending, reason, result.stop_string, unsent_prompt_logprobs)


class CompletionExecutor:
    """Runs planned requests on one engine; every protocol shares it."""

    def __init__(self, engine):
        self.engine = engine
        # Only an engine whose submit() takes trace_prefill (the real one) logs prefill chunks.
        self._logs_prefill = "trace_prefill" in inspect.signature(engine.submit).parameters

    def start(self, plan: RequestPlan, request_id: str, stats: RequestStats | None = None) -> CompletionRun:
        """A run for streaming: iterate its `updates()`; nothing is submitted before that. `stats`
        receives the run's statistics."""
        traced = stats is not None and stats.trace is not None
        return CompletionRun(self.engine, plan, request_id, stats, traced and self._logs_prefill)

    async def run(self, plan: RequestPlan, request_id: str) -> CompletionSummary:
        """Run to the end and return the whole result (the non-streaming path)."""
        run = self.start(plan, request_id)
        async for _ in run.updates():
            pass
        return run.summary()
