"""Prompt logprobs: the log-probability of each prompt token given the tokens before it.

A sequence whose params ask for them (SamplingParams.prompt_logprobs: 0 for the prompt token's own
logprob and rank, k for the top k as well) keeps the logits of every prefill row, not only the
last: the row at position p scores prompt token p + 1, so positions 0 .. P-2 are wanted (the row
at P - 1 is the sampling row, whose logits score the first generated token). The runner appends
these rows to the step's logits indices after the sampling rows (so tensor-parallel workers,
which receive the indices, gather the same LM-head slices) and reduces them here, a slice of
rows at a time, to the token's float32 logprob, its rank (vLLM's: 1 + the tokens strictly more
likely) and the top k. The logits are the model's raw logits, before logit_bias, penalties or
temperature (vLLM and transformers score prompts the same way).

Chunked prefill: each chunk contributes the rows it computes; `Sequence.prompt_logprobs_next` is
the next position still to score, so a chunk recomputed after a preemption is not scored twice.
A prefix-cache hit would skip the cached positions' rows, so the scheduler does not look up the
prefix cache for a sequence whose prompt logprobs are not complete (it recomputes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tallow.engine.scheduler import ScheduledSeq

# Rows whose logits are materialised at once: bounds the [rows, vocab] float32 buffer (a 151k
# vocabulary: 77 MB for 128 rows).
SLICE_ROWS = 128


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """Prompt token token_id's logprob given the tokens before it; top: the k most likely tokens
    there, best first (empty when only the token's own logprob was asked)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class PromptRows:
    """The prompt-logprob rows of one step: flat row indices into the step's batch, the prompt
    token each scores, and which sequence each run of rows belongs to."""

    rows: list[int]
    targets: list[int]
    top_k: int  # the largest k asked in the step
    segments: list[tuple[object, int, int]]  # (sequence, number of rows, its own k)


def plan_prompt_rows(scheduled: list[ScheduledSeq]) -> PromptRows | None:
    """The step's rows whose logits score prompt tokens (None when no sequence asks), and each
    sequence's prompt_logprobs_next advanced past them."""
    rows: list[int] = []
    targets: list[int] = []
    segments = []
    top_k = 0
    offset = 0
    for s in scheduled:
        seq = s.seq
        if seq.prompt_logprobs is not None:
            last = seq.num_prompt_tokens - 1  # positions 0 .. last - 1 score tokens 1 .. last
            first = max(s.start, seq.prompt_logprobs_next)
            end = min(s.start + s.num_new_tokens, last)
            if first < end:
                rows.extend(range(offset + first - s.start, offset + end - s.start))
                targets.extend(seq.token_ids[first + 1:end + 1])
                k = seq.params.prompt_logprobs
                segments.append((seq, end - first, k))
                top_k = max(top_k, k)
                seq.prompt_logprobs_next = end
        offset += s.num_new_tokens + len(s.draft)  # a speculating row's draft follows its tokens
    if not rows:
        return None
    return PromptRows(rows, targets, top_k, segments)


def compute(model, hidden: torch.Tensor, rows: torch.Tensor, targets: list[int] | None, top_k: int,
            vocab_size: int) -> list[torch.Tensor] | None:
    """Reduce the logits of hidden[rows] to [logprob, rank(, top logprobs, top ids)] device tensors.

    compute_logits runs on every rank (a tensor-parallel worker's call sends its vocabulary slice
    to rank 0 and returns None); targets is None on those workers, and so is the result."""
    target_t = None if targets is None else torch.tensor(targets, dtype=torch.int64).to(hidden.device)
    parts: list[list[torch.Tensor]] = []
    for i in range(0, len(rows), SLICE_ROWS):
        logits = model.compute_logits(hidden.index_select(0, rows[i:i + SLICE_ROWS]))
        if logits is None or target_t is None:
            continue
        logprobs = logits[:, :vocab_size].float().log_softmax(dim=-1)
        target = target_t[i:i + SLICE_ROWS].unsqueeze(1)
        chosen = logprobs.gather(1, target)
        # vLLM's rank: 1 + the tokens strictly more likely (ties share the better rank).
        rank = (logprobs > chosen).sum(dim=-1) + 1
        part = [chosen.squeeze(1), rank]
        if top_k > 0:
            top_lp, top_ids = logprobs.topk(min(top_k, vocab_size), dim=-1)
            part += [top_lp, top_ids]
        parts.append(part)
    if not parts:
        return None
    return [torch.cat(column) for column in zip(*parts)]


def to_entries(plan: PromptRows, host: list[torch.Tensor]) -> list[tuple[object, list[PromptLogprob]]]:
    """Host copies of compute()'s tensors -> each sequence's PromptLogprobs of the step."""
    logprobs, ranks = host[0].tolist(), host[1].tolist()
    top_lp = host[2].tolist() if len(host) > 2 else None
    top_ids = host[3].tolist() if len(host) > 2 else None
    out = []
    i = 0
    for seq, count, k in plan.segments:
        entries = []
        for j in range(i, i + count):
            top = list(zip(top_ids[j][:k], top_lp[j][:k])) if k and top_ids is not None else []
            entries.append(PromptLogprob(plan.targets[j], logprobs[j], ranks[j], top))
        out.append((seq, entries))
        i += count
    return out
