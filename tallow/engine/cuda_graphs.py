"""CUDA graphs for decode-only steps, and for speculative verify steps.

At start-up the model's decode forward (and the LM head) is captured for a ladder of padded
batch sizes, all graphs sharing one memory pool. A decode-only step of n sequences copies its
inputs into static buffers (rows n..bs-1 are padding: slot -1, context length 1), replays the
graph of the smallest captured size bs >= n and reads back the first n rows of logits.

With asynchronous scheduling a row's token may still be pending (the step that samples it
runs): its id is copied into the static input ids on the device, from that step's sampled
ids, before the replay. The pinned staging buffers are rewritten only once the copies of
the step before have run (an event), as the host may now be a step ahead of the device.

VerifyGraphs does the same for the steps that verify speculative drafts (with
num_speculative_tokens = K): each of bs padded sequence slots holds up to K + 1 query rows (its
decode token, then its draft), so a graph runs bs * (K + 1) rows through the multi-row attention
path with query_start_loc on the device. A sequence with a shorter draft, or none, takes fewer
rows; the rows left over at the end are padding (slot -1, owned by no sequence: padding
sequences have no query rows and length 0, so attention never writes those rows and nothing
reads them). The graph computes the logits of every row; the sampled ones are gathered in the
order the eager step gives them. Verify steps are synchronous, so no token is pending.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tallow.attention.metadata import AttentionMetadata
from tallow.engine.sampler import to_device

log = logging.getLogger(__name__)


# Verify graphs are captured up to this many sequences (K + 1 rows each); a larger verify step
# runs eagerly. Their logits ([bs * (K + 1), vocab]) live in the shared pool.
VERIFY_MAX_BATCH = 64


def fill_pending(input_ids: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, prev_ids: torch.Tensor) -> None:
    """input_ids[rows] = prev_ids[src] on the device: the pending tokens of an asynchronously
    scheduled step, from the sampled ids of the step before (still running, stream-ordered)."""
    if prev_ids is None:
        raise RuntimeError("a step with pending tokens needs the sampled ids of the step before")
    input_ids.index_copy_(0, rows, prev_ids.index_select(0, src))


def batch_ladder(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, max_batch + 1, 32))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class DecodeGraphs:
    rows = 1  # query rows per sequence slot

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
            host = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
            return host, torch.zeros(shape, dtype=dtype, device=device)

        # ids, positions, slots and the pending rows and their sources share one buffer: one copy.
        self.h_long, self.d_long = pair((5, mb * self.rows), torch.int64)
        self.h_lens, self.d_lens = pair((mb,), torch.int32)
        self.h_tables, self.d_tables = pair((mb, self.max_blocks), torch.int32)
        self.d_ids, self.d_pos, self.d_slots, self.d_pend_rows, self.d_pend_src = self.d_long
        self._staged = torch.cuda.Event() if device.type == "cuda" else None
        self.h_qsl, self.d_qsl = pair((mb + 1,), torch.int32)
        self.d_qsl.copy_(torch.arange(mb + 1, dtype=torch.int32) * self.rows)
        # numpy views of the pinned staging buffers: cheap writes from Python
        self.n_long, self.n_lens, self.n_tables = self.h_long.numpy(), self.h_lens.numpy(), self.h_tables.numpy()
        self.n_qsl = self.h_qsl.numpy()
        # What each staged block-table row holds: (sequence, blocks written). A running
        # sequence only appends blocks, so a row is topped up rather than rewritten.
        self._rows: list[tuple[object, int]] = [(None, 0)] * mb
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    def _meta(self, bs: int) -> AttentionMetadata:
        t = bs * self.rows
        return AttentionMetadata(
            slot_mapping=self.d_slots[:t], query_start_loc=self.d_qsl[: bs + 1], seq_lens=self.d_lens[:bs],
            block_tables=self.d_tables[:bs], max_query_len=self.rows, max_seq_len=self.max_model_len,
            query_lens_cpu=[self.rows] * bs, seq_lens_cpu=[self.max_model_len] * bs, block_size=self.block_size)

    def _forward(self, bs: int) -> torch.Tensor:
        t = bs * self.rows
        hidden = self.model(self.d_ids[:t], self.d_pos[:t], self.kv_caches, self._meta(bs))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every rung of the ladder; pool: another set's memory pool to share."""
        t0 = time.monotonic()
        self.d_slots.fill_(-1)
        self.d_lens.fill_(1)
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
        self.pool = pool
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured %d %s CUDA graphs (batch %d..%d, %d rows a sequence) in %.1fs", len(self.graphs),
                 type(self).__name__, self.ladder[0], self.ladder[-1], self.rows, time.monotonic() - t0)

    def padded_size(self, n: int) -> int | None:
        for bs in self.ladder:
            if bs >= n:
                return bs
        return None

    def forget_tables(self) -> None:
        """Rewrite every staged block-table row at the next replay: call after any step that
        may have given a sequence new blocks outside decode (prefill, recompute)."""
        self._rows = [(None, 0)] * self.max_batch

    def run(self, scheduled, prev_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, vocab] for a decode-only step of n = len(scheduled) sequences; pending
        tokens are read from prev_ids (the sampled ids of the step before, on the device)."""
        n = len(scheduled)
        if self._staged is not None:
            self._staged.synchronize()
        bs = self.padded_size(n)
        bsz = self.block_size
        tables, rows = self.n_tables, self._rows
        token_ids, starts, slot_ids, pend_rows, pend_src = [], [], [], [], []
        # Rows whose sequence is staged up to the block of its new token: only that last block
        # is written again (one fancy-index write for all of them), as in the general case.
        last_rows, last_cols, last_blocks = [], [], []
        for i, s in enumerate(scheduled):
            q, p = s.seq, s.start
            table = q.block_table
            nb = p // bsz + 1
            block = table[nb - 1]
            token = q.token_ids[p]
            if token < 0:
                pend_rows.append(i)
                pend_src.append(q.pending_row)
            token_ids.append(token)
            starts.append(p)
            slot_ids.append(block * bsz + p % bsz)
            held_seq, held = rows[i]
            if held_seq is q and held == nb:
                last_rows.append(i)
                last_cols.append(nb - 1)
                last_blocks.append(block)
                continue
            # The last block held may have been reallocated (a recompute whose prefix was cached).
            start = max(held - 1, 0) if held_seq is q else 0
            if start < nb:
                tables[i, start:nb] = table[start:nb]
                rows[i] = (q, nb)
        if last_rows:
            tables[last_rows, last_cols] = last_blocks
        ids, positions, slots, prows, psrc = self.n_long
        m = len(pend_rows)
        if m:
            prows[:m] = pend_rows
            psrc[:m] = pend_src
        pos = np.array(starts, dtype=np.int64)
        ids[:n] = token_ids
        positions[:n] = pos
        slots[:n] = slot_ids
        self.n_lens[:n] = pos + 1
        if bs > n:
            ids[n:bs] = 0
            positions[n:bs] = 0
            slots[n:bs] = -1
            self.n_lens[n:bs] = 1
        self._stage(bs, n)
        if m:
            if prev_ids is not None and m == n == len(prev_ids) and pend_src == list(range(n)):  # steady decode: row i from row i
                self.d_ids[:n].copy_(prev_ids)
            else:
                fill_pending(self.d_ids, self.d_pend_rows[:m], self.d_pend_src[:m], prev_ids)
        return self._replay(bs)[:n]

    def _stage(self, bs: int, n: int) -> None:
        """Copy the staged inputs of bs slots (the block tables of the first n) to the device;
        the pinned buffers may be rewritten once these copies have run."""
        # Contiguous ranges only (a strided copy would go through a pageable temporary).
        self.d_long.copy_(self.h_long, non_blocking=True)
        self.d_lens[:bs].copy_(self.h_lens[:bs], non_blocking=True)
        self.d_tables[:n].copy_(self.h_tables[:n], non_blocking=True)
        if self._staged is not None:
            self._staged.record()

    def _replay(self, bs: int) -> torch.Tensor:
        g, logits = self.graphs[bs]
        g.replay()
        self.num_replays += 1
        return logits


class VerifyGraphs(DecodeGraphs):
    """Graphs for steps that verify speculative drafts of at most k tokens (module docstring)."""

    def __init__(self, model: torch.nn.Module, kv_caches, *, k: int, **kwargs):
        self.rows = k + 1
        super().__init__(model, kv_caches, **kwargs)

    def fits(self, scheduled) -> bool:
        """A step these graphs can run: at most max_batch rows, each one decode token (sampled or
        forced) with a draft of at most k tokens; no prefill chunk."""
        if len(scheduled) > self.max_batch:
            return False
        k = self.rows - 1
        return all(s.num_new_tokens == 1 and len(s.draft or ()) <= k for s in scheduled)

    def forget_tables(self) -> None:
        pass  # every step restages its rows' block tables

    def run(self, inputs) -> torch.Tensor:
        """Logits of the step's sampling rows (inputs.logits_indices) from its flat batch as
        ModelRunner.host_inputs lays it out (StepInputs), padded to the graph's slots."""
        n, r = len(inputs.seq_lens), len(inputs.input_ids)
        if self._staged is not None:
            self._staged.synchronize()
        bs = self.padded_size(n)
        t = bs * self.rows
        ids, positions, slots = self.n_long[0], self.n_long[1], self.n_long[2]
        ids[:r], positions[:r], slots[:r] = inputs.input_ids, inputs.positions, inputs.slot_mapping
        ids[r:t], positions[r:t], slots[r:t] = 0, 0, -1
        self.n_qsl[:n + 1] = inputs.query_start_loc
        self.n_qsl[n + 1:bs + 1] = r
        self.n_lens[:n] = inputs.seq_lens
        self.n_lens[n:bs] = 0
        self.n_tables[:n, :inputs.block_tables.shape[1]] = inputs.block_tables
        self.d_qsl[:bs + 1].copy_(self.h_qsl[:bs + 1], non_blocking=True)
        self._stage(bs, n)
        logits = self._replay(bs)
        rows = inputs.logits_indices
        if len(rows) == t:
            return logits
        return logits.index_select(0, to_device(rows.tolist(), torch.int64, logits.device))
