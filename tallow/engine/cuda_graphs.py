"""CUDA graphs for decode-only steps.

At start-up the model's decode forward (and the LM head) is captured for a ladder of padded
batch sizes, all graphs sharing one memory pool. A decode-only step of n sequences copies its
inputs into static buffers (rows n..bs-1 are padding: slot -1, context length 1), replays the
graph of the smallest captured size bs >= n and reads back the first n rows of logits.
"""

from __future__ import annotations

import logging
import time

import torch

from tallow.engine.attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)


def batch_ladder(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, max_batch + 1, 32))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches, *, max_batch: int, max_model_len: int,
                 block_size: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.ladder = batch_ladder(max_batch)
        self.max_batch = self.ladder[-1]
        self.max_blocks = (max_model_len + block_size - 1) // block_size
        mb = self.max_batch

        def pair(shape, dtype):
            host = torch.zeros(shape, dtype=dtype, pin_memory=True)
            return host, torch.zeros(shape, dtype=dtype, device=device)

        self.h_ids, self.d_ids = pair((mb,), torch.int64)
        self.h_pos, self.d_pos = pair((mb,), torch.int64)
        self.h_slots, self.d_slots = pair((mb,), torch.int64)
        self.h_lens, self.d_lens = pair((mb,), torch.int32)
        self.h_tables, self.d_tables = pair((mb, self.max_blocks), torch.int32)
        self.d_qsl = torch.arange(mb + 1, dtype=torch.int32, device=device)
        # numpy views of the pinned staging buffers: cheap element writes from Python
        self.n_ids, self.n_pos, self.n_slots = self.h_ids.numpy(), self.h_pos.numpy(), self.h_slots.numpy()
        self.n_lens, self.n_tables = self.h_lens.numpy(), self.h_tables.numpy()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.d_slots[:bs], query_start_loc=self.d_qsl[: bs + 1], seq_lens=self.d_lens[:bs],
            block_tables=self.d_tables[:bs], max_query_len=1, max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * bs, seq_lens_cpu=[self.max_model_len] * bs, block_size=self.block_size)

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.d_ids[:bs], self.d_pos[:bs], self.kv_caches, self._meta(bs))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.monotonic()
        self.d_slots.fill_(-1)
        self.d_lens.fill_(1)
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.ladder):  # largest first: its pool then serves the rest
                for _ in range(2):
                    self._forward(bs)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    logits = self._forward(bs)
                if pool is None:
                    pool = g.pool()
                self.graphs[bs] = (g, logits)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode CUDA graphs (batch %d..%d) in %.1fs", len(self.graphs), self.ladder[0],
                 self.ladder[-1], time.monotonic() - t0)

    def padded_size(self, n: int) -> int | None:
        for bs in self.ladder:
            if bs >= n:
                return bs
        return None

    def run(self, scheduled) -> torch.Tensor:
        """Logits [n, vocab] for a decode-only step of n = len(scheduled) sequences."""
        n = len(scheduled)
        bs = self.padded_size(n)
        bsz = self.block_size
        ids, pos, slots, lens, tables = self.n_ids, self.n_pos, self.n_slots, self.n_lens, self.n_tables
        width = 0
        for i, s in enumerate(scheduled):
            seq, p = s.seq, s.start
            table = seq.block_table
            ids[i] = seq.token_ids[p]
            pos[i] = p
            slots[i] = table[p // bsz] * bsz + p % bsz
            lens[i] = p + 1
            nb = p // bsz + 1
            tables[i, :nb] = table[:nb]
            width = max(width, nb)
        if bs > n:
            ids[n:bs] = 0
            pos[n:bs] = 0
            slots[n:bs] = -1
            lens[n:bs] = 1
        # Copy only the block-table columns in use; stale columns beyond a row's length are never read.
        self.d_ids[:bs].copy_(self.h_ids[:bs], non_blocking=True)
        self.d_pos[:bs].copy_(self.h_pos[:bs], non_blocking=True)
        self.d_slots[:bs].copy_(self.h_slots[:bs], non_blocking=True)
        self.d_lens[:bs].copy_(self.h_lens[:bs], non_blocking=True)
        self.d_tables[:n, :width].copy_(self.h_tables[:n, :width], non_blocking=True)
        g, logits = self.graphs[bs]
        g.replay()
        return logits[:n]
