"""OfflineRun: sequences on a synchronous EngineCore, each through its own OutputPipeline.

The driver of LLM.generate / LLM.chat and `tallow generate`: it steps the engine until every
sequence it was given has finished, feeds each output to its sequence's pipeline, and aborts a
sequence as soon as its pipeline is done (a stop string matched).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

from tallow.engine.request import Sequence
from tallow.output.events import Event
from tallow.output.pipeline import OutputPipeline
from tallow.output.sink import CompletionSink


class OfflineRun:
    def __init__(self, core):
        """core: an EngineCore (step, add, abort, has_work)."""
        self.core = core
        self._pending: dict[int, OutputPipeline] = {}

    def add(self, seq: Sequence, sink: CompletionSink) -> OutputPipeline:
        """Queue seq on the engine; its outputs go through `sink`."""
        pipeline = OutputPipeline(sink, partial(self.core.abort, seq))
        self._pending[seq.seq_id] = pipeline
        self.core.add(seq)
        return pipeline

    def outputs(self) -> Iterator[tuple[Sequence, object, list[Event]]]:
        """Step until every added sequence has finished: (sequence, its TokenOutput, the events
        its pipeline made of it) for each output, as the steps give them. The pipeline's `taken`
        says how many of the output's tokens it consumed."""
        core, pending = self.core, self._pending
        while pending:
            for seq, out in core.step():
                pipeline = pending.get(seq.seq_id)
                if pipeline is None:
                    continue
                events = pipeline.feed(out)
                if pipeline.finished:
                    del pending[seq.seq_id]
                yield seq, out, events
            if pending and not core.has_work():
                raise RuntimeError("engine idle with unfinished sequences")
