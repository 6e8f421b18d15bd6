"""EngineCore (the step loop) and AsyncEngine (the engine thread <-> asyncio bridge)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from tallow.config import EngineConfig
from tallow.engine.kv_cache import KVCacheManager
from tallow.engine.request import Sequence, SequenceStatus
from tallow.engine.runner import LaunchedStep, ModelRunner, StepResult, available_host_memory, kv_bytes_per_block
from tallow.engine.sampling import SamplingParams
from tallow.engine.scheduler import Scheduler, SchedulerOutput
from tallow.errors import TallowError

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


def merge_outputs(first: TokenOutput, then: TokenOutput) -> TokenOutput:
    """One output for two consecutive ones of a sequence."""
    def joined(a: list | None, b: list | None) -> list | None:
        return None if a is None and b is None else (a or []) + (b or [])

    return TokenOutput(first.token_ids + then.token_ids, joined(first.logprobs, then.logprobs),
                       joined(first.top_logprobs, then.top_logprobs), then.finish_reason, then.num_prompt_tokens,
                       first.num_cached_tokens, then.stop_token_id)


def load_tokenizer(source):
    """A Tokenizer from the loader's TokenizerSource."""
    from tallow.tokenizer import Tokenizer, read_gguf_tokenizer_metadata

    if source.kind == "hf":
        return Tokenizer.from_hf_dir(source.path)
    if source.kind == "gguf" and source.metadata:
        return Tokenizer.from_gguf_metadata(source.metadata)
    if source.path is None:
        raise TallowError(source.note or "no tokenizer for this model", status=500, type="server_error")
    return Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(source.path))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise TallowError(f"unknown dtype {name!r}; use one of {sorted(table)}", param="dtype")
    return table[name]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device, quantization: str,
                           head_dim: int) -> torch.dtype:
    """The KV cache's dtype. "auto": float16 on the CPU where tallow's kernels run a float32
    model with int4/int8 weights (attention reads half the bytes; K and V round to float16's
    11 significant bits, as llama.cpp's default cache does), else the model's dtype. A named
    dtype must be the model's, or float16 on the CPU with tallow's attention kernels."""
    from tallow.engine.attention.cpu_backend import CpuAttentionBackend

    native = device.type == "cpu" and CpuAttentionBackend.supports(model_dtype, head_dim)
    if name == "auto":
        quantized = quantization in ("auto", "int4", "int8")
        return torch.float16 if native and quantized else model_dtype
    dtype = resolve_dtype(name, device)
    if dtype != model_dtype and not (native and dtype == torch.float16):
        raise TallowError(f"kv_cache_dtype {name!r}: the cache holds the model's dtype "
                          f"({str(model_dtype).removeprefix('torch.')}), or float16 on the CPU with tallow's kernels",
                          param="kv_cache_dtype")
    return dtype


class EngineCore:
    """Owns the model runner, the KV cache manager and the scheduler; step() advances all.

    With config.tensor_parallel_size > 1 it also starts the worker processes of the other
    ranks and holds rank 0's shard of the model; call shutdown() to stop them."""

    def __init__(self, config: EngineConfig, loaded=None):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        t0 = time.monotonic()
        self.workers = self._start_workers(loaded) if config.tensor_parallel_size != 1 else None
        try:
            self._build(loaded)
        except BaseException:
            self.shutdown()
            raise
        self.load_seconds = time.monotonic() - t0
        log.info("engine ready: %s on %s/%s, %d KV blocks of %d tokens, quantization %s, tensor parallel %d, %.2fs",
                 self.model_name, self.device, str(self.dtype).removeprefix("torch."), self.runner.num_blocks,
                 config.block_size, self.quantization, config.tensor_parallel_size, self.load_seconds)

    def _start_workers(self, loaded):
        """Check that the model splits in tensor_parallel_size shards, then start the other ranks."""
        from tallow.distributed.sharding import validate_tensor_parallel
        from tallow.distributed.workers import TensorParallelWorkers
        from tallow.models.loader import read_model_config

        size, source = self.config.tensor_parallel_size, self.config.model
        if loaded is not None or source.startswith("replay:"):
            what = "a preloaded model" if loaded is not None else "the replay: test fixture"
            raise TallowError(f"tensor_parallel_size {size}: {what} cannot be sharded (each rank loads its "
                              "own shard from the model source)", param="tensor_parallel_size")
        validate_tensor_parallel(read_model_config(source), size)
        if self.device.type == "cuda":
            available = torch.cuda.device_count() - (self.device.index or 0)
            if size > available:
                raise TallowError(f"tensor_parallel_size {size} needs {size} GPUs from {self.device} on, but "
                                  f"{available} are visible", param="tensor_parallel_size")
        return TensorParallelWorkers(self.config, self.device)

    def _build(self, loaded) -> None:
        """Load the model (rank 0's shard with tensor parallelism), size the KV cache, and
        build the runner, the KV cache manager and the scheduler."""
        from tallow.models.loader import load_model

        config = self.config
        parallel = None if self.workers is None else self.workers.parallel
        if loaded is None:
            loaded = load_model(config.model, dtype=self.dtype, device=self.device, cache_dir=config.cache_dir,
                                seed=config.seed, parallel=parallel)
        self.loaded = loaded
        self.model_config = loaded.config
        self.model_name = loaded.name
        self.tokenizer = load_tokenizer(loaded.tokenizer_source)
        self.quantization = "none"
        if self.device.type == "cpu" and config.quantization != "none":
            from tallow.models.quant import quantize_model_

            self.quantization = quantize_model_(loaded.model, config.quantization)
        cfg = self.model_config
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(cfg.eos_token_id)

        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device, config.quantization,
                                               cfg.head_dim)
        num_blocks = config.num_kv_blocks or self._num_blocks_from_budget()
        self.runner = ModelRunner(loaded.model, cfg, block_size=config.block_size, num_blocks=num_blocks,
                                  device=self.device, dtype=self.dtype, kv_dtype=self.kv_dtype,
                                  max_num_seqs=config.max_num_seqs,
                                  max_model_len=self.max_model_len, enforce_eager=config.enforce_eager,
                                  cuda_graph_max_batch=config.cuda_graph_max_batch, parallel=parallel)
        # One block of every layer's K and V in this process (rank 0's heads with tensor parallelism).
        self.kv_block_bytes = sum(k[0].nbytes + v[0].nbytes for k, v in self.runner.kv_caches)
        if self.workers is not None:
            self.workers.wait_ready(num_blocks)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len)
        self.async_scheduling = self._async_scheduling()
        # Asynchronous scheduling: the launched step whose tokens have not been read yet.
        self._inflight: tuple[SchedulerOutput, LaunchedStep | None] | None = None
        self.num_steps = 0
        self.num_overlapped_steps = 0  # launched while the step before was still pending
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

    def _num_blocks_from_budget(self) -> int:
        cfg, c = self.model_config, self.config
        per_block = kv_bytes_per_block(cfg, c.block_size, self.kv_dtype)
        if self.workers is not None:
            # Each rank caches its own KV heads (some replicated when there are fewer than
            # ranks); on the CPU every rank's cache is in the same host memory.
            from tallow.distributed.sharding import ShardLayout

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
            child = params if params.seed is None else replace(params, seed=params.seed + i)
            seqs.append(Sequence(prompt_ids, child, eos_token_ids=self.eos_token_ids,
                                 max_model_len=self.max_model_len,
                                 request_id=f"{first.request_id}-{i}", prefill_after=first))
        return seqs

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.scheduler.abort(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def step(self) -> list[tuple[Sequence, TokenOutput]]:
        """One schedule -> run -> sample -> update round. Returns the outputs of this step;
        with asynchronous scheduling, those of the step before (this one is left running)."""
        if self.async_scheduling:
            return self._step_async()
        return self._step_sync()

    def _step_async(self) -> list[tuple[Sequence, TokenOutput]]:
        """Schedule and launch step N+1 while step N runs, then read step N's tokens.

        The order keeps the device busy: scheduling and batch preparation of N+1 happen
        while N computes, N+1 is queued behind N, and N's outputs are processed while N+1
        computes. N+1's decode rows read the tokens N samples from N's sampled ids on the
        device. A sequence that N finishes (a stop token) has run one step too many in N+1:
        that token is dropped. Penalties read token ids on the host, so while a sequence
        with penalties is queued every step waits for its own tokens (the synchronous step).
        """
        prev = self._inflight
        self._inflight = None
        if self.scheduler.num_host_token_seqs:
            outputs = self._resolve(*prev) if prev is not None else []
            return outputs + self._step_sync()
        out = self.scheduler.schedule()
        launched = None
        if out.scheduled:
            if self.prefill_log:
                self._log_prefill_chunks(out)
            try:
                launched = self.runner.launch(out, None if prev is None or prev[1] is None else prev[1].token_ids)
            except Exception:
                outputs = self._resolve(*prev) if prev is not None else []
                return outputs + self._fail_step(out)
            self.num_steps += 1
            if prev is not None and prev[1] is not None:
                self.num_overlapped_steps += 1
        outputs = self._resolve(*prev) if prev is not None else []
        if out.scheduled:
            # After the resolve: the blocks this step completes hash the tokens it read.
            self.scheduler.update_launched(out)
            if launched is not None:
                self._inflight = (out, launched)
        if not self.scheduler.running and self._inflight is None:
            self.runner.sampler.release()
        return outputs

    def _resolve(self, out: SchedulerOutput, launched: LaunchedStep | None) -> list[tuple[Sequence, TokenOutput]]:
        """Read a launched step's tokens and apply them: the outputs of its live sequences."""
        if launched is None:
            return []
        finished = SequenceStatus.FINISHED
        live = [s.samples and s.seq.status is not finished for s in out.scheduled]
        try:
            res = self.runner.collect(launched)
        except Exception:
            return self._fail_step(out)
        self.scheduler.resolve(out, res.token_ids)
        return self._outputs(out, res, live)

    def _fail_step(self, out: SchedulerOutput) -> list[tuple[Sequence, TokenOutput]]:
        shape = [(s.seq.seq_id, s.start, s.num_new_tokens) for s in out.scheduled]
        log.exception("engine step failed; failing its %d sequences (seq, start, tokens): %s", len(shape), shape)
        failed = self.scheduler.fail(out)
        return [(seq, self._final(seq)) for seq in failed]

    def _step_sync(self) -> list[tuple[Sequence, TokenOutput]]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        if self.prefill_log:
            self._log_prefill_chunks(out)
        try:
            res = self.runner.run(out)
        except Exception:
            return self._fail_step(out)
        self.num_steps += 1
        self.scheduler.update(out, res.token_ids)
        if not self.scheduler.running:  # nothing runs on: the sampler's cached batch plan is stale
            self.runner.sampler.release()
        return self._outputs(out, res)

    def _outputs(self, out: SchedulerOutput, res: StepResult,
                 live: list[bool] | None = None) -> list[tuple[Sequence, TokenOutput]]:
        """A TokenOutput per sampling row (per row where live is true, when given)."""
        outputs = []
        i = 0
        token_ids, logprobs, top = res.token_ids, res.logprobs, res.top
        finished = SequenceStatus.FINISHED
        for r, s in enumerate(out.scheduled):
            if not s.samples:
                continue
            if live is not None and not live[r]:
                i += 1
                continue
            seq = s.seq
            lp = tp = None
            if logprobs is not None:
                k = seq.params.logprobs
                if k is not None:
                    lp = [logprobs[i]]
                    if k > 0 and top is not None:
                        tp = [top[i][:k]]
            if seq.status is finished:
                outputs.append((seq, TokenOutput([token_ids[i]], lp, tp, seq.finish_reason, seq.num_prompt_tokens,
                                                 seq.num_cached_tokens, seq.stop_token_id)))
            else:
                outputs.append((seq, TokenOutput([token_ids[i]], lp, tp, None, seq.num_prompt_tokens,
                                                 seq.num_cached_tokens)))
            i += 1
        self.num_generated_tokens += len(outputs)
        return outputs

    def _log_prefill_chunks(self, out) -> None:
        now = time.monotonic()
        for s in out.scheduled:
            chunks = self.prefill_log.get(s.seq.seq_id)
            if chunks is not None and (s.start < s.seq.num_prompt_tokens or s.num_new_tokens > 1):
                chunks.append((now, s.start, s.num_new_tokens))

    @staticmethod
    def _final(seq: Sequence) -> TokenOutput:
        return TokenOutput([], None, None, seq.finish_reason or "abort", seq.num_prompt_tokens,
                           seq.num_cached_tokens)

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
            "generation_tokens": self.num_generated_tokens,
        }


class RequestStream:
    """Async iterator of one sequence's TokenOutputs. abort() (idempotent) frees it at once.

    Outputs that arrive while the consumer is busy are merged into one (their tokens, logprobs
    and the last one's finish_reason), as vLLM's output collector does: a consumer that falls
    behind catches up in one step instead of one wake-up per token."""

    def __init__(self, engine: "AsyncEngine", seq: Sequence):
        self._engine = engine
        self.seq = seq
        self.request_id = seq.request_id
        self._pending: TokenOutput | None = None  # what arrived and was not taken yet, merged
        self._waiter: asyncio.Future | None = None
        self._done = False
        # Prefill chunks (time, first position, tokens) when submitted with trace_prefill.
        self.prefill_chunks: list[tuple[float, int, int]] | None = None

    def _put(self, out: TokenOutput) -> None:
        """Runs on the event loop."""
        pending = self._pending
        self._pending = out if pending is None else merge_outputs(pending, out)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenOutput:
        if self._done:
            raise StopAsyncIteration
        while self._pending is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out, self._pending = self._pending, None
        if out.finish_reason is not None:
            self._done = True
        return out

    def abort(self) -> None:
        """Free the sequence (the engine thread does it before its next step) and end this
        iteration at once with an "abort" output, not waiting for that step."""
        if not self._done:
            self._engine._abort(self)

    async def aclose(self) -> None:
        self.abort()

    @property
    def finished(self) -> bool:
        return self._done


class AsyncEngine:
    """Runs EngineCore.step() in its own thread; requests talk to it through queues."""

    def __init__(self, core: EngineCore | Callable[[], EngineCore]):
        """core: an EngineCore, or a function that builds one. A function runs in the engine
        thread itself, so the model is loaded (and its first torch ops run) in the thread that
        steps it: torch's OpenMP intra-op pool belongs to the thread that first uses it, and a
        CPU engine stepped from another thread than the one that built it ran ~2x slower
        (benchmarks/server_tax.py). Returns once the core is built; its error is raised here."""
        self._chat_template = None
        self._streams: dict[int, RequestStream] = {}
        self._commands: deque = deque()
        self._wake = threading.Event()
        self._stop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        built = threading.Event()
        failure: list[BaseException] = []
        build = core if callable(core) else (lambda: core)

        def run() -> None:
            try:
                self.core = build()
            except BaseException as e:  # handed to the constructor's caller
                failure.append(e)
                return
            finally:
                built.set()
            self._run()

        self._thread = threading.Thread(target=run, name="tallow-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        core = self.core
        self.tokenizer = core.tokenizer
        self.model_config = core.model_config
        self.max_model_len = core.max_model_len
        self.model_name = core.model_name
        self.max_num_seqs = core.config.max_num_seqs
        self.ready = True

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        """Build the EngineCore in the engine thread (see __init__)."""
        return cls(lambda: EngineCore(config))

    @property
    def chat_template(self):
        if self._chat_template is None:
            from tallow.chat_template import ChatTemplate

            tok = self.tokenizer
            self._chat_template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
        return self._chat_template

    # ---- the asyncio side -------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               trace_prefill: bool = False) -> list[RequestStream]:
        """Queue a request: one stream per sample (params.n); siblings share the prompt's blocks.
        With trace_prefill, each stream's prefill_chunks lists its prefill steps."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        seqs = self.core.make_sequences(prompt_ids, params, request_id)
        streams = [RequestStream(self, s) for s in seqs]
        for st in streams:
            self._streams[st.seq.seq_id] = st
            if trace_prefill:  # registered before the engine thread can see the sequence
                st.prefill_chunks = self.core.prefill_log[st.seq.seq_id] = []
        self._commands.append(("add", seqs))
        self._wake.set()
        return streams

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        if params.n != 1:
            raise TallowError("generate() takes n == 1; use submit() for several samples", param="n")
        return self.submit(prompt_ids, params, request_id)[0]

    def _abort(self, stream: RequestStream) -> None:
        """Runs on the event loop: the stream gets its final output now; whatever the engine
        thread still posts for it is dropped. A stream no longer registered (aborted already, or
        its final output delivered) needs nothing."""
        seq = stream.seq
        if self._streams.pop(seq.seq_id, None) is None:
            return
        self._commands.append(("abort", seq))
        self._wake.set()
        stream._put(TokenOutput([], None, None, "abort", seq.num_prompt_tokens, seq.num_cached_tokens))

    def stats(self) -> dict:
        return self.core.stats()

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 10)
        await asyncio.to_thread(self.core.shutdown, not self._thread.is_alive())

    # ---- the engine thread ------------------------------------------------------------
    def _deliver(self, batch: list[tuple[Sequence, TokenOutput]]) -> None:
        """Runs on the event loop: hand each output to its stream."""
        for seq, out in batch:
            if out.finish_reason is None:
                st = self._streams.get(seq.seq_id)
            else:
                st = self._streams.pop(seq.seq_id, None)
                self.core.prefill_log.pop(seq.seq_id, None)
            if st is not None:
                st._put(out)

    def _post(self, batch: list[tuple[Sequence, TokenOutput]]) -> None:
        if batch and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, batch)

    def _drain_commands(self) -> list[tuple[Sequence, TokenOutput]]:
        finals = []
        while self._commands:
            kind, arg = self._commands.popleft()
            if kind == "add":
                for seq in arg:
                    try:
                        self.core.add(seq)
                    except TallowError as e:
                        log.warning("request %s rejected by the scheduler: %s", seq.request_id, e.message)
                        seq.status = SequenceStatus.FINISHED
                        seq.finish_reason = "error"
                        finals.append((seq, EngineCore._final(seq)))
            else:
                seq = arg
                if not seq.is_finished:
                    self.core.abort(seq)
                    finals.append((seq, EngineCore._final(seq)))
        return finals

    def _run(self) -> None:
        core = self.core
        while not self._stop:
            finals = self._drain_commands()
            if finals:
                self._post(finals)
            if not core.has_work():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                outputs = core.step()
            except Exception:  # the scheduler itself failed: keep the thread alive
                log.exception("engine step raised outside the model run")
                outputs = []
                time.sleep(0.01)
            if outputs:
                self._post(outputs)
        # Shutting down: abort everything left.
        for st in list(self._streams.values()):
            if not st.seq.is_finished:
                core.abort(st.seq)
            self._post([(st.seq, EngineCore._final(st.seq))])

