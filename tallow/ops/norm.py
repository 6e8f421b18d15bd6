"""RMSNorm, alone or fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tallow.ops import cpu_native


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension; x: [T, hidden]."""
    if x.is_cuda:
        from tallow.ops.triton_norm import triton_rms_norm

        return triton_rms_norm(x, None, weight, eps)[0]
    if x.dim() == 2 and x.is_contiguous() and cpu_native.usable(x, weight):
        return cpu_native.add_rms_norm(x, None, weight, eps)[0]
    return F.rms_norm(x, weight.shape, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual = x + residual (rounded to x's dtype); returns (rms_norm(residual), residual).
    Neither input is modified."""
    if x.is_cuda:
        from tallow.ops.triton_norm import triton_rms_norm

        return triton_rms_norm(x, residual, weight, eps)
    if (x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape
            and cpu_native.usable(x, residual, weight)):
        return cpu_native.add_rms_norm(x, residual, weight, eps)
    return torch_add_rms_norm(x, residual, weight, eps)


def torch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm in plain torch ops (any device)."""
    residual = x + residual
    return F.rms_norm(residual, weight.shape, weight, eps), residual
