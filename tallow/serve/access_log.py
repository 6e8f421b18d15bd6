"""The record of one HTTP request, filled in as it runs, and its one access-log line.

The request gate (gate.py) makes a RequestRecord for every request and sets it as
`current_request` for the request's task (asyncio tasks and `asyncio.to_thread` copy the
context). The route hands it to the run's RequestStats (instrument.py), which fills in tokens
and finish reasons; the plan's steps mark their phases in its trace (mark_phase).
"""

from __future__ import annotations

import logging
import re
from contextvars import ContextVar
from dataclasses import dataclass, field

from tallow.serve.trace import RequestTrace

access_log = logging.getLogger("tallow.access")

# Characters that could forge or garble a log line: controls (newline, ESC of ANSI sequences,
# C1 controls), spaces (fields are space separated), the backslash of the escapes themselves,
# and Unicode line and paragraph separators.
_UNSAFE = re.compile(r"[\x00-\x20\x7f-\xa0\\\u2028\u2029]")


def escape_field(text: str) -> str:
    """`text` as one log field: unsafe characters written as \\xNN / \\uNNNN escapes."""
    return _UNSAFE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


@dataclass
class RequestRecord:
    request_id: str
    method: str
    route: str
    start: float  # time.monotonic() on arrival
    trace: RequestTrace | None = None
    status: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token: float | None = None  # monotonic time of the first generated token
    finish_reasons: list[str] = field(default_factory=list)  # one per finished choice
    outcome: str | None = None  # "aborted" (the client left) | "failed" (an error midway)

    def line(self, end: float) -> str:
        ttft = "-" if self.first_token is None else f"{(self.first_token - self.start) * 1000:.1f}"
        finish = ",".join(self.finish_reasons) or "-"
        if self.outcome:
            finish = f"{finish}({self.outcome})" if self.finish_reasons else self.outcome
        return (f"{escape_field(self.request_id)} {escape_field(self.method)} {escape_field(self.route)} "
                f"{self.status or '-'} "
                f"prompt_tokens={self.prompt_tokens} completion_tokens={self.completion_tokens} "
                f"ttft_ms={ttft} duration_ms={(end - self.start) * 1000:.1f} finish={finish}")


current_request: ContextVar[RequestRecord | None] = ContextVar("tallow_request", default=None)


def mark_phase(phase: str) -> None:
    """Mark the end of `phase` in the current request's trace, if it is traced."""
    record = current_request.get()
    if record is not None and record.trace is not None:
        record.trace.mark(phase)
