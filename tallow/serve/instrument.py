"""The engine and the executor as the server sees them: the same API, observed.

InstrumentedEngine wraps each engine stream to time its tokens (TTFT, inter-token latency,
queue time, end-to-end latency, token counts) into the metrics, the current request's
record and its trace; MeteredExecutor wraps each run to count how its choices finished, or
that its client went away, or that it failed. Every protocol route goes through them, so
none has metrics code of its own. Metrics cost a counter and a histogram update per engine
output; traces cost nothing unless a request asks for one.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

from tallow.serve.access_log import RequestRecord, current_request
from tallow.serve.executor import CompletionAborted, CompletionExecutor
from tallow.serve.metrics import ServerMetrics
from tallow.serve.trace import RequestTrace, SequenceTrace


class InstrumentedEngine:
    """`engine` with submit() instrumented; every other attribute is the engine's own."""

    def __init__(self, engine, metrics: ServerMetrics):
        self._engine = engine
        self._metrics = metrics
        # Only the real engine can log prefill chunks for traces.
        self._traces_prefill = _accepts_trace_prefill(engine)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    @property
    def chat_template(self):
        template = self._engine.chat_template
        trace = _current_trace()
        return template if trace is None else TimedTemplate(template, trace)

    @property
    def tokenizer(self):
        tokenizer = self._engine.tokenizer
        trace = _current_trace()
        return tokenizer if trace is None else TimedTokenizer(tokenizer, trace)

    def submit(self, prompt_ids: list[int], params, request_id: str | None = None) -> list:
        record = current_request.get()
        trace = record.trace if record is not None else None
        if trace is not None and self._traces_prefill:
            streams = self._engine.submit(prompt_ids, params, request_id, trace_prefill=True)
        else:
            streams = self._engine.submit(prompt_ids, params, request_id)
        metrics = self._metrics
        metrics.prompt_tokens.labels(metrics.model_name).inc(len(prompt_ids))
        if record is not None:
            record.prompt_tokens += len(prompt_ids)
        arrival = record.start if record is not None else time.monotonic()
        return [MeteredStream(stream, metrics, record, arrival,
                              None if trace is None else trace.sequence(getattr(stream, "request_id", "")))
                for stream in streams]

    def generate(self, prompt_ids: list[int], params, request_id: str | None = None):
        return self.submit(prompt_ids, params, request_id)[0]


def _accepts_trace_prefill(engine) -> bool:
    from tallow.engine.async_engine import AsyncEngine

    return isinstance(engine, AsyncEngine)


def _current_trace() -> RequestTrace | None:
    record = current_request.get()
    return None if record is None else record.trace


class MeteredStream:
    """An engine stream (async iterator of TokenOutputs, abort()) whose tokens are timed."""

    def __init__(self, stream, metrics: ServerMetrics, record: RequestRecord | None, arrival: float,
                 trace: SequenceTrace | None):
        self._stream = stream
        self._metrics = metrics
        self._record = record
        self._arrival = arrival
        self._trace = trace
        self._last: float | None = None  # when the previous token came
        self._ended = False
        # the model's children of the per-token metrics, looked up once (labels() per token was
        # a tuple, a lock and a dict lookup each)
        self._generation_tokens = metrics.generation_tokens.labels(metrics.model_name)
        self._itl = metrics.itl.labels(metrics.model_name)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def __aiter__(self):
        return self

    async def __anext__(self):
        out = await self._stream.__anext__()
        now = time.monotonic()
        if out.token_ids:
            n = len(out.token_ids)
            self._generation_tokens.inc(n)
            if self._last is None:
                self._first_token(now)
            else:
                self._itl.observe(now - self._last)
            self._last = now
            if self._record is not None:
                self._record.completion_tokens += n
            if self._trace is not None:
                self._trace.tokens += n
        if out.finish_reason is not None:
            self._end(now, out.finish_reason)
        return out

    def abort(self) -> None:
        self._stream.abort()
        self._end(time.monotonic(), "abort")

    async def aclose(self) -> None:
        self.abort()

    def _first_token(self, now: float) -> None:
        metrics, label = self._metrics, self._metrics.model_name
        metrics.ttft.labels(label).observe(now - self._arrival)
        seq = getattr(self._stream, "seq", None)  # the real engine's Sequence: engine-side times
        if seq is not None and seq.first_scheduled_time is not None:
            metrics.queue_time.labels(label).observe(seq.first_scheduled_time - seq.arrival_time)
        record = self._record
        if record is not None and record.first_token is None:
            record.first_token = now
        if self._trace is not None:
            self._trace.first_token = now
            if seq is not None:
                self._trace.scheduled = seq.first_scheduled_time

    def _end(self, now: float, reason: str) -> None:
        if self._ended:
            return
        self._ended = True
        self._metrics.e2e.labels(self._metrics.model_name).observe(now - self._arrival)
        trace = self._trace
        if trace is not None:
            trace.finish, trace.engine_finish = now, reason
            trace.prefill_chunks = list(getattr(self._stream, "prefill_chunks", None) or [])


class TimedTemplate:
    """A chat template whose render() marks the end of parsing and of templating."""

    def __init__(self, template, trace: RequestTrace):
        self._template = template
        self._trace = trace

    def __getattr__(self, name: str):
        return getattr(self._template, name)

    def render(self, *args, **kwargs) -> str:
        self._trace.mark("parse")
        text = self._template.render(*args, **kwargs)
        self._trace.mark("template")
        return text


class TimedTokenizer:
    """A tokenizer whose encode() marks the end of parsing and of tokenizing."""

    def __init__(self, tokenizer, trace: RequestTrace):
        self._tokenizer = tokenizer
        self._trace = trace

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def encode(self, *args, **kwargs) -> list[int]:
        self._trace.mark("parse")
        ids = self._tokenizer.encode(*args, **kwargs)
        self._trace.mark("tokenize")
        return ids


class MeteredExecutor(CompletionExecutor):
    """CompletionExecutor whose runs report how they ended."""

    def __init__(self, engine, metrics: ServerMetrics):
        super().__init__(engine)
        self.metrics = metrics

    def start(self, plan, request_id: str):
        return MeteredRun(super().start(plan, request_id), self.metrics, current_request.get())


class MeteredRun:
    """A CompletionRun whose updates() count finished choices, aborts and failures."""

    def __init__(self, run, metrics: ServerMetrics, record: RequestRecord | None):
        self._run = run
        self._metrics = metrics
        self._record = record

    def __getattr__(self, name: str):
        return getattr(self._run, name)

    async def updates(self):
        metrics, label, record = self._metrics, self._metrics.model_name, self._record
        try:
            async with aclosing(self._run.updates()) as updates:
                async for update in updates:
                    if update.finish_reason is not None:
                        metrics.request_success.labels(label, update.finish_reason).inc()
                        if record is not None:
                            record.finish_reasons.append(update.finish_reason)
                    yield update
        except (CompletionAborted, asyncio.CancelledError, GeneratorExit):  # the client went away
            metrics.aborted.labels(label).inc()
            if record is not None:
                record.outcome = "aborted"
            raise
        except Exception:
            metrics.failed.labels(label).inc()
            if record is not None:
                record.outcome = "failed"
            raise
