"""Scheduler: which sequences run each step, and how many of their tokens.

Continuous batching over one flat token batch: every step takes one token from each decoding
sequence and a chunk of the prompt from sequences still in prefill, under a token budget
(chunked prefill: a long prompt spans several steps). Running sequences come first, then
waiting ones in FIFO order. When a running sequence cannot get a block for its next tokens,
the most recently admitted running sequence is preempted by recompute: its blocks are freed
and it goes back to the front of the queue, to be prefilled again (prompt and output so far,
mostly from the prefix cache) later. The scheduler knows nothing of tensors.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tallow.config import EngineConfig
from tallow.engine.kv_cache import KVCacheManager
from tallow.engine.request import PENDING_TOKEN, Sequence, SequenceStatus
from tallow.errors import TallowError


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # seq.num_computed_tokens when scheduled
    num_new_tokens: int  # compute seq.token_ids[start:start + num_new_tokens] this step
    # Whether this row's chunk reaches the end of the sequence, so one token is sampled for it.
    # Fixed when scheduled: it stays true after update() has appended the sampled token.
    samples: bool = field(init=False)
    # Speculation: tokens proposed after the row's last one, computed in the same step (their
    # query rows follow the row's own; the verifier keeps the logits of all of them).
    draft: list[int] = field(default_factory=list)
    # Asynchronous jump-forward: tokens its grammar forced were appended to the sequence after
    # this row was launched (the step before sampled the token the grammar forces them after).
    # The row still computes that token's K/V; what it samples is not the sequence's, and is
    # dropped (the next step computes the forced tokens).
    dropped: bool = False

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_new_tokens == len(self.seq.token_ids)


def _place(row: ScheduledSeq, draft, decodes: list[ScheduledSeq], prefills: list[ScheduledSeq]) -> None:
    """A scheduled row into the step's decode rows (one token that samples) or its prefill rows
    (chunks, and rows carrying a speculative draft: their K+1 query rows). A one-token row of a
    forced output token that does not sample (jump-forward, one token per step) counts as a
    decode row too: a decode CUDA graph computes it, and its logits are not sampled. A speculating
    sequence's sampling row without a draft uses up one step of its pause (the adaptive
    off-switch counts its own rows, whichever path the step takes)."""
    if draft:
        row.draft = draft
        prefills.append(row)
        return
    one = row.num_new_tokens == 1 and (row.samples or row.start >= row.seq.num_prompt_tokens)
    (decodes if one else prefills).append(row)
    spec = row.seq.spec
    if spec is not None and row.samples:
        spec.step_without_draft()


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # decode rows first, then prefill chunks
    preempted: list[Sequence]
    num_batched_tokens: int
    # The leading rows that are decode rows (one token: it samples, or it is a forced output
    # token, see _place); None: not counted.
    num_decodes: int | None = None
    # Some row carries a draft: the engine verifies the step (tallow/engine/speculative/
    # verify.py) instead of sampling it plainly. A step without drafts is a plain one, whoever
    # is in it (CUDA graphs, asynchronous scheduling).
    speculative: bool = False

    @property
    def is_decode_only(self) -> bool:
        """Every row is one token (a step that CUDA graphs can replay); with num_decodes not
        counted, one that samples."""
        if self.num_decodes is not None:
            return 0 < self.num_decodes == len(self.scheduled)
        return bool(self.scheduled) and all(s.num_new_tokens == 1 and s.samples and not s.draft for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int):
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_chunk = config.long_prefill_token_threshold or config.max_num_batched_tokens
        # Jump-forward: while more sequences than this run, a sequence's forced output tokens
        # are computed one per step (None: as one chunk). EngineCore sets it (config's
        # jump_forward_chunk_max_seqs).
        self.forced_chunk_max_seqs: int | None = None
        self.pool_tokens = kv.num_blocks * kv.block_size  # no context can outgrow this
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions_total = 0
        # Queued or running sequences whose sampling reads their token ids on the host
        # (penalties, a reasoning budget): asynchronous scheduling waits for every step's tokens
        # while any is here.
        self.num_host_token_seqs = 0
        # Queued or running sequences with a grammar (their matchers advance after each step).
        self.num_grammar_seqs = 0
        # tallow/engine/speculative: set by the engine when the server speculates. Its sequences
        # (seq.spec) get drafts on their sampling rows; their proposals read token ids on the
        # host, so a step that may carry a draft is synchronous (may_draft), any other one
        # runs as a plain step.
        self.speculator = None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; raises TallowError if its prompt could never run."""
        if seq.max_model_len is None or seq.max_model_len > self.max_model_len:
            seq.max_model_len = self.max_model_len
        if seq.num_prompt_tokens >= self.max_model_len:
            raise TallowError(f"the prompt has {seq.num_prompt_tokens} tokens, but the context is "
                              f"{self.max_model_len} tokens, which leaves no room to generate",
                              param="prompt", code="context_length_exceeded")
        if seq.num_prompt_tokens > self.pool_tokens:
            raise TallowError(f"the prompt has {seq.num_prompt_tokens} tokens, more than the KV cache "
                              f"holds ({self.pool_tokens} tokens)",
                              param="prompt", code="context_length_exceeded")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        if self.speculator is not None:
            self.speculator.attach(seq)
        if _reads_host_tokens(seq):
            self.num_host_token_seqs += 1
        if seq.grammar is not None:
            self.num_grammar_seqs += 1

    def abort(self, seq: Sequence) -> None:
        """Finish seq with "abort" wherever it is, freeing its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:  # not there if add() rejected it
            self.waiting.remove(seq)
        self._finish(seq, "abort")

    def reject(self, seq: Sequence) -> None:
        """Finish with "error" a sequence that add() refused (it was never queued)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "error"

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        # Running sequences, oldest first: one token each when decoding, a chunk when in prefill.
        running, bs = self.running, self.kv.block_size
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.stopping:  # ends with the token its running step samples: nothing to compute
                i += 1
                continue
            computed = seq.num_computed_tokens
            n = min(len(seq.token_ids) - computed, budget, self.max_chunk)
            if (n > 1 and seq.grammar is not None and computed >= seq.num_prompt_tokens
                    and self.forced_chunk_max_seqs is not None and len(running) > self.forced_chunk_max_seqs):
                n = 1  # forced tokens, one per step: the step stays one a decode graph replays
            draft = ()
            if seq.spec is not None and computed + n == len(seq.token_ids):
                drafted = self._draft(seq, n, budget, len(running))
                if drafted is None:  # a decode row whose draft does not fit this step: the next one
                    i += 1
                    continue
                draft, n = drafted
            # A decode token whose slot is in a block the sequence holds needs no allocation
            # (allocate_slots would find nothing to do); anything else asks the KV cache.
            if n != 1 or draft or computed >= len(seq.block_table) * bs:
                while not self.kv.allocate_slots(seq, n + len(draft)):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        break
                if preempted and preempted[-1] is seq:
                    continue
            _place(ScheduledSeq(seq, seq.num_computed_tokens, n), draft, decodes, prefills)
            budget -= n + len(draft)
            i += 1

        # Waiting sequences in FIFO order, until one does not fit; none after a preemption
        # (a victim readmitted with a small chunk would only be preempted again).
        held_back: list[Sequence] = []  # n>1 siblings waiting for their prompt to be computed
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            if ((seq.prefill_after is not None and self.kv.enable_prefix_caching
                    and not _prompt_computed(seq.prefill_after))
                    or (seq.grammar is not None and seq.grammar.matcher is None)):
                # A sequence whose grammar is still compiling (EngineCore binds it when the
                # compile ends) waits without holding back the queue behind it.
                held_back.append(self.waiting.popleft())
                continue
            # Prompt logprobs need every prompt row's logits: no cached prefix until they are complete.
            blocks, num_cached = ([], 0) if seq.needs_prompt_logprobs else self.kv.get_computed_prefix(seq)
            n = min(seq.num_tokens - num_cached, budget, self.max_chunk)
            draft = ()
            if seq.spec is not None and num_cached + n == seq.num_tokens:
                drafted = self._draft(seq, n, budget, len(self.running) + 1)
                if drafted is None:
                    break
                draft, n = drafted
            if not self.kv.allocate_slots(seq, n + len(draft), blocks):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.prefill_after = None
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                # the prompt's share: tokens a grammar forced at the start sit after the prompt and
                # may be found cached too, but usage counts cached tokens as part of the prompt
                seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
            self.running.append(seq)
            _place(ScheduledSeq(seq, seq.num_computed_tokens, n), draft, decodes, prefills)
            budget -= n + len(draft)
        self.waiting.extendleft(reversed(held_back))

        num_decodes = len(decodes)
        decodes.extend(prefills)
        speculative = self.speculator is not None and any(s.draft for s in prefills)
        return SchedulerOutput(decodes, preempted, self.max_num_batched_tokens - budget, num_decodes, speculative)

    def may_draft(self) -> bool:
        """Whether the next schedule() could give some row a draft, judged before the tokens of
        the step still running are known (asynchronous scheduling): running speculating
        sequences, and the waiting ones it could admit (as many as there are free slots, those
        it would hold back skipped). False: the step can be launched as a plain one."""
        spec = self.speculator
        if spec is None:
            return False
        pool = self.pool_tokens
        batch = len(self.running)
        for seq in self.running:
            if seq.spec is not None and not seq.stopping and spec.may_draft(seq, pool, batch):
                return True
        room = self.max_num_seqs - len(self.running)
        for seq in self.waiting:
            if room <= 0:
                break
            if ((seq.prefill_after is not None and self.kv.enable_prefix_caching
                    and not _prompt_computed(seq.prefill_after))
                    or (seq.grammar is not None and seq.grammar.matcher is None)):
                continue
            room -= 1
            if seq.spec is not None and spec.may_draft(seq, pool, batch + 1):
                return True
        return False

    def _draft(self, seq: Sequence, n: int, budget: int, batch: int) -> tuple[list[int], int] | None:
        """The draft of a speculating sequence's row of n tokens that reaches its end, and the
        row's tokens. The draft is never cut to the step's budget (a seeded sequence's text
        would depend on the batch): a row it does not fit gets no draft and stops one token
        short of the end, so it does not sample (a prefill chunk), or waits for the next step
        (None: a decode row). batch: the sequences running with it (the price of its rows,
        Speculator.draft_length)."""
        draft = self.speculator.propose(seq, self.pool_tokens, batch)
        if n + len(draft) <= budget:
            return draft, n
        return None if n == 1 else ([], n - 1)

    def update(self, out: SchedulerOutput, sampled: list[int], runs: list[list[int]] | None = None) -> list[Sequence]:
        """Apply one step's results; sampled holds one token per sampling row, in order.
        A verified speculative step gives runs instead (tokens per sampling row, see
        _update_speculative); each run is cut to the tokens the sequence kept.

        Returns the sequences that finished in this step.
        """
        if runs is not None:
            return self._update_speculative(out, runs)
        finished: list[Sequence] = []
        k = 0
        now = time.monotonic()
        kv, bs = self.kv, self.kv.block_size
        caching = kv.enable_prefix_caching
        FINISHED = SequenceStatus.FINISHED
        for s in out.scheduled:
            seq = s.seq
            if seq.status is FINISHED:  # aborted while the step ran
                k += s.samples
                continue
            n = s.num_new_tokens
            seq.num_computed_tokens += n
            # A decode token fills a block only at a block boundary; cache_full_blocks has
            # registered every block that was full before.
            if caching and (n != 1 or seq.num_computed_tokens % bs == 0):
                kv.cache_full_blocks(seq)
            if not s.samples:
                continue
            seq.append_token(sampled[k])
            k += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = seq.check_stop()
            # The next step computes the new token: it needs slots for the whole context.
            if reason is None and len(seq.token_ids) > self.pool_tokens:
                reason = "length"
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        if finished:
            self.running = [seq for seq in self.running if not seq.is_finished]
        return finished

    def _update_speculative(self, out: SchedulerOutput, runs: list[list[int]]) -> list[Sequence]:
        """update() of a step with drafts. A row whose draft had k tokens, of which the first
        a were accepted, emits a + 1 tokens (runs[i]); its computed K/V are its own tokens and
        the accepted ones, the slots of the rejected ones are dropped and blocks that held only
        those go back to the pool. Tokens are appended one at a time with the stop checks, so a
        run that stops (a stop id, eos, the length) is cut there."""
        finished: list[Sequence] = []
        k = 0
        now = time.monotonic()
        kv = self.kv
        caching = kv.enable_prefix_caching
        FINISHED = SequenceStatus.FINISHED
        for s in out.scheduled:
            seq = s.seq
            if seq.status is FINISHED:  # aborted (or failed) while the step ran
                if s.samples:
                    runs[k] = []
                    k += 1
                continue
            if not s.samples:
                seq.num_computed_tokens += s.num_new_tokens
                if caching:
                    kv.cache_full_blocks(seq)
                continue
            run = runs[k]
            reason = None
            taken = 0
            for token in run:
                seq.append_token(token)
                taken += 1
                reason = seq.check_stop()
                if reason is None and len(seq.token_ids) > self.pool_tokens:
                    reason = "length"
                if reason is not None:
                    break
            del run[taken:]
            k += 1
            # The row's own tokens and the accepted draft tokens among those kept.
            seq.num_computed_tokens += s.num_new_tokens + taken - 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            if caching:
                kv.cache_full_blocks(seq)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
            elif s.draft:
                kv.trim(seq)
        if finished:
            self.running = [seq for seq in self.running if not seq.is_finished]
        return finished

    def update_launched(self, out: SchedulerOutput) -> None:
        """Asynchronous scheduling: apply a step that was launched but whose tokens are not
        known yet. Each sampling row's sequence gets PENDING_TOKEN as its last token (with
        pending_row, its row in the step's sampled ids), so the next step can be scheduled
        now; resolve() writes the real ids in. A sequence whose length limit ends it with
        that token is marked stopping and not scheduled again.

        Call it after resolve() of the step before: prefix-cache hashing reads the token ids
        of the blocks this step completes, and the last of those came from that step."""
        k = 0
        kv, bs = self.kv, self.kv.block_size
        caching = kv.enable_prefix_caching
        FINISHED = SequenceStatus.FINISHED
        for s in out.scheduled:
            seq = s.seq
            if seq.status is FINISHED:  # finished by the step before, or aborted
                k += s.samples
                continue
            n = s.num_new_tokens
            seq.num_computed_tokens += n
            if caching and (n != 1 or seq.num_computed_tokens % bs == 0):
                kv.cache_full_blocks(seq)
            if not s.samples:
                continue
            if s.dropped:
                k += 1
                continue
            seq.token_ids.append(PENDING_TOKEN)
            seq.pending_row = k
            k += 1
            if (len(seq.token_ids) - seq.num_prompt_tokens >= seq.max_output_tokens
                    or len(seq.token_ids) > self.pool_tokens):
                seq.stopping = True

    def resolve(self, out: SchedulerOutput, sampled: list[int]) -> list[Sequence]:
        """Asynchronous scheduling: the tokens of a step applied with update_launched have
        reached the host. Writes them in and checks the stop conditions; returns the
        sequences that finished (a preempted one is taken off the waiting queue)."""
        finished: list[Sequence] = []
        k = 0
        now = time.monotonic()
        FINISHED = SequenceStatus.FINISHED
        for s in out.scheduled:
            if not s.samples:
                continue
            seq, token = s.seq, sampled[k]
            k += 1
            if seq.status is FINISHED or s.dropped:
                continue
            pos = s.start + s.num_new_tokens
            seq.token_ids[pos] = token
            seq.pending_row = -1
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = seq.check_stop()
            if reason is None and len(seq.token_ids) > self.pool_tokens:
                reason = "length"
            if reason is not None:
                if seq.status is SequenceStatus.WAITING:
                    self.waiting.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        if finished:
            self.running = [seq for seq in self.running if not seq.is_finished]
        return finished

    def fail(self, out: SchedulerOutput) -> list[Sequence]:
        """The step raised: finish every sequence it scheduled with "error"."""
        failed = [s.seq for s in out.scheduled if not s.seq.is_finished]
        for seq in failed:
            self._finish(seq, "error")
        self.running = [seq for seq in self.running if not seq.is_finished]
        return failed

    def fail_sequences(self, seqs: list[Sequence], reason: str = "error") -> None:
        """Finish with `reason` ("error": their own row of a step went wrong, the rest of the
        step stands; "stop": their grammar is complete) sequences wherever they are queued now."""
        for seq in seqs:
            if seq.is_finished:
                continue
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
            elif seq in self.waiting:  # preempted since the step was scheduled
                self.waiting.remove(seq)
            self._finish(seq, reason)

    def check_invariants(self) -> None:
        """Every queued sequence is in the state of its queue; the KV cache is consistent."""
        assert all(seq.status is SequenceStatus.RUNNING and seq.block_table for seq in self.running)
        assert all(seq.status is SequenceStatus.WAITING and not seq.block_table for seq in self.waiting)
        assert len(self.running) <= self.max_num_seqs
        self.kv.check_invariants()

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.token_ids[-1] == PENDING_TOKEN:  # aborted (or failed) while its step runs: never sampled
            seq.token_ids.pop()
            seq.pending_row = -1
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq)
        if _reads_host_tokens(seq):
            self.num_host_token_seqs -= 1
        if seq.grammar is not None:
            self.num_grammar_seqs -= 1
            seq.grammar.release()
        if seq.spec is not None and self.speculator is not None:
            self.speculator.release(seq)


def _reads_host_tokens(seq: Sequence) -> bool:
    """The sampler reads the sequence's token ids on the host before its next token: penalties
    count them, a reasoning budget watches them. A grammar's mask follows them too, but the
    engine fills it after the step before is resolved, while the device runs this step's forward
    (EngineCore._step_async), so grammar rows do not make steps synchronous. A speculating
    sequence is not counted either: only its steps that may carry a draft wait for its tokens
    (Scheduler.may_draft)."""
    return seq.params.needs_host_tokens


def _prompt_computed(seq: Sequence) -> bool:
    return seq.is_finished or seq.num_computed_tokens >= seq.num_prompt_tokens
