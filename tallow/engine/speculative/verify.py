"""verify_step: the logits of a step with speculating rows -> each sampling row's emitted run.

A speculating row with draft d_1..d_k has k + 1 logits rows: row j is the target's
distribution for the token after d_1..d_j. Each row is processed as plain sampling would
process it at that position (logit_bias; min_tokens with the output length as of that
position; the grammar's mask from a copy of the sequence's matcher advanced over d_1..d_j;
temperature, top_k, top_p, min_p), so:

- greedy: d_j is accepted while it is the row's argmax; the first row whose argmax differs
  (or row k when all stand) emits its argmax: token for token plain greedy decoding.
- sampling (rejection sampling, a draft being a point mass q = 1 on d_j): accept d_j with
  probability min(1, p/q) = p(d_j); on rejection draw from the residual max(0, p - q),
  which is p with d_j removed, renormalized; when all stand draw the bonus token from row k.

Randomness is drawn per emitted token, always the same amount (one uniform for the accept
test and one noise vector for a draw, used or not), from the sequence's own generator when
seeded: its text depends on its seed and its drafts, not on the batch.

Rows without a draft (of sequences that do not speculate, or that proposed nothing this step)
go through the Sampler as usual, as they would in a step without drafts: a seeded sequence
draws the same noise for such a row whatever the rest of the batch drafted. Logprobs and top
logprobs of each emitted token are read from its row's log_softmax of the processed logits
(the Sampler's "processed" logprobs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tallow.engine.grammar import apply_bitmasks
from tallow.engine.runner import StepResult
from tallow.engine.sampler import Sampler, SamplingTensors
from tallow.engine.scheduler import SchedulerOutput


@dataclass
class SpecStepResult(StepResult):
    """StepResult plus each sampling row's run. token_ids[i] is runs[i][0]; the scheduler cuts
    runs[i] where the sequence stops (update())."""

    runs: list[list[int]] = None
    run_logprobs: list[list[float] | None] | None = None
    run_top: list[list[list[tuple[int, float]]] | None] | None = None
    proposed: list[int] = None  # draft tokens verified per sampling row
    accepted: list[int] = None  # of those, accepted


def residual_draw(probs: Tensor, token: int, noise: Tensor) -> int:
    """A draw from probs with `token` removed (the residual of a point-mass proposal), by the
    exponential race on uniform noise."""
    residual = probs.clone()
    residual[token] = 0.0
    return int(residual.div_(noise.log().neg_()).argmax())


def _race(probs: Tensor, noise: Tensor) -> int:
    return int((probs / noise.log().neg_()).argmax())


@torch.inference_mode()
def verify_step(sampler: Sampler, logits: Tensor, out: SchedulerOutput) -> SpecStepResult:
    vocab = sampler.vocab_size
    logits = logits[:, :vocab]
    plain_rows: list[int] = []  # logits rows of non-speculating sampling rows
    plain_at: list[int] = []  # their sampling-row indices
    plain_seqs = []
    groups = []  # (sampling-row index, seq, first logits row, draft)
    r = i = 0
    for s in out.scheduled:
        if not s.samples:
            continue
        if not s.draft:  # sampled as a plain step samples it, speculating sequence or not
            plain_rows.append(r)
            plain_at.append(i)
            plain_seqs.append(s.seq)
            r += 1
        else:
            groups.append((i, s.seq, r, s.draft))
            r += 1 + len(s.draft)
        i += 1
    num = i
    runs: list[list[int]] = [None] * num
    run_lp: list = [None] * num
    run_top: list = [None] * num
    proposed = [0] * num
    accepted = [0] * num
    invalid: list[int] = []

    if plain_rows:
        res = sampler(logits[plain_rows] if len(plain_rows) < logits.shape[0] else logits, plain_seqs)
        ids = res.token_ids.tolist()
        lps = res.logprobs.tolist() if res.logprobs is not None else None
        tops = (res.top_ids.tolist(), res.top_logprobs.tolist()) if res.top_ids is not None else None
        bad = res.invalid.tolist()
        for j, at in enumerate(plain_at):
            runs[at] = [ids[j]]
            if lps is not None:
                run_lp[at] = [lps[j]]
            if tops is not None:
                run_top[at] = [list(zip(tops[0][j], tops[1][j]))]
            if bad[j]:
                invalid.append(at)

    if groups:
        _verify_groups(sampler, logits, groups, runs, run_lp, run_top, proposed, accepted, invalid)

    want_lp = any(x is not None for x in run_lp)
    want_top = any(x is not None for x in run_top)
    return SpecStepResult(
        token_ids=[run[0] for run in runs],
        logprobs=[lp[0] if lp else math.nan for lp in run_lp] if want_lp else None,
        top=None, invalid_rows=sorted(invalid), runs=runs,
        run_logprobs=run_lp if want_lp else None, run_top=run_top if want_top else None,
        proposed=proposed, accepted=accepted)


def _verify_groups(sampler, logits, groups, runs, run_lp, run_top, proposed, accepted, invalid) -> None:
    device = logits.device
    vocab = logits.shape[1]
    index: list[int] = []
    row_seq = []  # per processed row: (seq, output position offset)
    drafts = []  # per processed row: its sequence's draft
    for _, seq, r0, draft in groups:
        for j in range(len(draft) + 1):
            index.append(r0 + j)
            row_seq.append((seq, j))
            drafts.append(draft)
    x = logits.index_select(0, _long(index, logits.device))
    _apply_bias_and_min_tokens(x, row_seq, vocab)
    _apply_penalties(x, row_seq, drafts, vocab)
    _apply_grammars(x, groups)
    highest, greedy = x.max(dim=-1)
    finite = highest.isfinite().tolist()
    greedy = greedy.tolist()

    want_lp = any(seq.params.logprobs is not None for _, seq, _, _ in groups)
    top_k = max((seq.params.logprobs or 0 for _, seq, _, _ in groups), default=0)
    all_lp = x.log_softmax(dim=-1) if want_lp else None
    top = all_lp.topk(top_k, dim=-1) if want_lp and top_k > 0 else None
    top_ids = top.indices.tolist() if top is not None else None
    top_vals = top.values.tolist() if top is not None else None

    sampled_rows = [n for n, (seq, _) in enumerate(row_seq) if not seq.params.greedy]
    probs = None
    where = {}
    if sampled_rows:
        rows = torch.tensor(sampled_rows, dtype=torch.int64, device=device)
        tensors = SamplingTensors([row_seq[n][0].params for n in sampled_rows], device, x.dtype)
        probs = tensors.apply(x.index_select(0, rows)).softmax(dim=-1)
        where = {n: m for m, n in enumerate(sampled_rows)}

    base = 0
    for at, seq, r0, draft in groups:
        k = len(draft)
        rows = range(base, base + k + 1)
        if not all(finite[n] for n in rows):
            invalid.append(at)
        if seq.params.greedy:
            a = 0
            while a < k and greedy[base + a] == draft[a]:
                a += 1
            run = list(draft[:a]) + [greedy[base + a]]
        else:
            gen = sampler._generator(seq) if seq.params.seed is not None else None
            p_draft = probs[[where[base + j] for j in range(k)], list(draft)].tolist() if k else []
            run = []
            for j in range(k + 1):
                z = torch.rand(vocab + 1, generator=gen, device=device)
                row = probs[where[base + j]]
                if j < k:
                    if z[0].item() < p_draft[j]:
                        run.append(draft[j])
                        continue
                    run.append(residual_draw(row, draft[j], z[1:]))
                    break
                run.append(_race(row, z[1:]))
            a = len(run) - 1
        runs[at] = run
        proposed[at], accepted[at] = k, a
        if want_lp and seq.params.logprobs is not None:
            run_lp[at] = [all_lp[base + j, t].item() for j, t in enumerate(run)]
            if top_ids is not None:
                run_top[at] = [list(zip(top_ids[base + j], top_vals[base + j])) for j in range(len(run))]
        base += k + 1


def _apply_grammars(x: Tensor, groups: list) -> None:
    """Each grammar row's tokens its grammar forbids at that position get -inf (after the bias
    and penalties, as the Sampler masks): the masks of a copy of the sequence's matcher advanced
    over its draft (GrammarState.draft_masks)."""
    rows, masks = [], []
    base = 0
    for _, seq, _, draft in groups:
        g = seq.grammar
        if g is not None:
            got = g.draft_masks(seq.token_ids, seq.num_prompt_tokens, draft)
            if got is not None:
                rows += [base + j for j in got[0]]
                masks.append(got[1])
        base += len(draft) + 1
    if rows:
        apply_bitmasks(x, rows, np.concatenate(masks), in_place=True)


def _apply_penalties(x: Tensor, row_seq: list, drafts: list, vocab: int) -> None:
    """Repetition, frequency and presence penalties on the rows of sequences that have them,
    with each row's output counted as of its position (the output so far and the draft tokens
    before the row): the Sampler's arithmetic (Sampler._apply_penalties), row by row the same."""
    rows = [n for n, (seq, _) in enumerate(row_seq) if seq.params.needs_penalties]
    if not rows:
        return
    count_rows, count_cols, prompt_rows, prompt_cols = [], [], [], []
    for m, n in enumerate(rows):
        seq, j = row_seq[n]
        output = seq.token_ids[seq.num_prompt_tokens:] + list(drafts[n][:j])
        count_rows += [m] * len(output)
        count_cols += output
        prompt_rows += [m] * seq.num_prompt_tokens
        prompt_cols += seq.token_ids[:seq.num_prompt_tokens]
    counts = torch.zeros((len(rows), vocab), dtype=torch.int32, device=x.device)
    prompt_mask = torch.zeros((len(rows), vocab), dtype=torch.bool, device=x.device)
    dev = x.device
    if count_rows:
        counts.index_put_((_long(count_rows, dev), _long(count_cols, dev)),
                          torch.ones((), dtype=torch.int32, device=dev), accumulate=True)
    prompt_mask.index_put_((_long(prompt_rows, dev), _long(prompt_cols, dev)),
                           torch.ones((), dtype=torch.bool, device=dev))
    params = [row_seq[n][0].params for n in rows]
    index = torch.tensor(rows, dtype=torch.int64, device=x.device)
    y = x.index_select(0, index)
    in_output = counts > 0
    # Each stage as the Sampler runs it when any row of its batch needs it (r = 1 and f = p = 0
    # leave a row's values as they are).
    if any(p.repetition_penalty != 1.0 for p in params):
        r = torch.tensor([p.repetition_penalty for p in params], dtype=x.dtype, device=dev).unsqueeze(1)
        y = torch.where(prompt_mask | in_output, torch.where(y > 0, y / r, y * r), y)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        f = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype, device=dev).unsqueeze(1)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype, device=dev).unsqueeze(1)
        y = y - f * counts - pres * in_output
    x.index_copy_(0, index, y.clamp(max=torch.finfo(y.dtype).max))


def _apply_bias_and_min_tokens(x: Tensor, row_seq: list, vocab: int) -> None:
    """logit_bias, and -inf on eos and stop ids where the output is shorter than min_tokens as
    of the row's position (the Sampler's processors, per draft position)."""
    rows, cols, values = [], [], []
    min_rows, min_cols = [], []
    for n, (seq, j) in enumerate(row_seq):
        p = seq.params
        for token, bias in (p.logit_bias or {}).items():
            if 0 <= token < vocab:
                rows.append(n)
                cols.append(token)
                values.append(bias)
        if p.min_tokens and seq.num_output_tokens + j < p.min_tokens:
            for token in seq.eos_token_ids | set(p.stop_token_ids):
                if 0 <= token < vocab:
                    min_rows.append(n)
                    min_cols.append(token)
    dev = x.device
    if rows:
        x.index_put_((_long(rows, dev), _long(cols, dev)), torch.tensor(values, dtype=x.dtype, device=dev),
                     accumulate=True)
    if min_rows:
        x.index_put_((_long(min_rows, dev), _long(min_cols, dev)), torch.tensor(-math.inf, dtype=x.dtype, device=dev))


def _long(values: list[int], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
