"""ModelRunner: one scheduled step -> flat batch tensors -> forward -> sampled tokens.

The runner owns the KV cache tensors, the attention backend and the sampler. It knows
nothing of requests beyond what a ScheduledSeq says: which tokens of which sequence to
compute now.

On CUDA the model attends through TritonAttentionBackend, batch inputs go to the device
through pinned staging buffers with non-blocking copies, decode-only steps replay CUDA
graphs (unless enforce_eager) and each step synchronises with the host once, when the
sampled tokens come back (collect()). launch() queues a step without waiting, so with
asynchronous scheduling the engine prepares the next step while this one runs; the next
step's pending input ids are copied on the device from this step's sampled ids. Elsewhere
the torch reference backend runs eagerly.

With tensor parallelism the runner of rank 0 broadcasts each step's host arrays to the
workers (tallow/distributed/step_channel.py) before its own forward; every rank runs
execute() on the same inputs, and rank 0 alone gets the gathered logits and samples. Steps
run eagerly then: no CUDA graphs yet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from tallow.attention.cpu_backend import cache_head_width
from tallow.attention.metadata import AttentionMetadata
from tallow.config import EngineConfig
from tallow.distributed.step_channel import StepChannel, StepInputs
from tallow.engine.cuda_graphs import fill_pending
from tallow.engine import prompt_logprobs
from tallow.engine.prompt_logprobs import PromptRows, plan_prompt_rows
from tallow.engine.sampler import Sampler, SamplerOutput, to_device
from tallow.engine.scheduler import SchedulerOutput
from tallow.models.config import ModelConfig
from tallow.models.sharding import ShardLayout

if TYPE_CHECKING:
    from tallow.distributed.group import ParallelContext
    from tallow.models.engine_model import EngineModel

log = logging.getLogger(__name__)


class TopLogprobs:
    """Row i: the list of (token id, logprob) pairs of the step's i-th sampling row, made when
    asked for (most rows of a batch want no top logprobs)."""

    __slots__ = ("ids", "logprobs")

    def __init__(self, ids: list[list[int]], logprobs: list[list[float]]):
        self.ids, self.logprobs = ids, logprobs

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> list[tuple[int, float]]:
        return list(zip(self.ids[i], self.logprobs[i]))


@dataclass
class LaunchedStep:
    """A step whose sampling was launched: the sampled ids stay on the device (the next
    step's pending inputs read them there) while their host copies travel."""

    token_ids: torch.Tensor  # [S] int64 on the device
    host: list[torch.Tensor]  # token ids, invalid-row flags, then logprobs and top ids/logprobs when asked
    has_logprobs: bool
    has_top: bool
    done: torch.cuda.Event | None  # recorded after the copies (None on the CPU)
    # Prompt logprobs computed in the step: its rows and the host copies of their tensors.
    prompt_rows: PromptRows | None = None
    prompt_host: list[torch.Tensor] | None = None


@dataclass
class ForwardStep:
    """A step whose forward was queued (ModelRunner.forward), not sampled yet."""

    logits: torch.Tensor | None  # the sampling rows' logits (None: no row samples)
    prompt_rows: PromptRows | None = None
    prompt_out: list[torch.Tensor] | None = None


@dataclass
class StepResult:
    """What one step sampled, one entry per sampling row (in scheduler order)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top: TopLogprobs | None
    # Sampling rows (indices into token_ids) whose logits were not finite: their tokens mean nothing.
    invalid_rows: list[int] = field(default_factory=list)
    # (sequence, its PromptLogprobs of this step), for sequences that asked for prompt logprobs.
    prompt_logprobs: list[tuple[object, list]] = field(default_factory=list)


_DROPPED = None


def _dropped_row():
    """The stand-in sequence the sampler sees for a dropped row: greedy, nothing else."""
    global _DROPPED
    if _DROPPED is None:
        from tallow.engine.request import Sequence
        from tallow.engine.sampling import SamplingParams

        _DROPPED = Sequence([0], SamplingParams(temperature=0.0, max_tokens=1))
    return _DROPPED


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    width = cache_head_width(cfg.head_dim, dtype)  # an int8 row carries its scale
    return cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size * width // cfg.head_dim


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV cache tensor. Zeros, not garbage: masked slots of a padded block still
    meet V in a matmul, and 0 * NaN is NaN. On the CPU the zeros come from calloc (numpy), so
    pages are mapped lazily as blocks are used: filling a 2 GiB pool up front took ~2.7 s of
    start-up and the whole pool's RSS."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def set_attention_backend(model: torch.nn.Module, backend) -> None:
    """Point every attention layer of the model at backend."""
    from tallow.models.llama import LlamaAttention

    for module in model.modules():
        if isinstance(module, LlamaAttention):
            module.backend = backend


class PinnedStaging:
    """Host arrays -> device tensors with one non-blocking copy per dtype, through grow-only
    pinned buffers. A buffer is rewritten only after its previous copy has finished (an
    event), so a step that returns without a sync cannot race the next one."""

    def __init__(self, device: torch.device):
        self.device = device
        self._host: dict[torch.dtype, torch.Tensor] = {}
        self._done = torch.cuda.Event()
        self._done.record()

    def to_device(self, arrays: list[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
        n = sum(a.size for a in arrays)
        buf = self._host.get(dtype)
        self._done.synchronize()
        if buf is None or buf.numel() < n:
            buf = self._host[dtype] = torch.empty(max(n, 2 * (0 if buf is None else buf.numel()), 4096),
                                                  dtype=dtype, pin_memory=True)
        host = buf.numpy()
        offset = 0
        for a in arrays:
            host[offset: offset + a.size] = a.ravel()
            offset += a.size
        flat = buf[:n].to(self.device, non_blocking=True)
        out, offset = [], 0
        for a in arrays:
            out.append(flat[offset: offset + a.size].view(a.shape))
            offset += a.size
        return out

    def copies_issued(self) -> None:
        self._done.record()


class ModelRunner:
    """max_num_seqs bounds the decode batch (the Triton split-K workspace); max_model_len
    (default: the model's context) the width of the CUDA graphs' block tables. With parallel,
    the model is this rank's shard and the KV cache holds this rank's KV heads."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, *, block_size: int,
                 num_blocks: int, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                 max_num_seqs: int = 256,
                 max_model_len: int | None = None, enforce_eager: bool = False,
                 cuda_graph_max_batch: int = 256, parallel: ParallelContext | None = None,
                 kv_scale: float | None = 1.0, speculative_tokens: int = 0):
        self.model = model
        self.cfg = model_config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len or model_config.max_position_embeddings
        shard = ShardLayout.of(model_config) if parallel is None else ShardLayout.of(
            model_config, parallel.rank, parallel.world_size)
        # Rank 0 of a tensor-parallel group sends each step's inputs to the others.
        self.step_channel = StepChannel(parallel.control_group) if parallel is not None and parallel.is_first else None
        kv_dtype = kv_dtype or dtype
        shape = (num_blocks, block_size, shard.num_kv_heads, cache_head_width(model_config.head_dim, kv_dtype))
        self.kv_caches = [(zeroed_cache(shape, kv_dtype, device), zeroed_cache(shape, kv_dtype, device))
                          for _ in range(model_config.num_hidden_layers)]
        self.sampler = Sampler(model_config.vocab_size, device)
        # Prompt logprobs of the step being built: its rows (rank 0) and the tensors execute() made.
        self._prompt_rows: PromptRows | None = None
        self._prompt_out: list[torch.Tensor] | None = None
        self.staging = None
        self.graphs = None
        self.verify_graphs = None  # CUDA graphs of speculative verify steps (speculative_tokens > 0)
        self.attn_backend = None
        self._events = [torch.cuda.Event() for _ in range(4)] if device.type == "cuda" else []
        self._event_index = 0
        if device.type == "cuda":
            from tallow.attention.triton_backend import TritonAttentionBackend

            backend = TritonAttentionBackend(shard.num_heads, shard.num_kv_heads, model_config.head_dim,
                                             max_num_seqs=max(max_num_seqs, cuda_graph_max_batch), device=device)
            if kv_dtype == torch.float8_e4m3fn:  # per-layer (k, v) scales; kv_scale None: calibrated
                self.kv_scales = torch.full((model_config.num_hidden_layers, 2), kv_scale or 1.0,
                                            dtype=torch.float32, device=device)
                backend.set_kv_scales(self.kv_caches, self.kv_scales, calibrate=kv_scale is None)
            set_attention_backend(model, backend)
            self.attn_backend = backend
            self.staging = PinnedStaging(device)
            if not enforce_eager and parallel is None:
                self.capture_graphs(min(cuda_graph_max_batch, max_num_seqs), speculative_tokens)
        elif device.type == "cpu":
            from tallow.attention.cpu_backend import CpuAttentionBackend

            if CpuAttentionBackend.supports(dtype, model_config.head_dim):
                set_attention_backend(model, CpuAttentionBackend())

    @classmethod
    def for_engine(cls, engine_model: EngineModel, config: EngineConfig, num_blocks: int, *,
                   max_model_len: int | None = None, parallel: ParallelContext | None = None) -> ModelRunner:
        """The runner of an EngineModel under config's limits: EngineCore builds rank 0's through
        here, and each tensor-parallel worker its own (TensorParallelWorkers gets this method)."""
        loaded = engine_model.loaded
        return cls(loaded.model, loaded.config, block_size=config.block_size, num_blocks=num_blocks,
                   device=engine_model.device, dtype=engine_model.dtype, kv_dtype=engine_model.kv_dtype,
                   max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
                   enforce_eager=config.enforce_eager, cuda_graph_max_batch=config.cuda_graph_max_batch,
                   parallel=parallel, kv_scale=engine_model.kv_scale,
                   speculative_tokens=config.speculative_tokens(engine_model.device.type)
                   if config.speculative_method else 0)

    def capture_graphs(self, max_batch: int, speculative_tokens: int = 0) -> None:
        """Decode graphs up to max_batch sequences; with speculative_tokens K, verify graphs too
        (K + 1 rows a sequence, up to VERIFY_MAX_BATCH sequences), in the same memory pool."""
        from tallow.engine.cuda_graphs import VERIFY_MAX_BATCH, DecodeGraphs, VerifyGraphs

        kwargs = dict(max_model_len=self.max_model_len, block_size=self.block_size, device=self.device)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, max_batch=max_batch, **kwargs)
        self.graphs.capture()
        if speculative_tokens > 0:
            self.verify_graphs = VerifyGraphs(self.model, self.kv_caches, k=speculative_tokens,
                                              max_batch=min(max_batch, VERIFY_MAX_BATCH), **kwargs)
            with self.attn_backend.calibration_paused():
                self.verify_graphs.capture(pool=self.graphs.pool)

    # ---- batch preparation ------------------------------------------------------------
    def host_inputs(self, out: SchedulerOutput, pending: list[list[int]] | None = None,
                    prompt_rows: PromptRows | None = None) -> StepInputs:
        """The step's flat batch as host arrays. With asynchronous scheduling a decode row's
        token may be PENDING_TOKEN (its step still runs): `pending` (a pair of empty lists)
        then gets the flat rows of such tokens and their rows in that step's sampled ids.
        prompt_rows' rows follow the sampling rows in the logits indices."""
        bs = self.block_size
        num_seqs = len(out.scheduled)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        for s in out.scheduled:
            seq, start, n = s.seq, s.start, s.num_new_tokens
            end = start + n
            table = seq.block_table
            draft = s.draft
            if draft:  # speculation: the row's tokens, then its draft's; every one of them samples
                ids.extend(seq.token_ids[start:end])
                ids.extend(draft)
                end += len(draft)
                n += len(draft)
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                qsl.append(qsl[-1] + n)
                seq_lens.append(end)
                logits_idx.extend(range(qsl[-1] - len(draft) - 1, qsl[-1]))
                continue
            if n == 1:
                token = seq.token_ids[start]
                if token < 0 and pending is not None:
                    pending[0].append(len(ids))
                    pending[1].append(seq.pending_row)
                ids.append(token)
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                if seq.token_ids[end - 1] < 0:  # only a decode row reads a pending token
                    raise RuntimeError(f"a {n}-token chunk of sequence {seq.seq_id} ends with a pending token")
                ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            if s.samples:
                logits_idx.append(qsl[-1] - 1)
        max_blocks = (max(seq_lens) + bs - 1) // bs
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        for i, s in enumerate(out.scheduled):
            nb = (seq_lens[i] + bs - 1) // bs
            tables[i, :nb] = s.seq.block_table[:nb]

        num_prompt_rows = 0
        if prompt_rows is not None:
            logits_idx += prompt_rows.rows
            num_prompt_rows = len(prompt_rows.rows)
        longs = [np.array(x, dtype=np.int64) for x in (ids, positions, slots, logits_idx)]
        return StepInputs(*longs, np.array(qsl, dtype=np.int32), np.array(seq_lens, dtype=np.int32), tables,
                          num_prompt_rows)

    def device_inputs(self, inputs: StepInputs, pending: list[list[int]] | None = None,
                      prev_ids: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flat input ids, positions, attention metadata and the rows whose logits are sampled.
        pending (from host_inputs) rows take their ids from prev_ids, on the device."""
        longs = [inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.logits_indices]
        if pending and pending[0]:
            longs += [np.array(pending[0], dtype=np.int64), np.array(pending[1], dtype=np.int64)]
        ints = [inputs.query_start_loc, inputs.seq_lens, inputs.block_tables]
        query_lens = np.diff(inputs.query_start_loc).tolist()
        seq_lens = inputs.seq_lens.tolist()
        if self.staging is None:
            longs, ints = [torch.from_numpy(a) for a in longs], [torch.from_numpy(a) for a in ints]
        else:
            longs = self.staging.to_device(longs, torch.int64)
            ints = self.staging.to_device(ints, torch.int32)
            self.staging.copies_issued()
        input_ids, positions_t, slots_t, logits_idx_t = longs[:4]
        if len(longs) > 4:
            fill_pending(input_ids, longs[4], longs[5], prev_ids)
        qsl_t, seq_lens_t, tables_t = ints
        meta = AttentionMetadata(
            slot_mapping=slots_t, query_start_loc=qsl_t, seq_lens=seq_lens_t, block_tables=tables_t,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, block_size=self.block_size,
        )
        return input_ids, positions_t, meta, logits_idx_t

    # ---- one step ----------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> StepResult:
        """Forward, sample and wait for the tokens: one synchronous step."""
        launched = self.launch(out)
        return StepResult([], None, None) if launched is None else self.collect(launched)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev_ids: torch.Tensor | None = None) -> LaunchedStep | None:
        """Queue the step's forward and sampling and the copies of its tokens to the host,
        without waiting for them (on CUDA). prev_ids: the sampled ids of the step still
        running, where this step's pending tokens are read. None when no row samples."""
        return self.sample(out, self.forward(out, prev_ids))

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput, prev_ids: torch.Tensor | None = None) -> ForwardStep:
        """The first half of launch(): queue the step's forward (on CUDA without waiting for
        it). The engine may then do host work that the sampling needs (a grammar row's mask
        follows the token the step before samples) while the device runs the forward, and
        call sample()."""
        logits = self.logits(out, prev_ids)
        step = ForwardStep(logits, self._prompt_rows, self._prompt_out)
        self._prompt_rows = self._prompt_out = None
        return step

    @torch.inference_mode()
    def sample(self, out: SchedulerOutput, step: ForwardStep) -> LaunchedStep | None:
        """The second half of launch(): sample the forward's logits (grammar masks filled on the
        host now, from the matchers as they are) and queue the copies of the tokens to the host."""
        logits, prompt_rows, prompt_out = step.logits, step.prompt_rows, step.prompt_out
        if logits is None and prompt_out is None:
            return None
        if logits is None:  # prompt-logprob rows only (prefill chunks that end before their prompt does)
            empty = torch.empty(0, dtype=torch.int64, device=prompt_out[0].device)
            sampled = SamplerOutput(empty, None, None, None, empty.bool())
        else:
            # A dropped row's token is thrown away (asynchronous jump-forward): it is sampled as a
            # plain greedy row, so it draws nothing from a seeded sequence's generator.
            sampled = self.sampler(logits, [_dropped_row() if s.dropped else s.seq
                                            for s in out.scheduled if s.samples])
        # Logprobs travel in their own dtype: tolist() widens each to the same Python float
        # that a float64 copy would give.
        tensors = [sampled.token_ids, sampled.invalid]
        if sampled.logprobs is not None:
            tensors.append(sampled.logprobs)
        if sampled.top_ids is not None:
            tensors += [sampled.top_ids, sampled.top_logprobs]
        # Non-blocking copies into pinned host memory; collect() makes the step's one sync.
        host = [x.to("cpu", non_blocking=True) for x in tensors]
        prompt_host = None if prompt_out is None else [x.to("cpu", non_blocking=True) for x in prompt_out]
        done = None
        if self.device.type == "cuda":
            # A ring of events: at most two steps are in flight (asynchronous scheduling).
            self._event_index = (self._event_index + 1) % len(self._events)
            done = self._events[self._event_index]
            done.record()
        return LaunchedStep(sampled.token_ids, host, sampled.logprobs is not None, sampled.top_ids is not None, done,
                            prompt_rows, prompt_host)

    @staticmethod
    def collect(launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens (and logprobs) on the host."""
        if launched.done is not None:
            launched.done.synchronize()
        host = launched.host
        token_ids = host[0].tolist()
        invalid = host[1].nonzero().flatten().tolist() if host[1].any() else []
        logprobs = host[2].tolist() if launched.has_logprobs else None
        top = TopLogprobs(host[-2].tolist(), host[-1].tolist()) if launched.has_top else None
        result = StepResult(token_ids, logprobs, top, invalid)
        if launched.prompt_host is not None:
            result.prompt_logprobs = prompt_logprobs.to_entries(launched.prompt_rows, launched.prompt_host)
        return result

    def take_prompt_logprobs(self) -> list[tuple[object, list]]:
        """After logits(): the prompt logprobs its prefill rows scored, as StepResult holds them
        (a step whose logits are not sampled by launch(): a verified speculative step)."""
        rows, out = self._prompt_rows, self._prompt_out
        self._prompt_rows = self._prompt_out = None
        if out is None:
            return []
        return prompt_logprobs.to_entries(rows, [x.cpu() for x in out])

    def logits(self, out: SchedulerOutput, prev_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The float32 logits [rows, vocab] of the step's sampling rows (scheduler order), after
        its forward; None when no row samples. Pending tokens are read from prev_ids."""
        graphs = self.graphs
        self._prompt_rows = self._prompt_out = None
        if graphs is not None and out.preempted:
            # A preempted sequence can come back in a later decode-only step (its prompt all
            # but one token cached) in the same staged row, with other block ids: restage all.
            graphs.forget_tables()
        # A decode-only step: one token per row; rows of forced tokens (jump-forward one token
        # per step) are computed and not sampled.
        if graphs is not None and out.is_decode_only and len(out.scheduled) <= graphs.max_batch:
            logits = graphs.run(out.scheduled, prev_ids)
            sampling = [i for i, s in enumerate(out.scheduled) if s.samples]
            if len(sampling) == len(out.scheduled):
                return logits
            if not sampling:
                return None
            return logits.index_select(0, to_device(sampling, torch.int64, logits.device))
        if graphs is not None:
            graphs.forget_tables()
        verify = self.verify_graphs
        if verify is not None and out.speculative and prev_ids is None and verify.fits(out.scheduled):
            return verify.run(self.host_inputs(out))
        pending = None if prev_ids is None else [[], []]
        # Prefill rows keep their logits only for sequences that asked for prompt logprobs.
        self._prompt_rows = plan_prompt_rows(out.scheduled)
        inputs = self.host_inputs(out, pending, self._prompt_rows)
        if self.step_channel is not None:
            self.step_channel.send(inputs)
        return self.execute(inputs, pending, prev_ids)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, pending: list[list[int]] | None = None,
                prev_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward one step's batch; the logits of its sampling rows (None when there are
        none, and on tensor-parallel ranks other than 0, which send their slices to rank 0)."""
        input_ids, positions, meta, logits_idx = self.device_inputs(inputs, pending, prev_ids)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if inputs.num_prompt_rows:
            split = len(logits_idx) - inputs.num_prompt_rows
            rows = self._prompt_rows
            self._prompt_out = prompt_logprobs.compute(
                self.model, hidden, logits_idx[split:], None if rows is None else rows.targets,
                0 if rows is None else rows.top_k, self.cfg.vocab_size)
            logits_idx = logits_idx[:split]
        if not len(logits_idx):
            return None
        if hidden.shape[0] != len(logits_idx):
            hidden = hidden.index_select(0, logits_idx)
        return self.model.compute_logits(hidden)
