"""Paged attention in Triton for prefill and mixed batches (flash-attention tiling).

One kernel handles the whole flat batch, decode tokens and prefill chunks alike (the shape
of vLLM's Triton "unified attention"). Each program takes BLOCK_Q query tokens of one
sequence and all the query heads of one KV head, packed into BLOCK_M = BLOCK_Q * GROUP
rows, and runs an online softmax over the sequence's paged context: the cached prefix and
the new tokens up to its causal limit.

The grid is (T // BLOCK_Q + B, num_kv_heads), an upper bound on the number of query tiles
that depends on the batch's shape only; each program finds its sequence by binary search
over query_start_loc, and programs past the end of their sequence's queries exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tallow.attention.triton_decode import _check_fp8_scales

LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query tiles hold global tile q_tile. Sequence b's tiles start at
    query_start_loc[b] // BLOCK_Q + b, which never decreases with b."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_tile = q_tile - (q_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    # Row r holds query token local_tile * BLOCK_Q + r // GROUP of head kv_head * GROUP + r % GROUP.
    r = tl.arange(0, BLOCK_M)
    q_idx = local_tile * BLOCK_Q + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    row_mask = (r // GROUP < BLOCK_Q) & (q_idx < q_len)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    tokens = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    positions = prefix_len + q_idx  # key n is visible to a row iff n <= its position

    if KV_FP8:  # an fp8 cache holds k / k_scale, v / v_scale: k's scale folds into the logits'
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_end = tl.minimum(seq_len, prefix_len + (local_tile + 1) * BLOCK_Q)
    for start in range(0, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = block * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None],
                    mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        if KV_FP8:
            k = k.to(q_ptr.dtype.element_ty)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = n_mask[None, :] & (n[None, :] <= positions[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past q_len see no key
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        if KV_FP8:
            v = v.to(q_ptr.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      block_tables: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Causal attention of every sequence's query tokens over its paged context, into out.

    q, out: [T, num_heads, head_dim]; sequence b owns rows query_start_loc[b] ..
    query_start_loc[b+1]-1, at positions seq_lens[b]-query_len .. seq_lens[b]-1 of its
    context; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] already
    hold every context token, the new ones included; an fp8 (float8_e4m3fn) cache is read
    as k * k_scale, v * v_scale (one-element float32 tensors).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    assert q.stride(-1) == out.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return
    if q.is_cuda:
        small = head_dim > 128 or q.element_size() == 4  # keep the tiles in shared memory
        block_m, block_n, warps = (64, 32, 4) if small else (128, 64, 8)
    else:  # the interpreter: small tiles keep tests quick and cross tile edges often
        block_m, block_n, warps = 16, 16, 4
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    fp8 = _check_fp8_scales(k_cache, k_scale, v_scale)
    _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
        k_scale if fp8 else seq_lens, v_scale if fp8 else seq_lens,
        scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=fp8,
        num_warps=warps, num_stages=2,
    )
