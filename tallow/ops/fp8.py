"""FP8 (e4m3) quantization in plain torch (any device, no Triton): what the Triton kernels
(tallow/ops/triton_fp8.py) and the loader's CPU fallback share."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
# The smallest scale: an all-zero row or channel quantizes to zeros, never to NaN.
MIN_SCALE = 1e-12


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (float8_e4m3fn [N, K], float32 scale [N]): scale = amax / 448 per
    output channel, q = round(w / scale) saturated to +-448 (torch's round to nearest even)."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=1) / FP8_MAX).clamp_(min=MIN_SCALE)
    q = (w32 / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [N, K] (float8_e4m3fn) times its per-channel ([N] or [N, 1]) or per-tensor scale, in dtype."""
    scale = scale.float().reshape(-1)
    return (q.float() * scale[:, None] if scale.numel() > 1 else q.float() * scale).to(dtype)
