"""Triton RMSNorm with an optional fused residual add: one program per row, one pass over memory."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, num_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / num_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def triton_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual), x + residual), or (rms_norm(x), None) without a residual.
    x, residual: [T, hidden] with unit stride in hidden."""
    num_rows, num_cols = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else None
    if num_rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(num_cols)
    _rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x, weight, out,
        residual_out if residual_out is not None else out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        residual_out.stride(0) if residual_out is not None else 0, num_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
    )
    return out, residual_out
