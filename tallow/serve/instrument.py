"""Per-request statistics: what one completion adds to the metrics, its access-log record and its trace.

The route makes a RequestStats for each completion and hands it to the executor's run, which
reports to it: the engine sequences it submits (each gets a SequenceStats, told of every engine
output and of the sequence's end), each choice that finishes, and whether the run was aborted
(the client went away) or failed. Metrics cost a counter and a histogram update per engine
output; traces cost nothing unless a request asks for one. The plan's phases (parse, template,
tokenize, plan) are marked where they happen (access_log.mark_phase).
"""

from __future__ import annotations

import time

from tallow.serve.access_log import RequestRecord
from tallow.serve.metrics import ServerMetrics
from tallow.serve.trace import SequenceTrace


class RequestStats:
    """One request's statistics; `record` is its access-log record (None outside a request)."""

    def __init__(self, metrics: ServerMetrics, record: RequestRecord | None):
        self.metrics = metrics
        self.record = record
        self.trace = record.trace if record is not None else None
        self.arrival = record.start if record is not None else time.monotonic()

    def submitted(self, prompt_ids: list[int], streams: list) -> list[SequenceStats]:
        """One prompt went to the engine as `streams` (its n sibling sequences)."""
        metrics, record, trace = self.metrics, self.record, self.trace
        metrics.prompt_tokens.labels(metrics.model_name).inc(len(prompt_ids))
        if record is not None:
            record.prompt_tokens += len(prompt_ids)
        return [SequenceStats(stream, metrics, record, self.arrival,
                              None if trace is None else trace.sequence(getattr(stream, "request_id", "")))
                for stream in streams]

    def finished(self, finish_reason: str) -> None:
        """A choice finished (its last update reached the route)."""
        self.metrics.request_success.labels(self.metrics.model_name, finish_reason).inc()
        if self.record is not None:
            self.record.finish_reasons.append(finish_reason)

    def aborted(self) -> None:
        """The run ended before its end: its client went away."""
        self.metrics.aborted.labels(self.metrics.model_name).inc()
        if self.record is not None:
            self.record.outcome = "aborted"

    def failed(self) -> None:
        """The run failed with an error midway."""
        self.metrics.failed.labels(self.metrics.model_name).inc()
        if self.record is not None:
            self.record.outcome = "failed"


class SequenceStats:
    """The timing of one engine sequence's tokens: TTFT, inter-token latency, queue time,
    end-to-end latency, token counts."""

    __slots__ = ("_stream", "_metrics", "_record", "_arrival", "_trace", "_last", "_ended",
                 "_generation_tokens", "_itl")

    def __init__(self, stream, metrics: ServerMetrics, record: RequestRecord | None, arrival: float,
                 trace: SequenceTrace | None):
        self._stream = stream  # for the real engine's Sequence times and prefill chunks
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

    def output(self, out) -> None:
        """An engine output (TokenOutput) of this sequence arrived."""
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
                spec = getattr(out, "speculation", None)
                if spec is not None and spec[0]:
                    self._trace.drafts.append((now, spec[0], spec[1]))
        if out.finish_reason is not None:
            self.end(out.finish_reason, now)

    def end(self, reason: str, now: float | None = None) -> None:
        """The sequence ended (`reason`: the engine's, or "abort" when the server aborted it); once."""
        if self._ended:
            return
        self._ended = True
        now = time.monotonic() if now is None else now
        self._metrics.e2e.labels(self._metrics.model_name).observe(now - self._arrival)
        trace = self._trace
        if trace is not None:
            trace.finish, trace.engine_finish = now, reason
            trace.prefill_chunks = list(getattr(self._stream, "prefill_chunks", None) or [])

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
