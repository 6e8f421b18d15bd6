"""EngineCore: the step loop (schedule -> run -> sample -> update) and the requests' sequences.

The thread that steps it for the server is AsyncEngine's (tallow/engine/async_engine.py); the
offline API and the CLI step it themselves.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, replace
from typing import Callable

import torch

from tallow.config import EngineConfig
from tallow.engine.grammar import GrammarState, grammar_backend, register_vocab_width
from tallow.engine.kv_cache import KVCacheManager
from tallow.engine.request import Sequence, SequenceStatus
from tallow.engine.runner import LaunchedStep, ModelRunner, StepResult, available_host_memory, kv_bytes_per_block
from tallow.engine.sampling import SamplingParams
from tallow.engine.scheduler import Scheduler, SchedulerOutput
from tallow.errors import TallowError
from tallow.models.engine_model import load_engine_model, load_tokenizer, resolve_device, resolve_dtype

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenOutput:
    """New tokens of one sequence since its previous output."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None  # on the last output: "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    stop_token_id: int | None = None
    # Jump-forward tokens among the sequence's output so far (appended without sampling because
    # its grammar allowed nothing else: usage.fill); the final output's is the total.
    fill: int = 0
    # With the first token of a sequence that asked for them: the PromptLogprobs of prompt tokens
    # 1 .. P-1 (tallow/engine/prompt_logprobs.py); the first prompt token has none.
    prompt_logprobs: list | None = None
    # A speculating sequence's (draft tokens proposed, accepted) over the steps of this output;
    # None for a sequence that does not speculate.
    speculation: tuple[int, int] | None = None
    # With finish_reason "error" that the request caused (Sequence.error): why.
    error: str | None = None


def final_output(seq: Sequence) -> TokenOutput:
    """The last output of a sequence that ended without a new token (abort, error)."""
    return TokenOutput([], None, None, seq.finish_reason or "abort", seq.num_prompt_tokens, seq.num_cached_tokens,
                       fill=_fill(seq), error=seq.error)


def _fill(seq: Sequence) -> int:
    return 0 if seq.grammar is None else seq.grammar.fill


class EngineCore:
    """Owns the model runner, the KV cache manager and the scheduler; step() advances all.

    With config.tensor_parallel_size > 1 it also starts the worker processes of the other
    ranks and holds rank 0's shard of the model; call shutdown() to stop them."""

    def __init__(self, config: EngineConfig, loaded=None, draft_loaded=None):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        t0 = time.monotonic()
        self.workers = self._start_workers(loaded) if config.tensor_parallel_size != 1 else None
        self._draft_loaded = draft_loaded
        try:
            self._build(loaded)
        except BaseException:
            self.shutdown()
            raise
        self.load_seconds = time.monotonic() - t0
        kernels = ""
        if self.device.type == "cpu":
            from tallow.ops import cpu_native

            kernels = f", CPU kernels {cpu_native.kernels_in_use()}"
        log.info("engine ready: %s on %s/%s, %d KV blocks of %d tokens (%s), quantization %s, tensor parallel %d%s, "
                 "%.2fs", self.model_name, self.device, str(self.dtype).removeprefix("torch."), self.runner.num_blocks,
                 config.block_size, str(self.kv_dtype).removeprefix("torch."), self.quantization,
                 config.tensor_parallel_size, kernels, self.load_seconds)

    def _start_workers(self, loaded):
        """Check that the model splits in tensor_parallel_size shards, then start the other ranks."""
        from tallow.distributed.workers import TensorParallelWorkers
        from tallow.models.loader import read_model_config, registered_source
        from tallow.models.sharding import validate_tensor_parallel

        size, source = self.config.tensor_parallel_size, self.config.model
        registered = registered_source(source)
        if loaded is not None or registered is not None:
            what = "a preloaded model" if loaded is not None else registered.description
            raise TallowError(f"tensor_parallel_size {size}: {what} cannot be sharded (each rank loads its "
                              "own shard from the model source)", param="tensor_parallel_size")
        validate_tensor_parallel(read_model_config(source), size)
        if self.device.type == "cuda":
            available = torch.cuda.device_count() - (self.device.index or 0)
            if size > available:
                raise TallowError(f"tensor_parallel_size {size} needs {size} GPUs from {self.device} on, but "
                                  f"{available} are visible", param="tensor_parallel_size")
        return TensorParallelWorkers(self.config, self.device, ModelRunner.for_engine)

    def _build(self, loaded) -> None:
        """Load the model (rank 0's shard with tensor parallelism), size the KV cache, and
        build the runner, the KV cache manager and the scheduler."""
        config = self.config
        parallel = None if self.workers is None else self.workers.parallel
        built = load_engine_model(config, self.device, parallel=parallel, loaded=loaded)
        loaded = built.loaded
        self.loaded = loaded
        self.model_config = loaded.config
        self.model_name = loaded.name
        self.tokenizer = load_tokenizer(loaded.tokenizer_source)
        if config.chat_template is not None:  # a missing file or a broken template fails the start
            from tallow.chat_template import ChatTemplate

            ChatTemplate.for_tokenizer(self.tokenizer, override=config.chat_template)
        self.quantization = built.quantization
        cfg = self.model_config
        if config.max_model_len and config.max_model_len > cfg.max_position_embeddings:
            raise TallowError(f"max_model_len {config.max_model_len} is more than {self.model_name}'s context of "
                              f"{cfg.max_position_embeddings} tokens (max_position_embeddings)", param="max_model_len")
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(cfg.eos_token_id)
        self.kv_dtype = built.kv_dtype
        draft = self._load_draft_model() if config.speculative_method == "draft" else None
        draft_per_block = 0 if draft is None else kv_bytes_per_block(draft.loaded.config, config.block_size,
                                                                     draft.kv_dtype)
        num_blocks = config.num_kv_blocks or self._num_blocks_from_budget(draft_per_block)
        self.runner = ModelRunner.for_engine(built, config, num_blocks, max_model_len=self.max_model_len,
                                             parallel=parallel)
        # One block of every layer's K and V in this process (rank 0's heads with tensor parallelism).
        self.kv_block_bytes = sum(k[0].nbytes + v[0].nbytes for k, v in self.runner.kv_caches)
        if self.workers is not None:
            self.workers.wait_ready(num_blocks)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len)
        # Structured output: sequences whose grammar is compiling (bound or failed at the next
        # step), and whether forced tokens are appended without sampling.
        register_vocab_width(self.tokenizer, self.model_config.vocab_size)
        self._compiling: list[Sequence] = []
        self.jump_forward = config.grammar_jump_forward
        cap = config.jump_forward_chunk_max_seqs
        if cap is not None and cap < 0:
            raise TallowError(f"jump_forward_chunk_max_seqs must be at least 0, got {cap}",
                              param="jump_forward_chunk_max_seqs")
        self.scheduler.forced_chunk_max_seqs = cap
        self.speculator = None
        if config.speculative_method:
            from tallow.engine.speculative import Speculator

            if self.workers is not None:
                raise TallowError("speculative decoding does not work with tensor parallelism yet",
                                  param="speculative_method")
            proposer = None
            if draft is not None:
                from tallow.engine.speculative.draft import DraftModelProposer

                # Its own KV cache of num_blocks blocks of its shape (the budget held both); on
                # CUDA its one-token draft steps replay its own decode graphs.
                runner = ModelRunner.for_engine(draft, dataclasses.replace(config, speculative_method=None), num_blocks,
                                                max_model_len=self.max_model_len)
                proposer = DraftModelProposer(runner, config.block_size)
            self.speculator = self.scheduler.speculator = Speculator(config, self.device.type, proposer)
        self.async_scheduling = self._async_scheduling()
        # Asynchronous scheduling: the launched step whose tokens have not been read yet.
        self._inflight: tuple[SchedulerOutput, LaunchedStep | None] | None = None
        self.num_steps = 0
        self.num_overlapped_steps = 0  # launched while the step before was still pending
        self.num_verified_steps = 0  # steps with speculative drafts (verified, synchronous)
        # Asynchronous steps with grammar rows, sampled after the step before was resolved.
        self.num_masked_after_resolve = 0
        self.num_dropped_rows = 0  # rows launched before their sequence's forced tokens were known
        self.num_generated_tokens = 0
        # seq_id -> (monotonic time, first position, tokens) of each prefill chunk, kept only for
        # sequences submitted with trace_prefill (request traces); empty otherwise.
        self.prefill_log: dict[int, list[tuple[float, int, int]]] = {}

    def _async_scheduling(self) -> bool:
        mode = self.config.async_scheduling
        if mode not in (True, False, "auto"):
            raise TallowError(f"async_scheduling must be auto, true or false, got {mode!r}", param="async_scheduling")
        if self.workers is not None:
            if mode is True:
                raise TallowError("asynchronous scheduling does not work with tensor parallelism yet (the other "
                                  "ranks need each step's token ids on the host)", param="async_scheduling")
            return False
        return self.device.type == "cuda" if mode == "auto" else mode

    def shutdown(self, graceful: bool = True) -> None:
        """Stop and join the tensor-parallel workers, if any (idempotent). graceful: no step is
        in flight, so the workers can be told to stop; otherwise they are killed."""
        if self.workers is not None:
            self.workers.shutdown(graceful)
            self.workers = None

    def _load_draft_model(self):
        """The draft model of speculative_method "draft": loaded as the model is, on its device."""
        c = self.config
        if self._draft_loaded is None and not c.speculative_model:
            raise TallowError("speculative_method 'draft' needs a speculative_model", param="speculative_model")
        if self.workers is not None:
            raise TallowError("speculative decoding does not work with tensor parallelism yet",
                              param="speculative_method")
        draft = load_engine_model(dataclasses.replace(c, model=c.speculative_model or c.model), self.device,
                                  loaded=self._draft_loaded)
        if draft.loaded.config.vocab_size != self.model_config.vocab_size:
            raise TallowError(f"the draft model's vocabulary ({draft.loaded.config.vocab_size} tokens) is not the "
                              f"model's ({self.model_config.vocab_size})", param="speculative_model")
        return draft

    def _num_blocks_from_budget(self, extra_per_block: int = 0) -> int:
        cfg, c = self.model_config, self.config
        per_block = kv_bytes_per_block(cfg, c.block_size, self.kv_dtype) + extra_per_block
        if self.workers is not None:
            # Each rank caches its own KV heads (some replicated when there are fewer than
            # ranks); on the CPU every rank's cache is in the same host memory.
            from tallow.models.sharding import ShardLayout

            size = c.tensor_parallel_size
            per_block = per_block // cfg.num_key_value_heads * ShardLayout.of(cfg, 0, size).num_kv_heads
            if self.device.type == "cpu":
                per_block *= size
        if c.kv_cache_memory_bytes is not None:
            budget = c.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            budget = int(total * c.gpu_memory_utilization) - used_by_others - 2 * 1024**3
        else:
            budget = min(int(available_host_memory() * c.cpu_kv_cache_fraction), c.cpu_kv_cache_max_bytes)
        # Never more than the whole context of max_num_seqs sequences needs.
        max_useful = c.max_num_seqs * ((self.max_model_len + c.block_size - 1) // c.block_size) + 1
        num = min(budget // per_block, max_useful)
        if num < (self.max_model_len + c.block_size - 1) // c.block_size // 8 or num < 4:
            raise TallowError(f"KV cache budget of {budget} bytes holds only {num} blocks", status=500,
                              type="server_error")
        return int(num)

    # ---- requests --------------------------------------------------------------------
    def make_sequences(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> list[Sequence]:
        if len(prompt_ids) >= self.max_model_len:
            raise TallowError(f"the prompt has {len(prompt_ids)} tokens, but the context limit is "
                              f"{self.max_model_len} tokens", param="prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise TallowError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        first = Sequence(prompt_ids, params, eos_token_ids=self.eos_token_ids,
                         max_model_len=self.max_model_len, request_id=request_id)
        seqs = [first]
        for i in range(1, params.n):
            # A seeded request's choices differ: choice i samples with seed + i (as vLLM does).
            # The sum wraps around the signed 64-bit range a seed must stay in.
            child = params if params.seed is None else replace(params, seed=(params.seed + i + 2**63) % 2**64 - 2**63)
            if child.prompt_logprobs is not None:  # the prompt is scored once, by the first choice
                child = replace(child, prompt_logprobs=None)
            seqs.append(Sequence(prompt_ids, child, eos_token_ids=self.eos_token_ids,
                                 max_model_len=self.max_model_len,
                                 request_id=f"{first.request_id}-{i}", prefill_after=first))
        return seqs

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; raises TallowError if its prompt could never run (see reject).

        A sequence with a grammar starts its compile (or finds it cached) and waits in the queue
        until it is compiled; check_grammar has usually started it already."""
        spec = seq.params.grammar
        if spec is not None and seq.grammar is None:
            seq.grammar = GrammarState(spec, grammar_backend(self.tokenizer))
        self.scheduler.add(seq)
        if seq.grammar is not None and seq.grammar.matcher is None:
            self._compiling.append(seq)

    def _bind_grammars(self) -> list[tuple[Sequence, TokenOutput]]:
        """Give each sequence whose compile has ended its matcher (it can be scheduled now); end
        with "error" those whose compile failed or ran past the limit."""
        pending = [s for s in self._compiling if not s.is_finished]
        now = time.monotonic()
        failed: list[Sequence] = []
        self._compiling = []
        for seq in pending:
            g = seq.grammar
            if g.ready:
                error = g.bind()
                if error is None and self.jump_forward:
                    # Forced from the start: prefilled with the prompt, sent with the first token.
                    room = min(seq.max_output_tokens, self.scheduler.pool_tokens - len(seq.token_ids))
                    forced = g.start_forced(room)
                    if forced:
                        seq.token_ids.extend(forced)
                        g.fill += len(forced)
                        g.unsent = forced
            elif g.overdue(now):
                error = f"the grammar did not compile within {g.backend.limits.compile_timeout_s:g} s"
            else:
                self._compiling.append(seq)
                continue
            if error is not None:
                log.error("request %s: its grammar cannot be used: %s", seq.request_id, error)
                seq.error = f"its grammar cannot be used: {error}"
                failed.append(seq)
        self.scheduler.fail_sequences(failed)
        return [(seq, final_output(seq)) for seq in failed]

    def reject(self, seq: Sequence) -> TokenOutput:
        """End with finish_reason "error" a sequence that add() refused; its final output."""
        self.scheduler.reject(seq)
        self.prefill_log.pop(seq.seq_id, None)
        return final_output(seq)

    def abort(self, seq: Sequence) -> TokenOutput | None:
        """End a sequence with "abort", freeing its blocks; its final output (None when it had
        ended already)."""
        if seq.is_finished:
            return None
        self.scheduler.abort(seq)
        self.prefill_log.pop(seq.seq_id, None)
        return final_output(seq)

    def trace_prefill(self, seq: Sequence) -> list[tuple[float, int, int]]:
        """Record the prefill chunks of a sequence not added yet: the list that step() fills with
        (monotonic time, first position, tokens) per chunk. The core forgets it when the
        sequence ends; the list stays the caller's."""
        chunks: list[tuple[float, int, int]] = []
        self.prefill_log[seq.seq_id] = chunks
        return chunks

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def step(self) -> list[tuple[Sequence, TokenOutput]]:
        """One schedule -> run -> sample -> update round. Returns the outputs of this step;
        with asynchronous scheduling, those of the step before (this one is left running)."""
        bound = self._bind_grammars() if self._compiling else []
        outputs = self._step_async() if self.async_scheduling else self._step_sync()
        if bound:
            outputs = bound + outputs
        if self._compiling and not self.scheduler.running and self._inflight is None:
            # Nothing runs: wait a moment for a compile rather than spin (the caller steps again).
            futures_wait([s.grammar.future for s in self._compiling if s.grammar.future is not None],
                         timeout=0.05, return_when=FIRST_COMPLETED)
        if self.prefill_log:
            for seq, out in outputs:
                if out.finish_reason is not None:
                    self.prefill_log.pop(seq.seq_id, None)
        return outputs

    def _step_async(self) -> list[tuple[Sequence, TokenOutput]]:
        """Schedule and launch step N+1 while step N runs, then read step N's tokens.

        The order keeps the device busy: scheduling and batch preparation of N+1 happen
        while N computes, N+1 is queued behind N, and N's outputs are processed while N+1
        computes. N+1's decode rows read the tokens N samples from N's sampled ids on the
        device. A sequence that N finishes (a stop token) has run one step too many in N+1:
        that token is dropped. Penalties read token ids on the host, so while a sequence
        with penalties is queued every step waits for its own tokens (the synchronous step).
        With speculation, only a step that may carry a draft waits (Scheduler.may_draft: a
        speculating sequence whose proposer could find something after its pending token);
        any other step is launched as plain decoding's. Grammar rows do not wait: the step's
        forward is queued, N resolved (the matchers consume N's tokens) while it runs, then
        the masks are filled (in parallel over the rows) and N+1 sampled. A sequence whose
        grammar forces tokens after N's token (jump-forward) has its N+1 row dropped: that
        row computed N's token, and the next step computes the forced ones.
        """
        prev = self._inflight
        self._inflight = None
        sched = self.scheduler
        if sched.num_host_token_seqs or (self.speculator is not None and sched.may_draft()):
            outputs = self._resolve(*prev) if prev is not None else []
            return outputs + self._step_sync()
        out = sched.schedule()
        launched = fwd = None
        prev_ids = None if prev is None or prev[1] is None else prev[1].token_ids
        # A grammar row's mask follows the token the step still running samples: this step's
        # forward is queued first, that step resolved (its tokens advance the matchers) while
        # the device computes, then the masks filled and this step sampled.
        split = sched.num_grammar_seqs > 0 and any(s.samples and s.seq.grammar is not None for s in out.scheduled)
        if out.scheduled:
            if self.prefill_log:
                self._log_prefill_chunks(out)
            try:
                fwd = self.runner.forward(out, prev_ids)
                if not split:
                    launched = self.runner.sample(out, fwd)
            except Exception:
                outputs = self._resolve(*prev) if prev is not None else []
                return outputs + self._fail_step(out)
            self.num_steps += 1
            if prev_ids is not None:
                self.num_overlapped_steps += 1
        # With grammar rows, this step is sampled as soon as the step before is applied (the
        # matchers advanced); that step's outputs are made after.
        applied = self._apply(*prev, following=out) if prev is not None else list
        if out.scheduled and split:
            self.num_masked_after_resolve += 1
            try:
                launched = self.runner.sample(out, fwd)
            except Exception:
                return applied() + self._fail_step(out)
        outputs = applied()
        if out.scheduled:
            # After the resolve: the blocks this step completes hash the tokens it read.
            sched.update_launched(out)
            if launched is not None:
                self._inflight = (out, launched)
        if not sched.running and self._inflight is None:
            self.runner.sampler.release()
        return outputs

    def _resolve(self, out: SchedulerOutput, launched: LaunchedStep | None,
                 following: SchedulerOutput | None = None) -> list[tuple[Sequence, TokenOutput]]:
        """Read a launched step's tokens and apply them: the outputs of its live sequences.
        Grammar rows' matchers consume the tokens; where a grammar forces tokens next
        (jump-forward), they are appended and the sequence's row in `following` (the step
        launched since, which computes the token just read) is marked dropped."""
        return self._apply(out, launched, following)()

    def _apply(self, out: SchedulerOutput, launched: LaunchedStep | None,
               following: SchedulerOutput | None = None) -> Callable[[], list[tuple[Sequence, TokenOutput]]]:
        """_resolve() up to its outputs, which the returned function makes (so a step can be
        sampled between the two)."""
        if launched is None:
            return list
        finished = SequenceStatus.FINISHED
        live = [s.samples and not s.dropped and s.seq.status is not finished for s in out.scheduled]
        try:
            res = self.runner.collect(launched)
        except Exception:
            failed = self._fail_step(out)
            return lambda: failed
        self._fail_invalid_rows(out, res)
        self._gather_prompt_logprobs(res)
        self.scheduler.resolve(out, res.token_ids)
        forced = self._advance_grammars(out, following) if self.scheduler.num_grammar_seqs else None
        return lambda: self._outputs(out, res, live, forced=forced)

    def _fail_step(self, out: SchedulerOutput) -> list[tuple[Sequence, TokenOutput]]:
        shape = [(s.seq.seq_id, s.start, s.num_new_tokens) for s in out.scheduled]
        log.exception("engine step failed; failing its %d sequences (seq, start, tokens): %s", len(shape), shape)
        failed = self.scheduler.fail(out)
        return [(seq, final_output(seq)) for seq in failed]

    def _fail_invalid_rows(self, out: SchedulerOutput, res: StepResult) -> None:
        """Fail alone each sequence whose sampling row had no finite logits (the sampler flags
        them): the other rows' tokens stand."""
        if not res.invalid_rows:
            return
        sampling = [s for s in out.scheduled if s.samples]
        failed = [sampling[i].seq for i in res.invalid_rows if not (sampling[i].seq.is_finished or sampling[i].dropped)]
        for seq in failed:
            if seq.grammar is not None and seq.num_output_tokens < seq.params.min_tokens:
                # every token masked: the grammar allows only the end, which min_tokens holds back
                seq.error = (f"min_tokens {seq.params.min_tokens} cannot be met: its grammar allows only "
                             f"the end of the output after {seq.num_output_tokens} tokens")
                log.warning("request %s: %s", seq.request_id, seq.error)
                continue
            log.error("request %s: its logits were not finite at output token %d; failing it alone",
                      seq.request_id, seq.num_output_tokens)
        self.scheduler.fail_sequences(failed)

    def _step_sync(self) -> list[tuple[Sequence, TokenOutput]]:
        if self.speculator is not None:
            self.speculator.prepare(self.scheduler.running, self.scheduler.pool_tokens)
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        if self.prefill_log:
            self._log_prefill_chunks(out)
        try:
            res = self._verify(out) if out.speculative else self.runner.run(out)
        except Exception:
            return self._fail_step(out)
        self.num_steps += 1
        self.num_verified_steps += out.speculative
        self._fail_invalid_rows(out, res)
        self._gather_prompt_logprobs(res)
        if out.speculative:
            self.scheduler.update(out, res.token_ids, res.runs)
            self._record_speculation(out, res)
        else:
            self.scheduler.update(out, res.token_ids)
        # After either update: each grammar row's matcher consumes its token, or its verified run.
        forced = (self._advance_grammars(out, runs=res.runs if out.speculative else None)
                  if self.scheduler.num_grammar_seqs else None)
        if not self.scheduler.running:  # nothing runs on: the sampler's cached batch plan is stale
            self.runner.sampler.release()
        return self._outputs(out, res, forced=forced)

    @staticmethod
    def _gather_prompt_logprobs(res: StepResult) -> None:
        """Keep each sequence's prompt logprobs of the step until its first output carries them."""
        for seq, entries in res.prompt_logprobs:
            if not seq.prompt_logprobs_sent:
                seq.prompt_logprobs.extend(entries)

    def _advance_grammars(self, out: SchedulerOutput, following: SchedulerOutput | None = None,
                          runs: list[list[int]] | None = None) -> dict[int, list[int]] | None:
        """Each grammar row's matcher consumes the token just sampled (runs: a verified step's
        runs per sampling row, as the scheduler kept them: all of the run's tokens); a complete
        grammar ends its sequence ("stop"); tokens the grammar forces next are appended
        (jump-forward, within the length limits): seq_id -> those tokens. following: the step
        launched since (asynchronous scheduling), whose row of a sequence given forced tokens is
        dropped."""
        forced: dict[int, list[int]] = {}
        ended: dict[str, list[Sequence]] = {}
        pool_tokens = self.scheduler.pool_tokens
        next_rows = None
        i = -1  # sampling row
        for s in out.scheduled:
            seq = s.seq
            g = seq.grammar
            i += bool(s.samples)
            if g is None or not s.samples or s.dropped or seq.is_finished:
                continue
            new = len(runs[i]) if runs is not None else 1
            if new == 0:
                continue
            reason, tokens = g.advance(seq.token_ids, seq.num_prompt_tokens, self.jump_forward, new)
            if tokens:
                room = min(seq.max_output_tokens - seq.num_output_tokens, pool_tokens - len(seq.token_ids))
                take = tokens[:max(room, 0)]
                seq.token_ids.extend(take)
                g.fill += len(take)
                forced[seq.seq_id] = take
                if take and following is not None:
                    if next_rows is None:
                        next_rows = {r.seq.seq_id: r for r in following.scheduled if r.samples}
                    row = next_rows.get(seq.seq_id)
                    if row is not None:
                        row.dropped = True
                        self.num_dropped_rows += 1
                if len(take) < len(tokens) or (reason is None and seq.num_output_tokens >= seq.max_output_tokens):
                    reason = "length"
            if reason == "error":
                seq.error = f"its grammar left no way to go on: {g.error}"
                log.error("request %s: %s", seq.request_id, seq.error)
            if reason is not None:
                ended.setdefault(reason, []).append(seq)
        for reason, seqs in ended.items():
            self.scheduler.fail_sequences(seqs, reason)
        return forced

    def _verify(self, out: SchedulerOutput):
        """A step with speculating rows: the forward's logits of every draft position, verified
        (tallow/engine/speculative/verify.py), and the prompt logprobs of its prefill rows as a
        plain step has them. Always synchronous."""
        from tallow.engine.speculative import verify_step

        with torch.inference_mode():
            logits = self.runner.logits(out)
            res = verify_step(self.runner.sampler, logits, out)
        res.prompt_logprobs = self.runner.take_prompt_logprobs()
        return res

    def _record_speculation(self, out: SchedulerOutput, res) -> None:
        i = 0
        for s in out.scheduled:
            if not s.samples:
                continue
            if s.seq.spec is not None and res.runs[i] and res.proposed[i]:
                self.speculator.record(s.seq, res.proposed[i], res.accepted[i])
            i += 1

    def _outputs(self, out: SchedulerOutput, res: StepResult, live: list[bool] | None = None,
                 forced: dict[int, list[int]] | None = None) -> list[tuple[Sequence, TokenOutput]]:
        """A TokenOutput per sampling row (per row where live is true, when given), with the
        tokens its grammar forced after the sampled one (logprob 0: the only choice). A verified
        speculative step (res.runs) gives each row its run as the scheduler kept it, and the
        row's (proposed, accepted) when its sequence speculates."""
        outputs = []
        i = 0
        token_ids, logprobs, top = res.token_ids, res.logprobs, res.top
        runs = getattr(res, "runs", None)
        invalid = set(res.invalid_rows)
        finished = SequenceStatus.FINISHED
        for r, s in enumerate(out.scheduled):
            if not s.samples:
                continue
            if live is not None and not live[r]:
                i += 1
                continue
            seq = s.seq
            if i in invalid:  # failed alone (_fail_invalid_rows): no token
                outputs.append((seq, final_output(seq)))
                i += 1
                continue
            lp = tp = None
            spec = None
            k = seq.params.logprobs
            if runs is not None:
                run = runs[i]
                if not run:  # aborted while the step ran
                    i += 1
                    continue
                ids = list(run)
                if k is not None and res.run_logprobs is not None:
                    lp = res.run_logprobs[i][:len(run)]
                    if k > 0 and res.run_top is not None:
                        tp = [t[:k] for t in res.run_top[i][:len(run)]]
                if seq.spec is not None:
                    spec = (res.proposed[i], res.accepted[i])
                self.num_generated_tokens += len(run) - 1
            else:
                ids = [token_ids[i]]
                if seq.spec is not None:  # a speculating sequence's row in a step without drafts
                    spec = (0, 0)
                if logprobs is not None and k is not None:
                    lp = [logprobs[i]]
                    if k > 0 and top is not None:
                        tp = [top[i][:k]]
            if seq.grammar is not None:
                # Forced before this first sampled token (g.unsent) and after it (jump-forward).
                g = seq.grammar
                head, tail = g.unsent, (forced.get(seq.seq_id) if forced else None) or []
                if head or tail:
                    g.unsent = []
                    ids = head + ids + tail
                    if lp is not None:
                        lp = [0.0] * len(head) + lp + [0.0] * len(tail)
                    if tp is not None:
                        tp = [[(t, 0.0)] for t in head] + tp + [[(t, 0.0)] for t in tail]
                    self.num_generated_tokens += len(head) + len(tail)
            if seq.status is finished:
                output = TokenOutput(ids, lp, tp, seq.finish_reason, seq.num_prompt_tokens,
                                     seq.num_cached_tokens, seq.stop_token_id, _fill(seq), speculation=spec,
                                     error=seq.error)
            else:
                output = TokenOutput(ids, lp, tp, None, seq.num_prompt_tokens, seq.num_cached_tokens, fill=_fill(seq),
                                     speculation=spec)
            if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
                output.prompt_logprobs = seq.prompt_logprobs
                seq.prompt_logprobs_sent = True
            outputs.append((seq, output))
            i += 1
        self.num_generated_tokens += len(outputs)
        return outputs

    def _log_prefill_chunks(self, out) -> None:
        now = time.monotonic()
        for s in out.scheduled:
            chunks = self.prefill_log.get(s.seq.seq_id)
            if chunks is not None and (s.start < s.seq.num_prompt_tokens or s.num_new_tokens > 1):
                chunks.append((now, s.start, s.num_new_tokens))

    def stats(self) -> dict:
        kv = self.kv
        q = kv.prefix_queries
        return {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "kv_blocks_total": self.runner.num_blocks,
            "kv_blocks_free": kv.num_free_blocks,
            "kv_blocks_touched": kv.pool.blocks_touched,
            "kv_block_bytes": self.kv_block_bytes,
            "kv_cache_usage": kv.usage,
            "prefix_cache_queries": q,
            "prefix_cache_hits": kv.prefix_hits,
            "prefix_cache_hit_rate": (kv.prefix_hits / q) if q else 0.0,
            "num_preemptions": self.scheduler.num_preemptions_total,
            "num_steps": self.num_steps,
            "num_overlapped_steps": self.num_overlapped_steps,
            "num_verified_steps": self.num_verified_steps,
            "num_masked_after_resolve": self.num_masked_after_resolve,
            "generation_tokens": self.num_generated_tokens,
            **({"speculative": self.speculator.stats()} if self.speculator is not None else {}),
        }
