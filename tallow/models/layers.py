"""Building blocks of the Llama family: RMSNorm and rotary position embeddings."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.shape = (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.shape, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, float32, as transformers computes them.

    scaling: None, {"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}, {"rope_type": "linear", factor}, or
    {"rope_type": "freq_factors", "freq_factors": [...]} (per-frequency divisors, as GGUF
    files store llama3 scaling).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r}")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half, as transformers' Llama) over a precomputed table.

    forward(positions) returns (cos, sin), each [T, 1, head_dim] in the given dtype, with sin
    signed so that rotating x is x * cos + cat(x2, x1) * sin (see apply_rope). Compute them
    once per forward pass and share them across layers.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos_sin_cache", torch.empty(max_positions, head_dim, dtype=torch.float32),
                             persistent=False)
        if not self.cos_sin_cache.is_meta:  # on meta (LlamaForCausalLM skeletons) it is computed later
            self.reset_parameters()

    def reset_parameters(self, device: torch.device | None = None) -> None:
        """(Re)compute the table in float32, on device (default: where the table is now)."""
        device = self.cos_sin_cache.device if device is None else device
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        self.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin from RotaryEmbedding."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin)
