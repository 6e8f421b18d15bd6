"""SpecState: one speculating sequence's proposer index, counters and adaptive off-switch;
speculation_refusal: why a request does not speculate."""

from __future__ import annotations

from collections import deque

from tallow.engine.sampling import SamplingParams

# The adaptive off-switch: over a sequence's last WINDOW drafts, an acceptance rate (accepted /
# proposed tokens) below MIN_RATE pauses its proposals for a number of its steps that starts at
# PAUSE and doubles (up to MAX_PAUSE) each time the pause ends on a window that is still bad.
WINDOW = 4
MIN_RATE = 0.3
PAUSE = 8
MAX_PAUSE = 128


def speculation_refusal(params: SamplingParams) -> str | None:
    """Why a request with these params does not speculate (None: it may).

    - "request": it asked not to (`speculative: false`)
    - "penalties": repetition / presence / frequency penalties count tokens per position;
      the verifier does not apply them per draft position yet
    - "grammar": a grammar's masks would need a matcher advanced over the draft
    """
    if not params.speculative:
        return "request"
    if getattr(params, "grammar", None) is not None:
        return "grammar"
    if params.needs_penalties:
        return "penalties"
    return None


class SpecState:
    __slots__ = ("index", "proposed", "accepted", "num_drafts", "recent", "paused", "pause")

    def __init__(self, index: object):
        self.index = index  # the proposer's per-sequence state
        self.proposed = 0  # draft tokens verified
        self.accepted = 0  # of those, accepted
        self.num_drafts = 0
        self.recent: deque[tuple[int, int]] = deque(maxlen=WINDOW)  # (proposed, accepted) per draft
        self.paused = 0  # steps left without proposals
        self.pause = PAUSE

    def may_propose(self) -> bool:
        """Whether this step proposes (counts one paused step down otherwise)."""
        if self.paused > 0:
            self.paused -= 1
            return False
        return True

    def record(self, proposed: int, accepted: int) -> None:
        """A verified draft of `proposed` tokens of which the first `accepted` stood."""
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.num_drafts += 1
        self.recent.append((proposed, accepted))
        if len(self.recent) == WINDOW:
            total = sum(p for p, _ in self.recent)
            rate = sum(a for _, a in self.recent) / total
            if rate < MIN_RATE:
                self.paused = self.pause
                self.pause = min(self.pause * 2, MAX_PAUSE)
                self.recent.clear()
            elif rate >= 2 * MIN_RATE:
                self.pause = PAUSE
