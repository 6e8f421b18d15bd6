"""SpecState: one speculating sequence's proposer index, counters and adaptive draft length;
speculation_refusal: why a request does not speculate.

The adaptive off-switch. Verifying a draft of k tokens adds k query rows to the step, each
costing `row_cost` of a plain decode step (EngineConfig.speculative_row_cost); the draft's
i-th token pays for itself when drafts reach position i (all of its first i tokens accepted)
more often than that. Each sequence keeps, per position, a decaying count of its recent drafts
that proposed a token there and of those that reached it (an optimistic prior, so a fresh
sequence tries its full draft), and proposes only the leading positions whose reach rate is
above the row cost. When not even the first is, it pauses (PAUSE of its own steps, doubling
on every pause that ends on drafts still not worth it, up to MAX_PAUSE), then tries again
from the prior with a draft of one token, the cap doubling on every draft accepted whole (so
a failed retry costs one verification row, not k_max).
Everything here depends only on the sequence's own drafts: a seeded request's text does not
depend on the batch.
"""

from __future__ import annotations

from tallow.engine.sampling import SamplingParams

DECAY = 0.7  # weight of the older drafts at each new one (about the last 3 drafts count)
PRIOR = 1.0  # pseudo-drafts that reached every position, at the start and after a pause
PAUSE = 8
MAX_PAUSE = 128


def speculation_refusal(params: SamplingParams) -> str | None:
    """Why a request with these params does not speculate (None: it may).

    - "request": it asked not to (`speculative: false`)
    - "grammar": its masks follow the matcher token by token (a draft's K+1 masks would need a
      matcher advanced over a copy, not done yet); it decodes plainly in the speculating batch
    - "reasoning_budget": its forced end-of-reasoning tokens replace the sampled ones one step
      at a time (engine/forced_tokens.py); it decodes plainly too

    A request that asked for prompt logprobs speculates only once they are out (with its first
    token): Speculator.propose drafts nothing for it before that.
    """
    if not params.speculative:
        return "request"
    if params.grammar is not None:
        return "grammar"
    if params.reasoning_budget is not None:
        return "reasoning_budget"
    return None


class SpecState:
    __slots__ = ("index", "proposed", "accepted", "num_drafts", "tried", "reached", "paused", "pause",
                 "k_max", "cap", "row_cost")

    def __init__(self, index: object, k_max: int = 4, row_cost: float = 0.7):
        self.index = index  # the proposer's per-sequence state
        self.proposed = 0  # draft tokens verified
        self.accepted = 0  # of those, accepted
        self.num_drafts = 0
        self.k_max = k_max
        self.cap = k_max  # longest draft for now: 1 after a pause, doubling on drafts accepted whole
        self.row_cost = row_cost
        self.tried = [PRIOR] * k_max  # decaying count of drafts with a token at position i
        self.reached = [PRIOR] * k_max  # of those, drafts whose first i + 1 tokens were accepted
        self.paused = 0  # own steps left without proposals
        self.pause = PAUSE

    def draft_length(self) -> int:
        """How many tokens this step's draft may have (0: none)."""
        if self.paused:
            return 0
        k = 0
        while k < self.cap and self.reached[k] > self.row_cost * self.tried[k]:
            k += 1
        return k

    def step_without_draft(self) -> None:
        """One of its sampling rows went without a draft: a paused step is used up."""
        if self.paused:
            self.paused -= 1

    def record(self, proposed: int, accepted: int) -> None:
        """A verified draft of `proposed` tokens of which the first `accepted` stood."""
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.num_drafts += 1
        tried, reached = self.tried, self.reached
        for i in range(self.k_max):
            tried[i] *= DECAY
            reached[i] *= DECAY
            if i < proposed:
                tried[i] += 1.0
                reached[i] += 1.0 if i < accepted else 0.0
        if self.draft_length() == 0:
            self.paused = self.pause
            self.pause = min(self.pause * 2, MAX_PAUSE)
            self.tried = [PRIOR] * self.k_max
            self.reached = [PRIOR] * self.k_max
            self.cap = 1
        elif accepted == proposed:
            self.pause = PAUSE
            if proposed >= self.cap:
                self.cap = min(self.cap * 2, self.k_max)
