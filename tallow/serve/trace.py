"""Per-request traces: where one request spent its time, as one JSON line.

A trace exists only for a request that asked for it (`x-tallow-trace: 1`) or when the server
runs with --trace; every hook checks for None first, so untraced requests pay nothing. Times
are monotonic milliseconds since the request arrived:

    {"request_id": ..., "route": ..., "status": 200, "total_ms": 812.4,
     "phases_ms": {"parse": 0.3, "template": 1.9, "tokenize": 2.2, "plan": 2.4},
     "sequences": [{"engine_id": "chatcmpl-...", "submitted": 2.6, "scheduled": 3.0,
                    "queue_wait": 0.4, "prefill_chunks": [[3.0, 0, 512], [41.7, 512, 88]],
                    "first_token": 55.0, "tokens": 64, "decode": 757.1, "finish": 812.1,
                    "engine_finish": "length", "drafts": [[60.2, 4, 3], ...]}],
     "finish_reasons": ["length"]}

A phase's mark is when it ended: parse ends when the template starts (chat) or the prompt is
tokenized (completions); plan ends when the request is validated. The engine fills
`prefill_chunks` (time, first position, tokens) when it supports it; `drafts` (time, draft
tokens proposed, accepted) is there for a sequence that speculated.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field


def _ms(start: float, t: float | None) -> float | None:
    return None if t is None else round((t - start) * 1000, 3)


@dataclass
class SequenceTrace:
    """One engine sequence of a traced request (absolute monotonic times)."""

    engine_id: str
    submitted: float
    scheduled: float | None = None
    prefill_chunks: list[tuple[float, int, int]] = field(default_factory=list)
    first_token: float | None = None
    tokens: int = 0
    finish: float | None = None
    # The engine's end: stop / length / error, or abort when the server ended it (a stop
    # string, a client gone); the request's finish_reasons are the protocol's.
    engine_finish: str | None = None
    # Speculative decoding: (time, draft tokens proposed, accepted) per engine output with a
    # verified draft: the decode phase's accepted runs. Listed only when there are any.
    drafts: list[tuple[float, int, int]] = field(default_factory=list)

    def to_dict(self, start: float) -> dict:
        wait = None if self.scheduled is None else _ms(self.submitted, self.scheduled)
        decode = None if self.first_token is None or self.finish is None else _ms(self.first_token, self.finish)
        out = {"engine_id": self.engine_id, "submitted": _ms(start, self.submitted),
               "scheduled": _ms(start, self.scheduled), "queue_wait": wait,
               "prefill_chunks": [[_ms(start, t), pos, n] for t, pos, n in self.prefill_chunks],
               "first_token": _ms(start, self.first_token), "tokens": self.tokens, "decode": decode,
               "finish": _ms(start, self.finish), "engine_finish": self.engine_finish}
        if self.drafts:
            out["drafts"] = [[_ms(start, t), proposed, accepted] for t, proposed, accepted in self.drafts]
        return out


class RequestTrace:
    """The phase marks and engine sequences of one request."""

    def __init__(self, start: float):
        self.start = start
        self.phases: dict[str, float] = {}
        self.sequences: list[SequenceTrace] = []

    def mark(self, phase: str) -> None:
        """Note that `phase` ended now (the first mark of a phase wins)."""
        self.phases.setdefault(phase, time.monotonic())

    def sequence(self, engine_id: str) -> SequenceTrace:
        seq = SequenceTrace(engine_id, time.monotonic())
        self.sequences.append(seq)
        return seq

    def to_json(self, request_id: str, route: str, status: int | None, finish_reasons: list[str],
                end: float) -> str:
        return json.dumps({
            "request_id": request_id, "route": route, "status": status, "total_ms": _ms(self.start, end),
            "phases_ms": {name: _ms(self.start, t) for name, t in self.phases.items()},
            "sequences": [s.to_dict(self.start) for s in self.sequences],
            "finish_reasons": finish_reasons,
        }, separators=(",", ":"))
