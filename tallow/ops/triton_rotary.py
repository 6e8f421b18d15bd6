"""Triton rotary embedding: one program per token rotates all its q and k heads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, out_ptr, stride_x, stride_o, cos, sin, num_heads,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    mask = (h < num_heads)[:, None] & (i < HALF)[None, :]
    src = x_ptr + h[:, None] * stride_x + i[None, :]
    dst = out_ptr + h[:, None] * stride_o + i[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(ty), mask=mask)


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
                  cos, sin, num_q_heads, HALF, HALF_PAD, Q_HEADS_PAD)
    _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * stride_okt, stride_kh, stride_okh,
                  cos, sin, num_k_heads, HALF, HALF_PAD, K_HEADS_PAD)


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
