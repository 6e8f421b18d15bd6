"""GGUF block-quantized weights repacked into planes for tallow's Triton quant kernels.

A GGUF tensor of N rows and K columns in a block format is N * K / block_elems structs of
block_bytes each (`gguf.GGUFReader` gives them as a uint8 array of shape [N, row_bytes]). The
structs interleave fp16 scales, packed sub-block scales and quant bits; `repack` splits them
into planes, one contiguous [N, ...] tensor per field, so that a kernel reads each field of a
row segment with contiguous (coalesced, vectorizable) loads:

| format | planes (per block)                                                   | bytes / block (file) |
|--------|----------------------------------------------------------------------|----------------------|
| Q8_0   | qs int8 [32], d fp16                                                 | 34 (34)   |
| Q4_0   | qs uint8 [16] (GGUF nibble order), d fp16                            | 18 (18)   |
| Q4_1   | qs [16], d fp16, m fp16                                              | 20 (20)   |
| Q5_0   | qs [16], qh int32 (bit i: element i's fifth bit), d fp16             | 22 (22)   |
| Q5_1   | qs [16], qh int32, d fp16, m fp16                                    | 24 (24)   |
| Q4_K   | qs [128], sc uint8 [8], mn uint8 [8] (6-bit fields unpacked), d, dmin | 148 (144) |
| Q5_K   | qs [128], qh [32], sc [8], mn [8], d, dmin                           | 180 (176) |
| Q6_K   | ql [128], qh [64], sc int8 [16], d fp16                              | 210 (210) |

Quant bits stay in GGUF's order inside each plane (the kernels map byte positions to columns),
so repacking is slicing plus, for Q4_K/Q5_K, unpacking the 12 bytes of 6-bit scales and mins
(`gguf.quants.Q4_K.get_scale_min`) into one byte each. Everything is torch, on the tensor's
device. `dequantize` is the torch reference of the planes (float32), checked against
`gguf.quants.dequantize` in tests/test_triton_quant.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# name -> (elements per block, bytes per block); the same as gguf.GGML_QUANT_SIZES.
BLOCK_SIZES = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}
FORMATS = tuple(BLOCK_SIZES)
# Offsets of the fp16 fields in a block struct (d first), for making valid random blocks.
_FP16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


@dataclass
class QuantWeight:
    """One weight [N, K] in planes. Unused planes are None."""

    fmt: str
    N: int
    K: int
    qs: torch.Tensor                  # quant bits ([N, K] int8 for Q8_0, [N, K/2] uint8 otherwise)
    d: torch.Tensor                   # [N, K/block] fp16 block scales
    qh: torch.Tensor | None = None    # fifth / high bits
    m: torch.Tensor | None = None     # Q4_1/Q5_1 block mins (fp16), Q4_K/Q5_K dmin (fp16)
    sc: torch.Tensor | None = None    # K-quant sub-block scales ([N, K/32] uint8; Q6_K [N, K/16] int8)
    mn: torch.Tensor | None = None    # Q4_K/Q5_K sub-block mins ([N, K/32] uint8)

    @property
    def blocks_per_row(self) -> int:
        return self.K // BLOCK_SIZES[self.fmt][0]

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def planes(self) -> list[torch.Tensor]:
        return [p for p in (self.qs, self.d, self.qh, self.m, self.sc, self.mn) if p is not None]

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.planes())


def _fp16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    N, nb, _ = blocks.shape
    return blocks[:, :, offset:offset + 2].contiguous().view(torch.float16).reshape(N, nb)


def _bytes(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    N = blocks.shape[0]
    return blocks[:, :, start:stop].contiguous().reshape(N, -1)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of 6-bit scales and mins of Q4_K/Q5_K blocks [N, nb, 12] -> ([N, nb*8] uint8,)*2,
    as gguf.quants.Q4_K.get_scale_min."""
    N, nb, _ = scales.shape
    s = scales.reshape(N, nb, 3, 4)
    d, m, m_d = s[:, :, 0], s[:, :, 1], s[:, :, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.reshape(N, nb * 8).contiguous(), mn.reshape(N, nb * 8).contiguous()


def repack(raw: torch.Tensor, fmt: str, K: int) -> QuantWeight:
    """GGUF block bytes of a weight [N, K] (uint8 [N, K / block_elems * block_bytes], or any
    shape with that many bytes per row) -> QuantWeight on raw's device."""
    if fmt not in BLOCK_SIZES:
        raise ValueError(f"unsupported quant format {fmt!r} (supported: {', '.join(FORMATS)})")
    elems, nbytes = BLOCK_SIZES[fmt]
    if K % elems:
        raise ValueError(f"{fmt}: K={K} is not a multiple of the block size {elems}")
    nb = K // elems
    raw = raw.reshape(raw.shape[0], -1)
    if raw.dtype != torch.uint8 or raw.shape[1] != nb * nbytes:
        raise ValueError(f"{fmt}: expected uint8 rows of {nb * nbytes} bytes for K={K}, "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    N = raw.shape[0]
    blocks = raw.reshape(N, nb, nbytes)
    if fmt == "Q8_0":
        return QuantWeight(fmt, N, K, qs=_bytes(blocks, 2, 34).view(torch.int8), d=_fp16(blocks, 0))
    if fmt == "Q4_0":
        return QuantWeight(fmt, N, K, qs=_bytes(blocks, 2, 18), d=_fp16(blocks, 0))
    if fmt == "Q4_1":
        return QuantWeight(fmt, N, K, qs=_bytes(blocks, 4, 20), d=_fp16(blocks, 0), m=_fp16(blocks, 2))
    if fmt == "Q5_0":
        return QuantWeight(fmt, N, K, qs=_bytes(blocks, 6, 22), d=_fp16(blocks, 0),
                           qh=_bytes(blocks, 2, 6).view(torch.int32))
    if fmt == "Q5_1":
        return QuantWeight(fmt, N, K, qs=_bytes(blocks, 8, 24), d=_fp16(blocks, 0), m=_fp16(blocks, 2),
                           qh=_bytes(blocks, 4, 8).view(torch.int32))
    if fmt == "Q4_K":
        sc, mn = _k_scale_min(blocks[:, :, 4:16])
        return QuantWeight(fmt, N, K, qs=_bytes(blocks, 16, 144), d=_fp16(blocks, 0), m=_fp16(blocks, 2),
                           sc=sc, mn=mn)
    if fmt == "Q5_K":
        sc, mn = _k_scale_min(blocks[:, :, 4:16])
        return QuantWeight(fmt, N, K, qs=_bytes(blocks, 48, 176), qh=_bytes(blocks, 16, 48), d=_fp16(blocks, 0),
                           m=_fp16(blocks, 2), sc=sc, mn=mn)
    # Q6_K
    return QuantWeight(fmt, N, K, qs=_bytes(blocks, 0, 128), qh=_bytes(blocks, 128, 192),
                       sc=_bytes(blocks, 192, 208).view(torch.int8), d=_fp16(blocks, 208))


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Packed bytes [N, G*group] -> [N, G, 2, group] (low nibbles, then high) as int32."""
    q = qs.reshape(qs.shape[0], -1, 1, group).to(torch.int32)
    return torch.cat([q & 0xF, q >> 4], dim=2)


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The weight [N, K] in float32, computed in torch from the planes (the reference the
    kernels are benchmarked against on the device)."""
    N, K, nb = w.N, w.K, w.blocks_per_row
    d = w.d.float()
    if w.fmt == "Q8_0":
        return (w.qs.float().reshape(N, nb, 32) * d[:, :, None]).reshape(N, K)
    if w.fmt in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        q = _nibbles(w.qs, 16).reshape(N, nb, 32)
        if w.qh is not None:
            bits = torch.arange(32, device=w.device, dtype=torch.int32)
            q = q | (((w.qh[:, :, None] >> bits) & 1) << 4)
        q = q.float()
        if w.fmt in ("Q4_0", "Q5_0"):
            q = q - (8 if w.fmt == "Q4_0" else 16)
            return (q * d[:, :, None]).reshape(N, K)
        return (q * d[:, :, None] + w.m.float()[:, :, None]).reshape(N, K)
    if w.fmt in ("Q4_K", "Q5_K"):
        q = _nibbles(w.qs, 32).reshape(N, nb * 8, 32)  # sub-block 2g: low nibbles of group g
        if w.qh is not None:
            bits = torch.arange(8, device=w.device, dtype=torch.int32).reshape(1, 1, 8, 1)
            hi = (w.qh.reshape(N, nb, 1, 32).to(torch.int32) >> bits) & 1  # [N, nb, 8 sub-blocks, 32]
            q = q | (hi.reshape(N, nb * 8, 32) << 4)
        scale = d.repeat_interleave(8, dim=1) * w.sc.float()
        mins = w.m.float().repeat_interleave(8, dim=1) * w.mn.float()
        return (q.float() * scale[:, :, None] - mins[:, :, None]).reshape(N, K)
    # Q6_K
    ql = _nibbles(w.qs, 64).reshape(N, nb, 2, 2, 64)  # [half, nibble, j]: element 128h + 64s + j
    low = ql.reshape(N, nb, 256)
    qh = w.qh.reshape(N, nb, 2, 1, 32).to(torch.int32)
    # (arange, not torch.tensor: no host-to-device copy, so a CUDA graph can capture it)
    shifts = (2 * torch.arange(4, device=w.device, dtype=torch.int32)).reshape(1, 1, 1, 4, 1)
    high = ((qh >> shifts) & 3).reshape(N, nb, 256)  # element 128h + 32t + j
    q = (low | (high << 4)).float() - 32
    scale = d.repeat_interleave(16, dim=1) * w.sc.float()
    return (q.reshape(N, nb * 16, 16) * scale[:, :, None]).reshape(N, K)


def random_blocks(fmt: str, N: int, K: int, *, generator: torch.Generator | None = None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Valid random GGUF block bytes for a weight [N, K]: random quant bits and packed scales,
    the fp16 fields overwritten with finite values of either sign around 1 / (the format's
    largest quant magnitude), so weights are O(0.01 .. 1)."""
    elems, nbytes = BLOCK_SIZES[fmt]
    nb = K // elems
    raw = torch.randint(0, 256, (N, nb, nbytes), dtype=torch.uint8, device=device, generator=generator)
    base = {"Q8_0": 1 / 128, "Q4_0": 1 / 8, "Q4_1": 1 / 16, "Q5_0": 1 / 16, "Q5_1": 1 / 32,
            "Q4_K": 1 / (16 * 63), "Q5_K": 1 / (32 * 63), "Q6_K": 1 / (32 * 127)}[fmt]
    for offset in _FP16_FIELDS[fmt]:
        u = torch.rand(N, nb, device=device, generator=generator)
        sign = torch.where(torch.rand(N, nb, device=device, generator=generator) < 0.5, -1.0, 1.0)
        value = (sign * base * (0.25 + 1.75 * u)).to(torch.float16)
        raw[:, :, offset:offset + 2] = value.view(torch.uint8).reshape(N, nb, 2)
    return raw.reshape(N, nb * nbytes)
