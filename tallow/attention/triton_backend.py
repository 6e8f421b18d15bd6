"""TritonAttentionBackend: paged attention on CUDA with Triton kernels.

forward() writes the step's K/V into the cache, then runs the split-K decode kernel for
decode-only batches and the tiled prefill kernel for anything else. forward_rotary() takes
q and k before the rotary embedding and does both in one kernel that writes the rotated K
and V straight into the cache (one launch per layer fewer than apply_rotary + forward).

CUDA graphs. forward() never synchronises with the host and allocates only its output
([T, num_heads, head_dim], a shape-determined allocation). Every kernel grid is a function
of q's shape, seq_lens' shape and constants fixed at construction; the split-K buffers are
preallocated (an fp8 cache's scales too: device tensors set once, set_kv_scales). What must stay
fixed between capture and replay:
  * the shapes: T (padded token count) and B (padded number of sequences, the length of
    seq_lens and query_start_loc - 1) and block_tables' shape (its row stride is baked in);
  * meta.max_query_len == 1 (the decode path) for a captured decode graph;
  * the tensors' storage: the runner refills the same slot_mapping, query_start_loc,
    seq_lens and block_tables tensors in place.
Padding: padding tokens take slot_mapping -1 (not written to the cache); padding sequences
take seq_lens 0 (their output rows are left unwritten) or any length their block-table row
covers with valid block ids (e.g. 1, computed like a real row and ignored). For a decode
graph of B_pad rows, query_start_loc = arange(B_pad + 1).
"""

from __future__ import annotations

import contextlib

import torch

from tallow.attention.metadata import AttentionMetadata
from tallow.attention.triton_decode import decode_attention, num_decode_splits
from tallow.attention.triton_kv_write import write_kv_cache
from tallow.attention.triton_prefill import prefill_attention
from tallow.ops.triton_rotary import triton_rotary_and_write_kv

# An fp8 KV cache's calibrated scales, as vLLM computes them from the first prefill:
# amax(K) / 200 and amax(V) / 100, leaving 448 / 200 and 448 / 100 of headroom for the
# tokens after it (beyond that the cache saturates at +-448, it never overflows).
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0


class TritonAttentionBackend:
    """Paged attention for one model; the split-K workspace is shared by all its layers.

    max_num_seqs bounds the decode batch that may use more than one split (a larger batch
    falls back to one split, which needs no workspace).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 max_num_seqs: int, device: torch.device | str, max_decode_splits: int = 32,
                 num_sms: int | None = None):
        device = torch.device(device)
        if num_sms is None:
            num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                       if device.type == "cuda" else 4)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_sms = num_sms
        self.max_decode_splits = max_decode_splits
        rows = max(b * self.decode_splits(b) for b in range(1, max_num_seqs + 1))
        self._capacity = rows  # (sequence, split) pairs the workspace holds
        self._partial_out = torch.empty(rows * num_heads * head_dim, dtype=torch.float32, device=device)
        self._partial_lse = torch.empty(rows * num_heads, dtype=torch.float32, device=device)

    def set_kv_scales(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scales: torch.Tensor,
                      calibrate: bool = False) -> None:
        """An fp8 KV cache's per-tensor scales: scales[i] = (k_scale, v_scale) of layer i, whose
        caches are kv_caches[i] (float32 [num_layers, 2] on the device, read by the kernels
        through pointers, so captured CUDA graphs see later values). calibrate: each layer's
        scales are set from the K and V of the first step that holds a prefill
        (K_SCALE_RANGE, V_SCALE_RANGE) before that step writes the cache."""
        self._kv_scales = {k.data_ptr(): scales[i] for i, (k, _) in enumerate(kv_caches)}
        self._calibrate = set(self._kv_scales) if calibrate else set()

    @contextlib.contextmanager
    def calibration_paused(self):
        """No fp8 scale is calibrated by the steps run inside: a CUDA graph capture's warm-up
        runs padding through the multi-row path, not a prompt."""
        held, self._calibrate = getattr(self, "_calibrate", set()), set()
        try:
            yield
        finally:
            self._calibrate = held

    def _scales_for(self, k_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if k_cache.dtype != torch.float8_e4m3fn:
            return None, None
        key = k_cache.data_ptr()
        scales = getattr(self, "_kv_scales", {}).get(key)
        if scales is None:
            raise RuntimeError("an fp8 KV cache without scales: call set_kv_scales first")
        if key in self._calibrate and not meta.is_decode_only and k.shape[0]:
            amax = torch.stack((k.abs().amax().float() / K_SCALE_RANGE, v.abs().amax().float() / V_SCALE_RANGE))
            scales.copy_(amax.clamp_(min=1e-8))
            self._calibrate.discard(key)
        return scales[0:1], scales[1:2]

    def decode_splits(self, num_seqs: int) -> int:
        """Splits per sequence for a decode batch of num_seqs (padded) sequences."""
        return num_decode_splits(num_seqs, self.num_kv_heads, self.num_sms, self.max_decode_splits)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (rotated);
        caches: [num_blocks, block_size, num_kv_heads, head_dim]. Returns [T, num_heads, head_dim]."""
        kv_scales = self._scales_for(k_cache, k, v, meta)
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, *kv_scales)
        return self._attend(q, k_cache, v_cache, meta, scale, kv_scales)

    def forward_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """forward() with q and k not rotated yet: rotary embedding and cache write in one kernel."""
        kv_scales = self._scales_for(k_cache, k, v, meta)
        q = triton_rotary_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping,
                                       *kv_scales)
        return self._attend(q, k_cache, v_cache, meta, scale, kv_scales)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, kv_scales=(None, None)) -> torch.Tensor:
        out = q.new_empty(q.shape)
        if meta.is_decode_only:
            num_seqs = meta.seq_lens.shape[0]
            splits = self.decode_splits(num_seqs)
            if num_seqs * splits > self._capacity:
                splits = 1
            decode_attention(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens,
                             meta.block_tables, scale, splits, self._partial_out, self._partial_lse, *kv_scales)
        else:
            prefill_attention(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens,
                              meta.block_tables, scale, *kv_scales)
        return out
