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


def head_rms_norm(qk: torch.Tensor, num_q_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """Qwen3's and Gemma 3's q/k norms: each head of qk [T, q heads + k heads, head_dim] (q first)
    normalized with its weight. On the CPU with tallow's kernels in place (qk's rows may be
    strided, as a view of the qkv projection; the fused layer's kernel); elsewhere a new tensor."""
    if qk.stride(1) == qk.shape[2] and cpu_native.usable(qk, q_weight, k_weight):  # CPU float32, D % 8 == 0
        cpu_native.head_rms_norm_(qk[:, :num_q_heads], q_weight, eps)
        cpu_native.head_rms_norm_(qk[:, num_q_heads:], k_weight, eps)
        return qk
    return torch.cat((F.rms_norm(qk[:, :num_q_heads], q_weight.shape, q_weight, eps),
                      F.rms_norm(qk[:, num_q_heads:], k_weight.shape, k_weight, eps)), dim=1)
