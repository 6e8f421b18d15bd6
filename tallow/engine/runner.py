"""ModelRunner: one scheduled step -> flat batch tensors -> forward -> sampled tokens.

The runner owns the KV cache tensors and the sampler. It knows nothing of requests
beyond what a ScheduledSeq says: which tokens of which sequence to compute now.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tallow.engine.attention.metadata import AttentionMetadata
from tallow.engine.sampler import Sampler
from tallow.engine.scheduler import SchedulerOutput
from tallow.models.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one step sampled, one entry per sampling row (in scheduler order)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top: list[list[tuple[int, float]]] | None


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, *, block_size: int,
                 num_blocks: int, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.cfg = model_config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        shape = (num_blocks, block_size, model_config.num_key_value_heads, model_config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model_config.num_hidden_layers)
        ]
        self.sampler = Sampler(model_config.vocab_size, device)
        self._pin = device.type == "cuda"

    # ---- batch preparation ------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flat input ids, positions, attention metadata and the rows whose logits are sampled."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logits_idx: list[int] = []
        max_blocks = 0
        for s in out.scheduled:
            seq, start, n = s.seq, s.start, s.num_new_tokens
            end = start + n
            table = seq.block_table
            if n == 1:
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                for p in range(start, end):
                    slots.append(table[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            query_lens.append(n)
            if end == seq.num_tokens:
                logits_idx.append(qsl[-1] - 1)
            nb = (end + bs - 1) // bs
            if nb > max_blocks:
                max_blocks = nb
        tables = np.zeros((len(out.scheduled), max_blocks), dtype=np.int32)
        for i, s in enumerate(out.scheduled):
            nb = (seq_lens[i] + bs - 1) // bs
            tables[i, :nb] = s.seq.block_table[:nb]

        dev = self.device
        to = dict(device=dev, non_blocking=True) if dev.type != "cpu" else None

        def t(data, dtype):
            x = torch.tensor(data, dtype=dtype)
            if to is None:
                return x
            return x.pin_memory().to(**to) if self._pin else x.to(**to)

        meta = AttentionMetadata(
            slot_mapping=t(slots, torch.int64),
            query_start_loc=t(qsl, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            block_tables=(torch.from_numpy(tables) if to is None else torch.from_numpy(tables).to(**to)),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        return t(ids, torch.int64), t(positions, torch.int64), meta, t(logits_idx, torch.int64)

    # ---- one step ----------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> StepResult:
        input_ids, positions, meta, logits_idx = self.prepare(out)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        rows = [s.seq for s in out.scheduled if s.samples]
        if not rows:
            return StepResult([], None, None)
        if hidden.shape[0] != len(rows):
            hidden = hidden.index_select(0, logits_idx)
        logits = self.model.compute_logits(hidden)
        sampled = self.sampler(logits, rows)
        return self._to_host(sampled)

    @staticmethod
    def _to_host(sampled) -> StepResult:
        tensors = [sampled.token_ids]
        if sampled.logprobs is not None:
            tensors.append(sampled.logprobs.to(torch.float64))
        if sampled.top_ids is not None:
            tensors += [sampled.top_ids, sampled.top_logprobs.to(torch.float64)]
        host = [x.cpu() for x in tensors]  # one sync for the whole step
        token_ids = host[0].tolist()
        logprobs = host[1].tolist() if sampled.logprobs is not None else None
        top = None
        if sampled.top_ids is not None:
            ids, lps = host[-2].tolist(), host[-1].tolist()
            top = [list(zip(i, lp)) for i, lp in zip(ids, lps)]
        return StepResult(token_ids, logprobs, top)
