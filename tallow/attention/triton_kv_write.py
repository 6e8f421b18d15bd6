"""Triton kernel that writes a step's new K/V rows into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ROW_PAD: tl.constexpr, KV_FP8: tl.constexpr,
):
    # One program per token: copy its [num_kv_heads, head_dim] K and V rows to its slot.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:  # padding row
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    i = tl.arange(0, ROW_PAD)
    head = i // HEAD_DIM
    dim = i % HEAD_DIM
    mask = i < NUM_KV_HEADS * HEAD_DIM
    dst = block * stride_cb + offset * stride_cs + head * stride_ch + dim
    k = tl.load(k_ptr + t * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + head * stride_vh + dim, mask=mask)
    if KV_FP8:  # x / scale saturated to the e4m3 range (the layer's per-tensor scales)
        k = tl.minimum(tl.maximum(k.to(tl.float32) / tl.load(k_scale_ptr), -448.0), 448.0)
        v = tl.minimum(tl.maximum(v.to(tl.float32) / tl.load(v_scale_ptr), -448.0), 448.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Write k[t], v[t] ([T, num_kv_heads, head_dim]) to flat slot slot_mapping[t] of the caches.
    An fp8 (float8_e4m3fn) cache stores k / k_scale, v / v_scale (one-element float32 device
    tensors), saturated to +-448.

    Tokens whose slot is negative (padding under CUDA graphs) are skipped. The grid is T
    programs: it depends only on the batch's shape.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.stride(-1) == v.stride(-1) == 1, "k/v rows must be contiguous in head_dim"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale if fp8 else k, v_scale if fp8 else v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        ROW_PAD=triton.next_power_of_2(num_kv_heads * head_dim), KV_FP8=fp8,
    )
