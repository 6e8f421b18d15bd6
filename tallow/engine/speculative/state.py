"""SpecState: one speculating sequence's proposer index, counters and adaptive draft length;
speculation_refusal: why a request does not speculate.

The adaptive off-switch. Verifying a draft of k tokens adds k query rows to the step, each
costing `row_cost` of a plain decode step (EngineConfig.speculative_row_cost; the Speculator
raises it with the batch for requests whose text cannot depend on it); the draft's i-th token
pays for itself when drafts reach position i (all of its first i tokens accepted) more often
than that. Each sequence keeps, per position, a decaying count of its recent drafts whose token
there was judged (every token before it accepted) and of those accepted there (an optimistic
prior, so a fresh sequence tries its full draft); the chance of reaching position i is the
product of the acceptance rates up to i, and it proposes the leading positions whose chance is
above the row cost. A position no longer proposed is not judged, so its rate would stay where
its last rejections left it: each draft accepted whole moves the next position's rate back
towards the prior (a position that fails is retried later, sooner where rows are cheap).
When not even the first position pays, it pauses (PAUSE of its own steps, doubling on every
pause that ends on drafts still not worth it, up to MAX_PAUSE), then tries again from the prior
with a draft of one token, the cap doubling on every draft accepted whole (so a failed retry
costs one verification row, not k_max).
Everything here depends only on the sequence's own drafts and the row cost it is asked at.
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
    - "reasoning_budget": its forced end-of-reasoning tokens replace the sampled ones one step
      at a time (engine/forced_tokens.py); it decodes plainly in the speculating batch

    A request that asked for prompt logprobs speculates only once they are out (with its first
    token): Speculator.propose drafts nothing for it before that. A request with a grammar
    speculates: its drafts are cut before the first token the grammar rejects (or the one that
    would complete it), and the verified positions are masked by a copy of its matcher advanced
    over the draft (GrammarState.draft_prefix, draft_masks).
    """
    if not params.speculative:
        return "request"
    if params.reasoning_budget is not None:
        return "reasoning_budget"
    return None


class SpecState:
    __slots__ = ("index", "proposed", "accepted", "num_drafts", "judged", "passed", "paused", "pause",
                 "k_max", "cap", "row_cost")

    def __init__(self, index: object, k_max: int = 4, row_cost: float = 0.7):
        self.index = index  # the proposer's per-sequence state
        self.proposed = 0  # draft tokens verified
        self.accepted = 0  # of those, accepted
        self.num_drafts = 0
        self.k_max = k_max
        self.cap = k_max  # longest draft for now: 1 after a pause, doubling on drafts accepted whole
        self.row_cost = row_cost
        self.judged = [PRIOR] * k_max  # decaying count of drafts whose token i was judged
        self.passed = [PRIOR] * k_max  # of those, drafts whose token i was accepted
        self.paused = 0  # own steps left without proposals
        self.pause = PAUSE

    def draft_length(self, row_cost: float | None = None) -> int:
        """How many tokens this step's draft may have (0: none), a row costing row_cost (by
        default the sequence's own, that of a step of one sequence)."""
        if self.paused:
            return 0
        cost = self.row_cost if row_cost is None else row_cost
        k, reach = 0, 1.0
        while k < self.cap:
            reach *= self.passed[k] / self.judged[k]
            if reach <= cost:
                break
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
        judged, passed = self.judged, self.passed
        # Tokens up to the first rejected one were judged; later ones followed a wrong token.
        for i in range(min(proposed, accepted + 1)):
            judged[i] = judged[i] * DECAY + 1.0
            passed[i] = passed[i] * DECAY + (1.0 if i < accepted else 0.0)
        if accepted == proposed < self.k_max:  # the next position, not proposed: back towards the prior
            judged[proposed] = judged[proposed] * DECAY + (1.0 - DECAY) * PRIOR
            passed[proposed] = passed[proposed] * DECAY + (1.0 - DECAY) * PRIOR
        if self.draft_length() == 0:
            self.paused = self.pause
            self.pause = min(self.pause * 2, MAX_PAUSE)
            self.judged = [PRIOR] * self.k_max
            self.passed = [PRIOR] * self.k_max
            self.cap = 1
        elif accepted == proposed:
            self.pause = PAUSE
            if proposed >= self.cap:
                self.cap = min(self.cap * 2, self.k_max)
