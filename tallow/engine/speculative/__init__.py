"""Speculative decoding inside the continuous batch.

A speculating sequence's sampling row carries a draft: up to K proposed tokens, computed in
the same flat forward as the row's own token (K + 1 query rows, like a prefill chunk). The
verifier keeps the target's logits of those rows and accepts a prefix of the draft, then
emits the target's own next token; the scheduler appends the accepted run, counts the
computed K/V of accepted tokens only and returns the blocks that held rejected slots.

One concept per module:

    proposer.py   Proposer: context -> proposed tokens (the interface), make_proposer
    ngram.py      NgramProposer: prompt lookup over a per-sequence n-gram index
    state.py      SpecState (per sequence: proposer index, counters, the adaptive off-switch),
                  refusal reasons (a request whose features cannot stay exact does not speculate)
    verify.py     verify_step: greedy and rejection-sampling acceptance over the step's logits
    speculator.py Speculator: the engine's side (attach to sequences, propose at schedule
                  time, the counters /stats and /metrics report)
"""

from tallow.engine.speculative.proposer import Proposer, make_proposer
from tallow.engine.speculative.speculator import Speculator
from tallow.engine.speculative.state import SpecState
from tallow.engine.speculative.verify import SpecStepResult, verify_step

__all__ = ["Proposer", "make_proposer", "Speculator", "SpecState", "SpecStepResult", "verify_step"]
