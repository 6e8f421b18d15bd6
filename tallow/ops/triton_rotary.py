"""Triton rotary embedding: one program per token rotates all its q and k heads; a second
kernel also writes the rotated k (and v) into the paged KV cache, for the attention layers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _to_cache(x, scale, FP8: tl.constexpr):
    """x as the cache stores it: FP8, x / scale saturated to +-448 in e4m3 (the per-tensor
    scale of an fp8 KV cache); else x unchanged (cast at the store)."""
    if FP8:
        y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0).to(tl.float8e4nv)
    else:
        y = x
    return y


@triton.jit
def _rotate_heads(x_ptr, out_ptr, stride_x, stride_o, cos, sin, num_heads,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
                  scale, FP8: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    mask = (h < num_heads)[:, None] & (i < HALF)[None, :]
    src = x_ptr + h[:, None] * stride_x + i[None, :]
    dst = out_ptr + h[:, None] * stride_o + i[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    tl.store(dst, _to_cache(x1 * cos[None, :] - x2 * sin[None, :], scale, FP8).to(ty), mask=mask)
    tl.store(dst + HALF, _to_cache(x2 * cos[None, :] + x1 * sin[None, :], scale, FP8).to(ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_sin_ptr, positions_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_oqt, stride_oqh, stride_okt, stride_okh,
    stride_cache, num_q_heads, num_k_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_sin_ptr + pos * stride_cache + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cache + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_oqt, stride_qh, stride_oqh,
                  cos, sin, num_q_heads, HALF, HALF_PAD, Q_HEADS_PAD, 1.0, False)
    _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * stride_okt, stride_kh, stride_okh,
                  cos, sin, num_k_heads, HALF, HALF_PAD, K_HEADS_PAD, 1.0, False)


def triton_apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See tallow.ops.apply_rotary. q, k may be strided views (e.g. of a fused qkv output)
    as long as head_dim has unit stride."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert q.stride(-1) == k.stride(-1) == cos_sin_cache.stride(-1) == 1
    q_out, k_out = q.new_empty(q.shape), k.new_empty(k.shape)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, cos_sin_cache, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin_cache.stride(0), num_q_heads, num_k_heads,
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads), K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
    )
    return q_out, k_out


@triton.jit
def _copy_heads(x_ptr, out_ptr, stride_x, stride_o, num_heads,
                HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
                scale, FP8: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, DIM_PAD)
    mask = (h < num_heads)[:, None] & (i < HEAD_DIM)[None, :]
    x = tl.load(x_ptr + h[:, None] * stride_x + i[None, :], mask=mask)
    tl.store(out_ptr + h[:, None] * stride_o + i[None, :], _to_cache(x, scale, FP8).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _rotary_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, cos_sin_ptr, positions_ptr, slot_mapping_ptr,
    k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_oqt, stride_oqh,
    stride_cb, stride_cs, stride_ch, stride_cache, num_q_heads, num_k_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
):
    # One program per token: rotate its q heads into q_out, and its k heads straight into
    # the token's cache slot, where its v heads are copied too (slot -1: padding, no write).
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_sin_ptr + pos * stride_cache + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cache + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_oqt, stride_qh, stride_oqh,
                  cos, sin, num_q_heads, HALF, HALF_PAD, Q_HEADS_PAD, 1.0, False)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        k_scale = 1.0
        v_scale = 1.0
        if KV_FP8:  # an fp8 cache: the layer's per-tensor scales
            k_scale = tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)
        _rotate_heads(k_ptr + t * stride_kt, k_cache_ptr + dst, stride_kh, stride_ch,
                      cos, sin, num_k_heads, HALF, HALF_PAD, K_HEADS_PAD, k_scale, KV_FP8)
        _copy_heads(v_ptr + t * stride_vt, v_cache_ptr + dst, stride_vh, stride_ch, num_k_heads,
                    HEAD_DIM, DIM_PAD, K_HEADS_PAD, v_scale, KV_FP8)


def triton_rotary_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                               cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The rotary embedding and the KV-cache write of one layer in one kernel: returns the
    rotated q (a new tensor); the rotated k and v go to flat slot slot_mapping[t] of the
    caches ([num_blocks, block_size, num_kv_heads, head_dim]), skipping slots < 0. Equal to
    triton_apply_rotary followed by write_kv_cache. q, k, v may be strided views of a
    fused qkv output (head_dim with unit stride). An fp8 (float8_e4m3fn) cache stores
    k / k_scale and v / v_scale (one-element float32 device tensors) saturated to +-448."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == cos_sin_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q_out = q.new_empty(q.shape)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    _rotary_kv_kernel[(num_tokens,)](
        q, k, v, q_out, k_cache, v_cache, cos_sin_cache, positions, slot_mapping,
        k_scale if fp8 else cos_sin_cache, v_scale if fp8 else cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        cos_sin_cache.stride(0), num_q_heads, num_k_heads,
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads), K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
        KV_FP8=fp8,
    )
    return q_out
