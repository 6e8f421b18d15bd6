"""Rotary position embedding (rotate-half / NeoX layout) applied to q and k in one call."""

from __future__ import annotations

import torch


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim] by their tokens'
    positions [T]. cos_sin_cache: [max_positions, head_dim], cos of the head_dim/2 frequencies
    then their sin (RotaryEmbedding's table). Returns new tensors; the math is in float32."""
    if q.is_cuda:
        from tallow.ops.triton_rotary import triton_apply_rotary

        return triton_apply_rotary(q, k, positions, cos_sin_cache)
    return torch_apply_rotary(q, k, positions, cos_sin_cache)


def torch_apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                       cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary in plain torch ops (any device)."""
    cos, sin = cos_sin_cache[positions].float().unsqueeze(1).chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
