"""The contract every paged attention backend implements."""

from __future__ import annotations

from typing import Protocol

import torch

from tallow.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Store the new tokens' K/V in the paged cache, then attend over each sequence's context.

        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim], the batch's new tokens,
        already rotated. k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].

        First k/v are written to the cache at meta.slot_mapping (slots < 0 are padding and are
        skipped). Then each sequence's query tokens attend causally over its whole context, the
        cached prefix and the new tokens, read back through meta.block_tables. Query head h
        reads KV head h // (num_heads // num_kv_heads). Returns [T, num_heads, head_dim].
        """
        ...
