"""CpuAttentionBackend: paged attention on the CPU with tallow's own kernels: float32 queries
and outputs, a float32, float16 or int8 KV cache (float16: K and V rounded to nearest on write;
int8: each (token, KV head) row of K or V as head_dim codes, blocks of 32 of them round(x * 127 /
max|x|), followed by each block's scale max|x| / 127 in 4 bytes of float32: llama.cpp's q8_0
blocks with float32 scales, 0.56x a float16 cache's bytes, which attention reads at every step).

One call per layer writes the step's K/V into the cache (tl_kv_write) and one computes
every query token's causal attention over its sequence's blocks in place (tl_paged_attention:
decode rows and prefill chunks alike, no gather of K/V, no masks). forward_rotary also
applies the rotary embedding to q and k in place first, so the model hands it q and k
before rotation. A token's result is computed from its own context alone, in a fixed order,
so it does not depend on the batch. A sliding-window layer (Gemma 3) reads only the keys inside
each token's window: the blocks before it stay in the cache (the full-attention layers share
the block tables) but cost no time.
"""

from __future__ import annotations

import torch

from tallow.attention.metadata import AttentionMetadata
from tallow.ops import cpu_native


INT8_BLOCK = 32  # an int8 cache row's codes per float32 scale (the scales follow the head_dim codes)
CACHE_FORMATS = {torch.float32: 0, torch.float16: 1, torch.int8: 2}  # the kernels' KV_F32, KV_F16, KV_I8


def cache_head_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row of a cache of `dtype`: the last dim of its
    [num_blocks, block_size, num_kv_heads, width] tensor (int8: head_dim % 32 == 0)."""
    return head_dim + head_dim // INT8_BLOCK * 4 if dtype == torch.int8 else head_dim


def cache_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernels read a KV cache of `dtype` for this head_dim (int8: whole blocks of 32)."""
    return dtype in CACHE_FORMATS and (dtype != torch.int8 or head_dim % INT8_BLOCK == 0)


def cache_format(cache: torch.Tensor) -> int:
    """The kernels' format code of a KV cache tensor."""
    fmt = CACHE_FORMATS.get(cache.dtype)
    if fmt is None:
        raise ValueError(f"a {cache.dtype} KV cache is not read by tallow's CPU kernels")
    return fmt


class CpuAttentionBackend:
    supports_sliding_window = True

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int) -> bool:
        return cpu_native.lib() is not None and dtype == torch.float32 and head_dim % 8 == 0

    def __init__(self) -> None:
        self._lib = cpu_native.lib()
        if self._lib is None:
            raise RuntimeError(f"tallow's CPU kernels are unavailable: {cpu_native.unavailable_reason()}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (rotated), rows at any
        stride, heads contiguous; caches [num_blocks, block_size, num_kv_heads, cache_head_width].
        sliding_window: each token attends to its last `sliding_window` positions only."""
        T, H, D = q.shape
        kv_heads = k_cache.shape[2]
        for t in (q, k, v):
            assert t.stride(1) == D and t.stride(2) == 1, "heads must be contiguous"
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
        assert cache_supported(k_cache.dtype, D) and k_cache.shape[3] == cache_head_width(D, k_cache.dtype)
        fmt = cache_format(k_cache)
        lib = self._lib
        lib.tl_kv_write(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), T, kv_heads, D,
                        meta.slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), fmt)
        out = q.new_empty(T, H, D)
        tables = meta.block_tables
        if lib.tl_paged_attention(q.data_ptr(), q.stride(0), out.data_ptr(), H * D, k_cache.data_ptr(),
                                  v_cache.data_ptr(), meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(),
                                  tables.data_ptr(), tables.stride(0), meta.seq_lens.shape[0], H, kv_heads, D,
                                  k_cache.shape[1], scale, fmt, sliding_window or 0, torch.get_num_threads()):
            raise MemoryError("paged attention: out of memory for its workspace")
        return out

    def forward_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        """forward() with q and k not rotated yet; they are rotated in place. (The model's hot
        path on the CPU is tl_llama_layer, which rotates q and k of a row in one pass.)"""
        cpu_native.rotary_(q, positions, cos_sin_cache)
        cpu_native.rotary_(k, positions, cos_sin_cache)
        return self.forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window)
