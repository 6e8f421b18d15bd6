"""Sampler: the logits of every sampling row -> next token ids, with logprobs.

One call per engine step, vectorized over the batch: per-row parameters become tensors
(a BatchPlan) when the batch's sequences change, and are reused by the steady decode steps
in between; a stage runs only when some row needs it. The chain, in vLLM's order:

    processed = logits
        + logit_bias[t]                                     logit_bias
        -inf on eos and stop_token_ids while the output is shorter than min_tokens
        where t in prompt or output: x > 0 -> x / r, x <= 0 -> x * r   repetition_penalty r
        - f * count_output[t]                               frequency_penalty f
        - p * [count_output[t] > 0]                         presence_penalty p
        -inf where the row's grammar forbids t next         grammar (structured output)
    logprobs = log_softmax(processed)          vLLM's "processed" logprobs, as mlx-lm
    greedy rows (temperature 0): argmax(processed)
    other rows: processed / temperature -> top_k -> top_p -> min_p -> softmax
                -> argmax(probs / q), q ~ Exp(1)  (the exponential race: a draw from probs)

The grammar's bitmasks (tallow/engine/grammar.py) are filled on the host by llguidance and
unpacked on the logits' device, so logprobs are those of the masked distribution, as vLLM's.

Top-k runs torch.topk up to the largest k of the batch; top-p reads the masses off a
torch.topk head on the CPU and sorts a full row only when the nucleus is larger.

A seeded row draws its noise only from its own generator (seq.generator), so its tokens
do not depend on what else is in the batch; unseeded rows share torch's default generator
of the device (seeded by the engine's torch.manual_seed). Off the CPU nothing here reads
a device value on the host: the runner makes the one transfer of the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from tallow.engine.grammar import apply_bitmasks, grammar_bitmasks
from tallow.engine.forced_tokens import apply_forced_tokens
from tallow.engine.request import Sequence
from tallow.engine.sampling import SamplingParams
from tallow.ops.reduce import rows_max


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [N] int64, on the logits' device
    logprobs: Tensor | None  # [N] float32: log-prob of the chosen token (None when no row asked)
    top_ids: Tensor | None  # [N, K] int64, K = the largest logprobs k asked (None when K == 0)
    top_logprobs: Tensor | None  # [N, K] float32, sorted descending
    # [N] bool: the row's processed logits hold NaN or +inf, or only -inf, so it has no
    # distribution to draw from (its token and logprobs mean nothing). Computed on the device
    # and copied to the host with the token ids; the engine fails those rows alone.
    invalid: Tensor | None = None


@dataclass
class PenaltyState:
    """What the sampler keeps in seq.sampler_state for penalties.

    output_counts[t] counts token t among the first num_counted output tokens and
    prompt_mask[t] says t is in the prompt. Both are rows (views) of the batch tensors of
    the step that last saw the sequence, so the next step stacks them with one op and
    counts only the tokens appended since. A recompute preemption keeps token_ids, so
    what was counted stays true.
    """

    output_counts: Tensor  # [V] int32
    prompt_mask: Tensor  # [V] bool
    num_counted: int


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device):
        # Logits wider than the vocabulary (a padded LM head) are cut to it.
        self.vocab_size = vocab_size
        # Where the logits come: seeded rows' generators are made there.
        self.device = torch.device(device)
        self._last_plan: BatchPlan | None = None

    def __call__(self, logits: Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits [N, V] float32: row i belongs to seqs[i]."""
        plan = self._plan(seqs, logits)
        processed = self.process_logits(logits, seqs, plan)
        if plan.grammar_rows:
            processed = self._apply_grammars(processed, logits, seqs)

        # The greedy pick and each row's largest logit come from one pass (max); the largest
        # logit is not finite exactly when the row has no distribution (NaN, +inf, all -inf).
        if plan.sampled_seqs is None:
            highest, token_ids = rows_max(processed)
        elif plan.sampled_index is None:
            token_ids = self._sample(processed, plan.sampled_seqs, plan.sampling)
            highest = processed.amax(dim=-1)
        else:
            rows = plan.sampled_index
            chosen = self._sample(processed.index_select(0, rows), plan.sampled_seqs, plan.sampling)
            highest, greedy = rows_max(processed)
            token_ids = greedy.index_copy(0, rows, chosen)

        if plan.forced_rows:  # reasoning budgets (engine/forced_tokens.py)
            token_ids = apply_forced_tokens(token_ids, seqs, plan.forced_rows)
        invalid = ~highest.isfinite()
        logprobs = top_ids = top_logprobs = None
        if plan.logprobs:
            all_logprobs = processed.log_softmax(dim=-1)
            logprobs = all_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
            if plan.top_k_logprobs > 0:
                top_logprobs, top_ids = all_logprobs.topk(plan.top_k_logprobs, dim=-1)
        return SamplerOutput(token_ids, logprobs, top_ids, top_logprobs, invalid)

    def release(self) -> None:
        """Drop the last batch plan and what it holds (its sequences, penalty tensors)."""
        self._last_plan = None

    def _plan(self, seqs: list[Sequence], logits: Tensor) -> "BatchPlan":
        """The batch's BatchPlan: the last one while the batch holds the same sequences, in
        the same order (steady-state decode), else a new one."""
        plan = self._last_plan
        if (plan is None or plan.seqs != seqs or plan.device != logits.device
                or plan.dtype != logits.dtype):
            plan = self._last_plan = BatchPlan(seqs, self.vocab_size, logits.device, logits.dtype)
        return plan

    # ---- processors ----------------------------------------------------------------------
    def process_logits(self, logits: Tensor, seqs: list[Sequence], plan: "BatchPlan | None" = None) -> Tensor:
        """The logits after logit_bias, min_tokens and the penalties (the input is not changed).

        Updates the penalty counts in seq.sampler_state as a side effect.
        """
        logits = logits[:, : self.vocab_size]
        plan = plan or self._plan(seqs, logits)
        min_token_rows = [i for i in plan.min_token_rows if seqs[i].num_output_tokens < seqs[i].params.min_tokens]
        if not (plan.bias_index is not None or min_token_rows or plan.penalty_rows):
            return logits
        processed = logits.clone()
        if plan.bias_index is not None:
            processed.index_put_(plan.bias_index, plan.bias_values, accumulate=True)
        self._apply_min_tokens(processed, seqs, min_token_rows)
        if plan.penalty_rows:
            self._apply_penalties(processed, seqs, plan)
        return processed

    @staticmethod
    def _apply_grammars(processed: Tensor, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        """Tokens a row's grammar forbids next get -inf (after logit_bias, min_tokens and the
        penalties, before temperature and the top-k/top-p/min-p cuts: logprobs are those of the
        masked distribution). The masks are filled on the host, from the matchers the previous
        step's tokens advanced, while the device may still run the forward."""
        masks = grammar_bitmasks([s.grammar for s in seqs])
        if masks is None:
            return processed
        rows, words = masks
        # The unprocessed logits are the caller's: changed only in a copy.
        return apply_bitmasks(processed, rows, words, in_place=processed.data_ptr() != logits.data_ptr())

    def _apply_min_tokens(self, logits: Tensor, seqs: list[Sequence], below: list[int]) -> None:
        """Forbid stopping early: eos (even with ignore_eos) and stop_token_ids get -inf on the
        rows `below` (those whose output is still shorter than min_tokens)."""
        rows, cols = [], []
        for i in below:
            s = seqs[i]
            for token in s.eos_token_ids | set(s.params.stop_token_ids):
                if 0 <= token < self.vocab_size:
                    rows.append(i)
                    cols.append(token)
        if rows:
            index = to_device([rows, cols], torch.int64, logits.device)
            logits.index_put_(tuple(index), torch.tensor(-math.inf, dtype=logits.dtype, device=logits.device))

    def _apply_penalties(self, logits: Tensor, seqs: list[Sequence], plan: "BatchPlan") -> None:
        """Repetition (HF/vLLM), frequency and presence (OpenAI) penalties on the plan's rows."""
        device = logits.device
        counts, prompt_mask = self._penalty_counts([seqs[i] for i in plan.penalty_rows], device, plan)
        index = plan.penalty_index
        x = logits.index_select(0, index)
        in_output = counts > 0
        if plan.repetition is not None:
            r = plan.repetition
            x = torch.where(prompt_mask | in_output, torch.where(x > 0, x / r, x * r), x)
        if plan.frequency is not None:
            x = x - plan.frequency * counts - plan.presence * in_output
        # x / r overflows to inf for a small r: the largest float keeps such tokens the likeliest
        # without the NaN that inf - inf gives in the softmax.
        logits.index_copy_(0, index, x.clamp(max=torch.finfo(x.dtype).max))

    def _penalty_counts(self, seqs: list[Sequence], device: torch.device,
                        plan: "BatchPlan | None" = None) -> tuple[Tensor, Tensor]:
        """[M, V] output token counts (int32) and prompt masks (bool), counting only new tokens.

        When every row's state is the one this plan's previous step made, the rows are
        already the plan's batch tensors: they are updated in place instead of stacked."""
        vocab = self.vocab_size
        states: list[PenaltyState | None] = [s.sampler_state for s in seqs]
        last = None if plan is None else plan.penalty_states
        if last is not None and len(last) == len(states) and all(a is b for a, b in zip(states, last)):
            counts, prompt_mask = plan.penalty_tensors
            self._count_new_tokens(seqs, states, counts, prompt_mask, device)
            for s, st in zip(seqs, states):
                st.num_counted = s.num_output_tokens
            return counts, prompt_mask
        fresh = [st is None for st in states]
        zero_counts = torch.zeros(vocab, dtype=torch.int32, device=device) if any(fresh) else None
        no_prompt = torch.zeros(vocab, dtype=torch.bool, device=device) if any(fresh) else None
        counts = torch.stack([zero_counts if st is None else st.output_counts for st in states])
        prompt_mask = torch.stack([no_prompt if st is None else st.prompt_mask for st in states])
        self._count_new_tokens(seqs, states, counts, prompt_mask, device)
        new_states = []
        for j, s in enumerate(seqs):
            s.sampler_state = PenaltyState(counts[j], prompt_mask[j], s.num_output_tokens)
            new_states.append(s.sampler_state)
        if plan is not None:
            plan.penalty_states, plan.penalty_tensors = new_states, (counts, prompt_mask)
        return counts, prompt_mask

    @staticmethod
    def _count_new_tokens(seqs: list[Sequence], states: list[PenaltyState | None], counts: Tensor,
                          prompt_mask: Tensor, device: torch.device) -> None:
        """Add each row's output tokens not yet counted; mark the prompt of rows seen first."""
        count_rows, count_cols, prompt_rows, prompt_cols = [], [], [], []
        for j, (s, st) in enumerate(zip(seqs, states)):
            counted = 0 if st is None else st.num_counted
            new = s.token_ids[s.num_prompt_tokens + counted:]
            count_rows += [j] * len(new)
            count_cols += new
            if st is None:
                prompt_rows += [j] * s.num_prompt_tokens
                prompt_cols += s.token_ids[: s.num_prompt_tokens]
        if count_rows:
            index = to_device([count_rows, count_cols], torch.int64, device)
            counts.index_put_(tuple(index), torch.ones((), dtype=torch.int32, device=device), accumulate=True)
        if prompt_rows:
            index = to_device([prompt_rows, prompt_cols], torch.int64, device)
            prompt_mask.index_put_(tuple(index), torch.ones((), dtype=torch.bool, device=device))

    # ---- sampling ------------------------------------------------------------------------
    def _sample(self, processed: Tensor, seqs: list[Sequence], sampling: "SamplingTensors") -> Tensor:
        """A token per row from softmax(sampling_logits): argmax(probs / q), q ~ Exp(1)."""
        probs = sampling.apply(processed).softmax(dim=-1)
        # Exp(1) noise as -log(U): three times faster than exponential_ on the CPU.
        # U == 0 gives q = inf, which only gives that token no chance.
        noise = torch.empty_like(probs)
        seeded = sampling.seeded
        if len(seeded) < len(seqs):
            noise.uniform_()
        for j in seeded:
            noise[j].uniform_(generator=self._generator(seqs[j]))
        return probs.div_(noise.log_().neg_()).argmax(dim=-1)

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
        return seq.generator


def sampling_logits(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """The logits sampled rows draw from: / temperature, then top_k, top_p, min_p.

    Tokens outside a row's kept set get -inf. temperature 0 rows are left at temperature 1
    (they are sampled by argmax elsewhere).
    """
    return SamplingTensors(params, logits.device, logits.dtype).apply(logits)


class SamplingTensors:
    """The per-row tensors of sampling_logits for a list of params (None: a stage no row needs),
    and the rows with a seed."""

    __slots__ = ("temperature", "top_k", "k_max", "top_p", "min_p", "seeded")

    def __init__(self, params: list[SamplingParams], device: torch.device, dtype: torch.dtype):
        self.temperature = to_device([1.0 if p.greedy else p.temperature for p in params], dtype,
                                      device).unsqueeze(1)
        self.top_k = self.top_p = self.min_p = None
        self.k_max = 0
        if any(p.top_k > 0 for p in params):
            self.top_k = to_device([p.top_k for p in params], torch.int64, device)
            self.k_max = max(p.top_k for p in params)
        if any(p.top_p < 1.0 for p in params):
            self.top_p = to_device([p.top_p for p in params], dtype, device)
        if any(p.min_p > 0.0 for p in params):
            self.min_p = to_device([p.min_p for p in params], dtype, device)
        self.seeded = [j for j, p in enumerate(params) if p.seed is not None]

    def apply(self, logits: Tensor) -> Tensor:
        # A low temperature can overflow a large logit: clamped as in the penalties.
        x = (logits / self.temperature).clamp_(max=torch.finfo(logits.dtype).max)
        if self.top_k is not None:
            x = apply_top_k(x, self.top_k, self.k_max)
        if self.top_p is not None:
            x = apply_top_p(x, self.top_p, head=CPU_NUCLEUS_HEAD if x.device.type == "cpu" else None)
        if self.min_p is not None:
            x = apply_min_p(x, self.min_p)
        return x


class BatchPlan:
    """What the sampler derives from the sampling params of a batch's sequences: which rows
    sample, which need logprobs, logit_bias, min_tokens or penalties, and the per-row
    tensors. Built when the batch's sequences change, reused while they do not (a
    sequence's params never change), so a steady decode step builds no parameter tensors."""

    def __init__(self, seqs: list[Sequence], vocab_size: int, device: torch.device, dtype: torch.dtype):
        self.seqs = list(seqs)
        self.device, self.dtype = device, dtype
        params = [s.params for s in seqs]
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        self.sampled_seqs = self.sampled_index = self.sampling = None
        if sampled_rows:
            if len(sampled_rows) == len(seqs):
                self.sampled_seqs = self.seqs
            else:
                self.sampled_index = to_device(sampled_rows, torch.int64, device)
                self.sampled_seqs = [seqs[i] for i in sampled_rows]
            self.sampling = SamplingTensors([s.params for s in self.sampled_seqs], device, dtype)
        self.logprobs = any(p.logprobs is not None for p in params)
        self.top_k_logprobs = max((p.logprobs or 0 for p in params), default=0)

        rows, cols, values = [], [], []
        for i, p in enumerate(params):
            for token, bias in (p.logit_bias or {}).items():
                if 0 <= token < vocab_size:
                    rows.append(i)
                    cols.append(token)
                    values.append(bias)
        self.bias_index = self.bias_values = None
        if rows:
            self.bias_index = tuple(to_device([rows, cols], torch.int64, device))
            self.bias_values = to_device(values, dtype, device)
        self.min_token_rows = [i for i, p in enumerate(params) if p.min_tokens > 0]
        # Rows with a grammar (it may not constrain them yet: still in the free reasoning).
        self.grammar_rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        self.forced_rows = [i for i, p in enumerate(params) if p.reasoning_budget is not None]

        self.penalty_rows = [i for i, p in enumerate(params) if p.needs_penalties]
        self.penalty_index = self.repetition = self.frequency = self.presence = None
        # The PenaltyStates the last step made for the penalty rows, and the batch tensors
        # [M, V] whose rows they are (Sampler._penalty_counts).
        self.penalty_states: list[PenaltyState] | None = None
        self.penalty_tensors: tuple[Tensor, Tensor] | None = None
        if self.penalty_rows:
            pp = [params[i] for i in self.penalty_rows]
            self.penalty_index = to_device(self.penalty_rows, torch.int64, device)
            if any(p.repetition_penalty != 1.0 for p in pp):
                self.repetition = to_device([p.repetition_penalty for p in pp], dtype, device).unsqueeze(1)
            if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in pp):
                self.frequency = to_device([p.frequency_penalty for p in pp], dtype, device).unsqueeze(1)
                self.presence = to_device([p.presence_penalty for p in pp], dtype, device).unsqueeze(1)


def apply_top_k(x: Tensor, top_k: Tensor, k_max: int) -> Tensor:
    """Keep each row's top_k largest logits (ties with the k-th kept; 0 = all) by torch.topk."""
    k_max = min(k_max, x.shape[-1])
    top = x.topk(k_max, dim=-1).values
    kth = top.gather(1, (top_k.clamp(1, k_max) - 1).unsqueeze(1))
    kth = kth.masked_fill((top_k == 0).unsqueeze(1), -math.inf)
    return x.masked_fill(x < kth, -math.inf)


# A full sort of a 49k-token row costs ~10 ms on a laptop CPU, topk(1024) a tenth of that.
CPU_NUCLEUS_HEAD = 1024


def apply_top_p(x: Tensor, top_p: Tensor, head: int | None = None) -> Tensor:
    """Keep the nucleus (vLLM/HF): the smallest set of most likely tokens whose mass reaches
    top_p. A token stays while the mass strictly above it is < top_p, so the most likely one
    always does (and tokens tied with the last one kept); top_p 1 keeps all.

    The masses come from each row's `head` most likely tokens (torch.topk) when those hold
    every row's nucleus, else from one full sort. That check reads a flag on the host: pass
    head only for CPU tensors.
    """
    if head is not None and head < x.shape[-1]:
        threshold, complete = _nucleus_threshold(x, top_p, x.topk(head, dim=-1).values)
        if complete.all():
            return x.masked_fill(x < threshold, -math.inf)
    threshold, _ = _nucleus_threshold(x, top_p, x.sort(dim=-1, descending=True).values)
    return x.masked_fill(x < threshold, -math.inf)


def _nucleus_threshold(x: Tensor, top_p: Tensor, head: Tensor) -> tuple[Tensor, Tensor]:
    """From each row's most likely logits (sorted descending): the lowest logit kept [N, 1]
    (-inf where top_p is 1), and whether the head holds the whole nucleus [N]."""
    probs = (head - x.logsumexp(dim=-1, keepdim=True)).exp()
    mass_above = probs.cumsum(dim=-1) - probs
    inside = mass_above < top_p.unsqueeze(1)
    # At least the first: a row whose masses are NaN (non-finite logits: the engine fails that
    # row) keeps an index the gather takes, so the other rows still sample.
    threshold = head.gather(1, (inside.sum(dim=-1, keepdim=True) - 1).clamp_(min=0))
    # Rows with top_p 1 keep everything, even where rounding lifts the cumulative mass to 1.
    off = top_p >= 1.0
    return threshold.masked_fill(off.unsqueeze(1), -math.inf), off | ~inside[:, -1]


def apply_min_p(x: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens with prob < min_p * max prob, i.e. x < max(x) + log(min_p) (min_p 0: none)."""
    threshold = x.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return x.masked_fill(x < threshold, -math.inf)


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small per-step tensor from host data; on CUDA through pinned memory, without a sync."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
