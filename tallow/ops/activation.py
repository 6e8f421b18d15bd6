"""SwiGLU's gate: silu(gate) * up over the two halves of the fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tallow.ops import cpu_native


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * d] = (gate, up) -> silu(gate) * up, [T, d], in x's dtype."""
    if x.is_cuda:
        from tallow.ops.triton_activation import triton_silu_and_mul

        return triton_silu_and_mul(x)
    if x.dim() == 2 and x.is_contiguous() and x.shape[1] % 16 == 0 and cpu_native.usable(x):
        return cpu_native.silu_and_mul(x)
    return torch_silu_and_mul(x)


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu_and_mul in plain torch ops (any device): two kernels and a temporary."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU's gate (Gemma): x: [T, 2 * d] = (gate, up) -> gelu_tanh(gate) * up, [T, d], in
    plain torch ops on every device (gelu with the tanh approximation, as transformers'
    gelu_pytorch_tanh); on the CPU tallow's kernel where it applies (the fused layer's)."""
    if x.dim() == 2 and x.is_contiguous() and x.shape[1] % 16 == 0 and cpu_native.usable(x):
        return cpu_native.gelu_tanh_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
