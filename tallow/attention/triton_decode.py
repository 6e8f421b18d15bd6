"""Paged decode attention in Triton: one query token per sequence, split-K (flash-decoding).

Each program takes one sequence, one KV head and one split of the sequence's context. It
loads the queries of every head that shares the KV head (GQA), so each K/V tile is read
from memory once per KV head. With more than one split, each program writes a partial
output and its log-sum-exp, and a second kernel merges the splits.

The grid is (num_seqs, num_kv_heads, num_splits): it depends on the batch's shape and
num_splits only. How many splits a sequence really uses is decided inside the kernel from
its length (no split shorter than MIN_TILES_PER_SPLIT tiles), so short contexts in a grid
sized for long ones just leave the extra programs empty.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES_PER_SPLIT: tl.constexpr,
    DIRECT_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if seq_len == 0:  # padding sequence
        return

    # This split's tiles of BLOCK_N context tokens.
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    splits_used = tl.maximum(tl.minimum(num_splits, tl.cdiv(num_tiles, MIN_TILES_PER_SPLIT)), 1)
    tiles_per_split = tl.cdiv(num_tiles, splits_used)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM_PAD)
    head_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=head_mask[:, None] & d_mask[None, :], other=0.0)

    if KV_FP8:  # an fp8 cache holds k / k_scale, v / v_scale: k's scale folds into the logits'
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_start, tile_end):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < seq_len
        block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = block * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None],
                    mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        if KV_FP8:
            k = k.to(q_ptr.dtype.element_ty)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        if KV_FP8:
            v = v.to(q_ptr.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # an empty split leaves l_i == 0
    if DIRECT_OUT:
        tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & d_mask[None, :])
    else:
        part = seq.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part[:, None] + d[None, :], out,
                 mask=head_mask[:, None] & d_mask[None, :])
        lse = m_i + tl.log2(l_i)  # log2 units; -inf for an empty split
        tl.store(part_lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


@triton.jit
def _decode_merge_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, seq_lens_ptr, num_splits,
    stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    # One program per (sequence, query head): out = sum_s w_s * out_s / sum_s w_s, w_s = 2^lse_s.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if tl.load(seq_lens_ptr + seq) == 0:
        return
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    lse = tl.load(part_lse_ptr + seq * stride_lb + head * stride_lh + s,
                  mask=s < num_splits, other=float("-inf"))
    used = lse > float("-inf")  # split 0 always holds at least one token
    w = tl.where(used, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    part = part_out_ptr + seq.to(tl.int64) * stride_pb + head * stride_ph
    o = tl.load(part + s[:, None] * stride_ps + d[None, :],
                mask=used[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float, num_splits: int,
                     partial_out: torch.Tensor | None = None,
                     partial_lse: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> None:
    """Attention of one query token per sequence over its paged context, written into out.

    q, out: [T, num_heads, head_dim] (row query_start_loc[b] belongs to sequence b);
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]. Sequences with
    seq_lens 0 are padding: their output rows are left untouched. With num_splits > 1,
    partial_out [>= B*num_heads*num_splits*head_dim] and partial_lse
    [>= B*num_heads*num_splits] float32 buffers hold the per-split results. An fp8
    (float8_e4m3fn) cache is read as k * k_scale, v * v_scale (one-element float32 tensors).
    """
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    assert q.stride(-1) == out.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if num_seqs == 0:
        return
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    direct = num_splits == 1
    if direct:
        partial_out = partial_lse = out  # unused by the kernel
        part_strides = (0, 0, 0, 0, 0)
    else:
        partial_out = partial_out[: num_seqs * num_heads * num_splits * head_dim].view(
            num_seqs, num_heads, num_splits, head_dim)
        partial_lse = partial_lse[: num_seqs * num_heads * num_splits].view(
            num_seqs, num_heads, num_splits)
        part_strides = (*partial_out.stride()[:3], *partial_lse.stride()[:2])
    on_gpu = q.is_cuda
    fp8 = _check_fp8_scales(k_cache, k_scale, v_scale)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, partial_out, partial_lse,
        query_start_loc, seq_lens, block_tables, k_scale if fp8 else seq_lens, v_scale if fp8 else seq_lens,
        scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *part_strides,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=64 if on_gpu else 16, MIN_TILES_PER_SPLIT=1,
        DIRECT_OUT=direct, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=fp8,
        num_warps=4, num_stages=2,
    )
    if not direct:
        _decode_merge_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_lse, query_start_loc, seq_lens, num_splits,
            out.stride(0), out.stride(1), *part_strides,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )


def _check_fp8_scales(k_cache: torch.Tensor, k_scale, v_scale) -> bool:
    """Whether the cache is fp8; an fp8 cache must come with its scales."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    return fp8


def num_decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int, max_splits: int) -> int:
    """How many splits to launch per (sequence, KV head): enough programs for about two
    waves over the GPU's SMs, a power of two, at most max_splits. A function of the batch's
    shape only, so it is fixed for a captured CUDA graph."""
    programs = num_seqs * num_kv_heads
    want = triton.cdiv(2 * num_sms, max(programs, 1))
    return max(1, min(max_splits, triton.next_power_of_2(want)))
