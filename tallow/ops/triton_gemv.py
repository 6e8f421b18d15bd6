"""Triton GEMV for one row: y[1, N] = x[1, K] @ W[N, K]^T (+ bias), bf16/fp16/fp32 weights.

At batch 1 a decode step is a chain of matrix-vector products that only stream weights.
cuBLAS picks split-K GEMM kernels for the mid-sized ones (Llama-3-8B's q/k/v and o
projections: 3.1-3.2 TB/s on an H200 against 4.0 for the MLP's, plus a split-K reduction
kernel each): here each program reduces BLOCK_N whole rows over K in float32, one pass over
the weights, no second kernel. The defaults are the fastest of a sweep on an H200 for the o
projection (4096 x 4096: 11.8 vs 13.1 us for cuBLAS); the LM head (128256 x 4096) takes 8 warps
(249 vs 285 us). q/k/v and the MLP stay with cuBLAS (no faster here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


def triton_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                block_n: int = 4, block_k: int = 1024, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """F.linear(x, weight, bias) for x of one row ([1, K] or [K]); weight [N, K] with unit
    stride along K."""
    K = weight.shape[1]
    assert x.numel() == K and weight.stride(1) == 1
    x = x.reshape(K)
    if not x.is_contiguous():
        x = x.contiguous()
    N = weight.shape[0]
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, y, N, K, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return y
