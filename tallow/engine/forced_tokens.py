"""Per-sequence forced tokens: the reasoning budget (SamplingParams.reasoning_budget).

Once a sequence has generated `reasoning_budget` tokens and its reasoning block is still open
(the prompt opened it, or the output holds the start tag's ids) and not closed (the output
does not hold the end tag's ids), each step's sampled token is replaced by the next token of
the end tag: the reasoning is cut at the budget and the answer starts, as llama-server's
reasoning budget does. A partial end tag the model wrote itself is completed, not repeated.

Reads token ids on the host: a sequence with a budget runs synchronous steps (SamplingParams.
needs_host_tokens). The state kept on the sequence makes the check O(1) per step after the one
scan at the budget.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tallow.engine.request import Sequence

_CLOSED = "closed"  # the block was closed, or never opened by the budget: nothing more to force
_FORCING = "forcing"


def _contains(ids: list[int], sub: tuple[int, ...]) -> bool:
    n = len(sub)
    if n == 0:
        return False
    first = sub[0]
    return any(ids[i] == first and tuple(ids[i:i + n]) == sub for i in range(len(ids) - n + 1))


def forced_reasoning_token(seq: Sequence) -> int | None:
    """The token `seq` must take next under its reasoning budget, or None."""
    p = seq.params
    end = p.reasoning_end_ids
    if p.reasoning_budget is None or not end or seq.num_output_tokens < p.reasoning_budget:
        return None
    state = getattr(seq, "reasoning_budget_state", None)
    if state == _CLOSED:
        return None
    out = seq.output_ids
    if state is None:  # the first step at the budget: one scan of the output
        opened = p.reasoning_open or _contains(out, p.reasoning_start_ids)
        if not opened or _contains(out, end):
            seq.reasoning_budget_state = _CLOSED
            return None
        seq.reasoning_budget_state = _FORCING
    elif tuple(out[-len(end):]) == end:  # the forced tag is complete
        seq.reasoning_budget_state = _CLOSED
        return None
    for k in range(len(end) - 1, 0, -1):  # the part of the tag already written
        if tuple(out[-k:]) == end[:k]:
            return end[k]
    return end[0]


def apply_forced_tokens(token_ids: Tensor, seqs: list[Sequence], rows: list[int]) -> Tensor:
    """token_ids with the forced token of each sequence in `rows` (those with a budget) put in."""
    forced = [(i, t) for i in rows if (t := forced_reasoning_token(seqs[i])) is not None]
    if not forced:
        return token_ids
    index = torch.tensor([i for i, _ in forced], dtype=torch.long, device=token_ids.device)
    values = torch.tensor([t for _, t in forced], dtype=token_ids.dtype, device=token_ids.device)
    return token_ids.index_put((index,), values)
