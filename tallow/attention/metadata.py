"""What one flat batch tells the attention backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Attention metadata for one flat batch of T tokens from B sequences.

    Sequence b owns the query tokens query_start_loc[b]:query_start_loc[b+1] of the flat
    batch. Those tokens sit at the end of its context: after this step the sequence's KV
    cache holds seq_lens[b] tokens, of which the last query_lens[b] are the ones computed
    now (positions seq_lens[b]-query_lens[b] .. seq_lens[b]-1). Attention is causal.

    KV cache layout per layer: k_cache, v_cache of shape
    [num_blocks, block_size, num_kv_heads, head_dim]. Token position p of sequence b lives
    in block block_tables[b, p // block_size], offset p % block_size; its flat slot is
    block * block_size + offset, and slot_mapping[t] is the slot of flat token t.
    Padding tokens (CUDA graphs) have slot_mapping -1 and must not be written.
    """

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32 (padded with 0)
    max_query_len: int
    max_seq_len: int
    # Host copies, for backends that loop in Python (the torch reference).
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
