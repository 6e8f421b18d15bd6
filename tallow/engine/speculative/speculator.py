"""Speculator: the engine's side of speculation. It decides which sequences speculate,
proposes their drafts when the scheduler schedules their sampling rows, and keeps the
counters that /stats and /metrics report (vLLM's spec_decode names)."""

from __future__ import annotations

from collections import Counter

from tallow.config import EngineConfig
from tallow.engine.request import Sequence
from tallow.engine.speculative.proposer import make_proposer
from tallow.engine.speculative.state import SpecState, speculation_refusal
from tallow.errors import TallowError


class Speculator:
    def __init__(self, config: EngineConfig, device_type: str = "cpu", proposer=None):
        k = config.speculative_tokens(device_type)
        if not 1 <= k <= 64:
            raise TallowError(f"num_speculative_tokens must be in [1, 64], got {k}", param="num_speculative_tokens")
        if config.max_num_batched_tokens < k + 1:
            raise TallowError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) must hold a speculating "
                              f"row of num_speculative_tokens + 1 = {k + 1} tokens", param="num_speculative_tokens")
        self.method = config.speculative_method
        self.k = k
        self.row_cost = config.speculative_row_cost
        if self.row_cost is None:
            self.row_cost = default_row_cost(device_type)
        if not 0.0 <= self.row_cost < 1.0:
            raise TallowError(f"speculative_row_cost must be in [0, 1), got {self.row_cost}",
                              param="speculative_row_cost")
        self.proposer = proposer or make_proposer(config.speculative_method, ngram_max=config.ngram_max,
                                                  ngram_min=config.ngram_min)
        self.num_drafts = 0  # verified drafts (rows with at least one proposed token)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * k  # drafts whose i-th token was accepted
        self.num_requests = 0  # requests that speculate
        self.refused: Counter[str] = Counter()  # requests that do not, by reason

    def attach(self, seq: Sequence) -> None:
        """Decide whether seq speculates (seq.spec: its SpecState, or None)."""
        reason = speculation_refusal(seq.params)
        first = seq.prefill_after is None  # a request's other choices are counted with it
        if reason is not None:
            seq.spec = None
            if first:
                self.refused[reason] += 1
            return
        seq.spec = SpecState(self.proposer.new_index(), self.k, self.row_cost)
        if first:
            self.num_requests += 1

    def draft_length(self, seq: Sequence, pool_tokens: int, batch: int = 1) -> int:
        """How many tokens seq may propose now, `batch` sequences running (the step's rows)."""
        if _prompt_logprobs_pending(seq):
            return 0
        spec = seq.spec
        # A seeded sampled request's text depends on where drafts were verified (rejection
        # sampling draws differently from plain sampling): its draft lengths must depend on its
        # own drafts only. Any other request's text does not depend on them (greedy: plain
        # decoding's tokens; unseeded: random anyway), so its rows are priced at the batch.
        k = spec.draft_length(None if _text_follows_drafts(seq) else batch_row_cost(self.row_cost, batch))
        return max(0, min(k, seq.max_output_tokens - seq.num_output_tokens - 1, pool_tokens - len(seq.token_ids)))

    def prepare(self, running: list[Sequence], pool_tokens: int) -> None:
        """Before the scheduler runs: a proposer that drafts for the whole batch at once (a
        draft model) drafts for the running sequences about to decode."""
        prepare = getattr(self.proposer, "prepare", None)
        if prepare is None:
            return
        wanted = []
        for seq in running:
            if seq.spec is None or seq.stopping or seq.num_computed_tokens != len(seq.token_ids) - 1:
                continue
            k = self.draft_length(seq, pool_tokens, len(running))
            if k > 0:
                wanted.append((seq, k))
        prepare(wanted)

    def release(self, seq: Sequence) -> None:
        """seq finished: what the proposer holds for it (a draft model's KV blocks) goes."""
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release(seq.spec.index)

    def propose(self, seq: Sequence, pool_tokens: int, batch: int = 1) -> list[int]:
        """The draft of seq's next sampling row: at most k tokens, fewer where its output limit
        or the pool would end it first (never fewer because of the batch). Nothing while its last
        token is pending (asynchronous scheduling): the engine runs such a step only when
        may_draft() said no draft could come."""
        k = self.draft_length(seq, pool_tokens, batch)
        if k <= 0 or seq.token_ids[-1] < 0:
            return []
        draft = self.proposer.propose(seq.spec.index, seq.token_ids, k)
        g = seq.grammar
        if draft and g is not None:  # cut before the first token the grammar rejects, or completes it on
            draft = draft[:g.draft_prefix(seq.token_ids, seq.num_prompt_tokens, draft)]
        return draft

    def may_draft(self, seq: Sequence, pool_tokens: int, batch: int = 1) -> bool:
        """Whether seq's next sampling row could carry a draft, known before its last token is
        (asynchronous scheduling: it may still be sampled on the device). False means propose()
        gives nothing whatever that token is, so the step can run as a plain one without waiting
        for it. A proposer without may_propose (a draft model) could always draft.

        A seeded sampled request's text depends on where its drafts were verified, so for it the
        answer is exact. For any other one it is the proposer's guess (ngram: whether it had a
        draft one token earlier), and False may only put its next draft off by a step: its tokens
        are the same either way, and a batch whose sequences keep finding nothing keeps its steps
        overlapped."""
        k = self.draft_length(seq, pool_tokens, batch)
        if k <= 0:
            return False
        may = getattr(self.proposer, "may_propose", None)
        if may is None:
            return True
        return may(seq.spec.index, seq.token_ids, k, exact=_text_follows_drafts(seq))

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """One verified draft of a speculating sequence (rows without a draft are counted by the
        scheduler when it places them: scheduler._place)."""
        spec = seq.spec
        spec.record(proposed, accepted)
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def stats(self) -> dict:
        d = self.num_draft_tokens
        return {
            "method": self.method,
            "num_speculative_tokens": self.k,
            "row_cost": self.row_cost,
            "requests": self.num_requests,
            "requests_not_speculating": dict(self.refused),
            "num_drafts": self.num_drafts,
            "num_draft_tokens": d,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.num_accepted_tokens / d if d else 0.0,
            # Tokens emitted per verified draft: the accepted ones and the target's own.
            "mean_accepted_length": (1 + self.num_accepted_tokens / self.num_drafts) if self.num_drafts else 0.0,
            "accepted_per_position": list(self.accepted_per_position),
        }


def default_row_cost(device_type: str) -> float:
    """speculative_row_cost's default (EngineConfig): by the kernels that run the rows."""
    if device_type == "cuda":
        return 0.1
    from tallow.ops import cpu_native

    if cpu_native.variant() == "avx512" and cpu_native.amx_state() == "on":
        return 0.02  # many rows on AMX tiles: see config.py
    return {"avx512": 0.25, "avxvnni": 0.4, "avx2": 0.4}.get(cpu_native.variant() or "", 0.7)


def batch_row_cost(row_cost: float, batch: int) -> float:
    """What one more row costs against the tokens of a plain step of `batch` sequences, for a
    step that costs 1 - row_cost + batch * row_cost one-sequence steps (a fixed part and a
    part per row: the measured shape on the CPU): row_cost at one sequence, towards 1 as the
    batch grows (a row then costs about a token's share of the step)."""
    b = max(1, batch)
    return b * row_cost / (1.0 + (b - 1) * row_cost)


def _text_follows_drafts(seq: Sequence) -> bool:
    """A seeded sampled request: rejection sampling draws differently from plain sampling, so its
    text depends on where its drafts were verified, and those must depend on its own tokens only
    (not on the batch's row prices or the batch's other sequences)."""
    return seq.params.seed is not None and not seq.params.greedy


def _prompt_logprobs_pending(seq: Sequence) -> bool:
    """The sequence asked for prompt logprobs and its first output has not carried them yet:
    no draft until then (its prefill rows score the prompt; a draft would only follow them)."""
    return seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent
