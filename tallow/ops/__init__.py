"""Fused elementwise ops for the model code: Triton kernels on CUDA, plain torch elsewhere."""

from tallow.ops.activation import gelu_tanh_and_mul, silu_and_mul
from tallow.ops.norm import fused_add_rms_norm, head_rms_norm, rms_norm
from tallow.ops.rotary import apply_rotary

__all__ = ["apply_rotary", "fused_add_rms_norm", "gelu_tanh_and_mul", "head_rms_norm", "rms_norm", "silu_and_mul"]
