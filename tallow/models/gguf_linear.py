"""GGUF tensors kept in their own block formats: integer codes and scales read from the file's
raw blocks, Linear layers and an embedding built on them.

Formats (gguf.constants.GGML_QUANT_SIZES, layouts as gguf.quants dequantizes them):
  Q4_0 w = d (q - 8), Q4_1 w = d q + m      -> quant.Q4Linear (Q4_0 as m = -8 d, exact in float16)
  Q8_0 w = d q                              -> quant.Q8Linear
  Q5_0 w = d (q - 16), Q5_1 w = d q + m, Q4_K / Q5_K w = (d sc) q - dmin mn (per 32 of a
  super-block of 256), Q6_K w = (d sc) (q - 32) (sc per 16)  -> GgufLinear (linear_gguf.h)
  F32 -> nn.Linear (a float source: --quantization applies), F16 / BF16 -> HalfLinear.
Each layer holds the codes repacked into its kernel's tiles, no wider than in the file (4, 5 or 6
bits per weight plus the scales). Without tallow's kernels (or for a shape they cannot take)
a tensor is dequantized on its own into a float32 DequantizedLinear.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tallow.models import quant
from tallow.ops import cpu_native

QK = 32  # inputs per block (sub-block of the K formats)
QK_K = 256  # inputs per K-quant super-block

# GGML type name -> the kernel's format code (linear_gguf.h)
GGUF_KERNEL_FORMATS = {"Q5_0": 0, "Q5_1": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4}
FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0", *GGUF_KERNEL_FORMATS)
SUPPORTED_TYPES = FLOAT_TYPES + BLOCK_TYPES


def type_name(qtype) -> str:
    return qtype.name if hasattr(qtype, "name") else str(qtype)


def block_shape(qtype) -> tuple[int, int]:
    """(weights, bytes) per block of a GGML type."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name(qtype)]]


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per entry (last axis) as float16."""
    return np.ascontiguousarray(b).view(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles first, then the high ones (Q4_0/Q4_1/Q5_x)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def decode_blocks(raw: np.ndarray, qtype) -> dict[str, np.ndarray]:
    """The integer codes and scales of a block-quantized tensor's rows, as the file holds them.

    raw: [rows, row_bytes] uint8. Returns q [rows, in] (uint8 codes; Q8_0: int8) and per format
    d, m (float16 [rows, in / 32]), or for the K formats d, dmin (float16 [rows, in / 256]) and
    sc, mn (uint8 [rows, in / 32]; Q6_K: sc int8 [rows, in / 16]).
    """
    from gguf.quants import Q4_K

    name = type_name(qtype)
    block, size = block_shape(qtype)
    rows = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(-1, size)
    nblk = b.shape[0]

    def per_row(a: np.ndarray) -> np.ndarray:
        return a.reshape(rows, -1)

    if name == "Q4_0":
        return {"q": per_row(_nibbles(b[:, 2:])), "d": per_row(_f16(b[:, :2]))}
    if name == "Q4_1":
        return {"q": per_row(_nibbles(b[:, 4:])), "d": per_row(_f16(b[:, :2])), "m": per_row(_f16(b[:, 2:4]))}
    if name == "Q8_0":
        return {"q": per_row(b[:, 2:].view(np.int8)), "d": per_row(_f16(b[:, :2]))}
    if name in ("Q5_0", "Q5_1"):
        off = 2 if name == "Q5_0" else 4
        qh = np.ascontiguousarray(b[:, off:off + 4]).view(np.uint32)  # bit i: element i's bit 4
        hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        out = {"q": per_row(_nibbles(b[:, off + 4:]) | (hi << 4)), "d": per_row(_f16(b[:, :2]))}
        if name == "Q5_1":
            out["m"] = per_row(_f16(b[:, 2:4]))
        return out
    if name in ("Q4_K", "Q5_K"):
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))  # gguf's own unpacking of the 6-bit pairs
        qs = b[:, 16:144] if name == "Q4_K" else b[:, 48:176]
        q = ((qs.reshape(nblk, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(nblk, 256)
        if name == "Q5_K":
            qh = b[:, 16:48].reshape(nblk, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = q | ((qh & 1).reshape(nblk, 256) << 4)
        return {"q": per_row(q), "d": per_row(_f16(b[:, :2])), "dmin": per_row(_f16(b[:, 2:4])),
                "sc": per_row(sc.astype(np.uint8)), "mn": per_row(mn.astype(np.uint8))}
    if name == "Q6_K":
        ql = (b[:, :128].reshape(nblk, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        qh = (b[:, 128:192].reshape(nblk, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        q = ql.reshape(nblk, 256) | (qh.reshape(nblk, 256) << 4)
        return {"q": per_row(q), "d": per_row(_f16(b[:, 208:210])), "sc": per_row(b[:, 192:208].view(np.int8))}
    raise ValueError(f"no block decoder for GGUF type {name}")


def dequantize_codes(codes: dict[str, np.ndarray], qtype) -> torch.Tensor:
    """float32 [rows, in] from decode_blocks' output, by gguf.quants' arithmetic (float32, the
    same operations in the same order)."""
    name = type_name(qtype)
    q = torch.from_numpy(np.ascontiguousarray(codes["q"]))
    rows, k = q.shape
    if name in ("Q4_K", "Q5_K", "Q6_K"):
        d = torch.from_numpy(codes["d"].copy()).float().repeat_interleave(QK_K // (16 if name == "Q6_K" else QK), 1)
        sc = torch.from_numpy(codes["sc"].copy()).float()
        per = 16 if name == "Q6_K" else QK
        dl = (d * sc).repeat_interleave(per, 1)
        if name == "Q6_K":
            return dl * (q.float() - 32)
        dm = torch.from_numpy(codes["dmin"].copy()).float().repeat_interleave(QK_K // QK, 1) \
            * torch.from_numpy(codes["mn"].copy()).float()
        return dl * q.float() - dm.repeat_interleave(QK, 1)
    d = torch.from_numpy(codes["d"].copy()).float().repeat_interleave(QK, 1)
    if name in ("Q4_1", "Q5_1"):
        return d * q.float() + torch.from_numpy(codes["m"].copy()).float().repeat_interleave(QK, 1)
    zero = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 0}[name]
    return d * (q.float() - zero)


def dequantize_raw(raw: np.ndarray, qtype) -> torch.Tensor:
    """float32 [rows, in] of a tensor's raw rows [rows, row_bytes] in any supported type."""
    name = type_name(qtype)
    if name in FLOAT_TYPES:
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
        return torch.from_numpy(np.ascontiguousarray(raw).copy()).view(dtype).float().view(raw.shape[0], -1)
    return dequantize_codes(decode_blocks(raw, qtype), qtype)


# ---- the kernels' layout (tallow/ops/cpu/linear_gguf.h) -------------------------------------

def plane_layout() -> int:
    """The bit planes' order in the kernels lib() hands out: 1 lanes (AVX2), 0 words (AVX-512)."""
    return cpu_native.lib().tl_gguf_plane_layout()


def _tile_planes(q: torch.Tensor, planes: int, tile: int, layout: int) -> torch.Tensor:
    """Codes [n, k] -> [tiles, blocks, 256 + 64 planes] bytes (linear_gguf.h): with quad v =
    inputs 4v..4v+3 of a block, the low nibbles in 4 groups of 64 bytes, group g's byte 4c + i =
    q(c, 4g + i) & 15 | (q(c, 16 + 4g + i) & 15) << 4; then per plane p the bits 4 + p of the
    codes: layout 0 (words) 8 uint64 words, word v's bit 4c + i = bit 4 + p of q(c, 4v + i);
    layout 1 (lanes) 64 bytes, byte 4c + i's bit v = the same bit."""
    t = quant._tiles_of(q.to(torch.uint8), tile)  # [T, tile, k]
    T, nb = t.shape[0], q.shape[1] // QK
    t = t.view(T, tile, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [T, nb, v, c, i]
    nib = ((t[:, :, :4] & 0x0F) | ((t[:, :, 4:] & 0x0F) << 4)).reshape(T, nb, 16 * tile).contiguous()
    if not planes:
        return nib
    t = t.numpy()
    if layout:
        t = np.ascontiguousarray(t.transpose(0, 1, 3, 4, 2))  # [T, nb, c, i, v]
    else:
        t = t.reshape(T, nb, 8, 4 * tile)  # [T, nb, v, 4c + i]
    words = [np.packbits((t >> (4 + p)) & 1, axis=-1, bitorder="little").reshape(T, nb, 64) for p in range(planes)]
    return torch.cat((nib, torch.from_numpy(np.concatenate(words, axis=-1))), dim=-1).contiguous()


def _untile_planes(packed: torch.Tensor, n: int, planes: int, tile: int, layout: int) -> torch.Tensor:
    """The inverse of _tile_planes: codes [n, k] as uint8."""
    T, nb = packed.shape[:2]
    nib = packed[..., :16 * tile].reshape(T, nb, 4, tile, 4)
    t = torch.cat((nib & 0x0F, nib >> 4), dim=2)  # [T, nb, v, c, i]
    for p in range(planes):
        words = packed[..., 16 * tile + 64 * p: 16 * tile + 64 * (p + 1)].contiguous().numpy()
        if layout:  # [T, nb, c, i] bytes, bit v -> [T, nb, v, c, i]
            bits = np.unpackbits(words.reshape(T, nb, tile, 4, 1), axis=-1, bitorder="little").transpose(0, 1, 4, 2, 3)
        else:  # [T, nb, v] words, bit 4c + i
            bits = np.unpackbits(words.reshape(T, nb, 8, 8), axis=-1, bitorder="little").reshape(T, nb, 8, tile, 4)
        t = t | (torch.from_numpy(np.ascontiguousarray(bits)) << (4 + p))
    return t.permute(0, 3, 1, 2, 4).reshape(T * tile, -1)[:n]


def _tile_k(x: torch.Tensor, tile: int) -> torch.Tensor:
    """Per-row scales [n, s] -> [tiles, s, tile]."""
    return quant._tile_scales(x, tile)


class GgufLinear(quant._NativeBlockLinear):
    """A GGUF Q5_0, Q5_1, Q4_K, Q5_K or Q6_K weight, its codes and scales as in the file,
    repacked into tiles of 16 output channels (both builds; linear_gguf.h): 5, 6 or 4.x bits
    per weight. float32 in and out, activations int8 per block of 32, exact integer dot
    products per block, float scale math in a fixed order per output (batch invariant).
    Build with from_codes (or linear_from_raw, which packs a large tensor a chunk of rows at
    a time)."""

    _kernel = "tl_gguf_linear"
    _weight_buffers = ("qweight", "d", "m", "sc", "mn")

    def __init__(self, *args, **kwargs):
        raise TypeError("build a GgufLinear with GgufLinear.from_codes or gguf_linear.linear_from_raw")

    @staticmethod
    def format_attrs(qtype) -> dict:
        name = type_name(qtype)
        if name not in GGUF_KERNEL_FORMATS:
            raise ValueError(f"GgufLinear takes {', '.join(GGUF_KERNEL_FORMATS)}, not {name}")
        return {"gguf_type": name, "fmt": GGUF_KERNEL_FORMATS[name], "planes": {"Q4_K": 0, "Q6_K": 2}.get(name, 1)}

    @classmethod
    def from_codes(cls, codes: dict[str, np.ndarray], qtype, bias: torch.Tensor | None = None) -> "GgufLinear":
        attrs = cls.format_attrs(qtype)
        cls.check_shape(attrs["gguf_type"], codes["q"].shape)
        return cls.from_tiles(codes["q"].shape, cls.tile_codes(codes, qtype, cls.kernel_tile()), bias, **attrs)

    @staticmethod
    def tile_codes(codes: dict[str, np.ndarray], qtype, tile: int) -> dict[str, torch.Tensor | None]:
        """decode_blocks' arrays in the kernel's tiles (linear_gguf.h; the bit planes in the order
        of the kernels lib() hands out)."""
        attrs = GgufLinear.format_attrs(qtype)

        def t(name: str) -> torch.Tensor | None:
            a = codes.get(name)
            return None if a is None else torch.from_numpy(np.ascontiguousarray(a))

        out = {"qweight": _tile_planes(t("q"), attrs["planes"], tile, plane_layout()), "d": _tile_k(t("d"), tile)}
        m = t("m") if "m" in codes else t("dmin")
        out["m"] = None if m is None else _tile_k(m, tile)
        sc = t("sc")
        if sc is not None and attrs["gguf_type"] == "Q6_K":  # [n, blocks * 2] -> [tiles, blocks, 2, tile]
            s = quant._tiles_of(sc, tile)
            out["sc"] = s.view(s.shape[0], tile, -1, 2).permute(0, 2, 3, 1).contiguous()
        else:
            out["sc"] = None if sc is None else _tile_k(sc, tile)
        out["mn"] = None if t("mn") is None else _tile_k(t("mn"), tile)
        return out

    @staticmethod
    def check_shape(gguf_type: str, shape: tuple[int, int]) -> None:
        per = QK_K if gguf_type.endswith("_K") else QK
        if shape[1] % per:
            raise ValueError(f"GgufLinear {gguf_type} needs in_features divisible by {per}, got {tuple(shape)}")

    @staticmethod
    def _tile_channels(lib) -> int:
        return lib.tl_gguf_tile_channels()

    def _check_shape(self, shape: tuple[int, int]) -> None:
        self.check_shape(self.gguf_type, shape)

    def _set_pointers(self) -> None:
        super()._set_pointers()
        self._ptrs = (self.fmt, *self._ptrs)

    def codes(self) -> dict[str, np.ndarray]:
        """decode_blocks' arrays back from the tiles (the inverse of the packing)."""
        n, tile = self.out_features, self.tile
        out = {"q": _untile_planes(self.qweight, n, self.planes, tile, plane_layout()).numpy(),
               "d": quant._untile_scales(self.d, n).numpy()}
        if self.m is not None:
            out["m" if self.gguf_type == "Q5_1" else "dmin"] = quant._untile_scales(self.m, n).numpy()
        if self.gguf_type == "Q6_K":
            out["sc"] = self.sc.permute(0, 3, 1, 2).reshape(-1, self.sc.shape[1] * 2)[:n].numpy()
        elif self.sc is not None:
            out["sc"] = quant._untile_scales(self.sc, n).numpy()
        if self.mn is not None:
            out["mn"] = quant._untile_scales(self.mn, n).numpy()
        return out

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_codes(self.codes(), self.gguf_type)

    def extra_repr(self) -> str:
        return f"{self.gguf_type}, in_features={self.in_features}, out_features={self.out_features}"


class HalfLinear(nn.Module):
    """A float16 or bfloat16 weight kept as stored, float32 in and out. With tallow's kernels
    (in_features % 8 == 0): tl_half_linear, each output one float32 dot product in a fixed order
    (batch invariant); otherwise the weight widened per call for F.linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        lib = cpu_native.lib()
        self._fn = lib.tl_half_linear if lib is not None and self.in_features % 8 == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fn is None or self.weight.device.type != "cpu":
            return F.linear(x.float(), self.weight.float(), self.bias)
        rows = x.reshape(-1, self.in_features).float().contiguous()
        y = torch.empty(rows.shape[0], self.out_features)
        if rows.shape[0]:
            self._fn(rows.data_ptr(), rows.shape[0], self.in_features, self.out_features, self.weight.data_ptr(),
                     int(self.weight.dtype == torch.bfloat16), None if self.bias is None else self.bias.data_ptr(),
                     y.data_ptr(), torch.get_num_threads())
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float()


class DequantizedLinear(nn.Linear):
    """A block-quantized tensor dequantized to float32 on its own (no kernels for it here): kept
    out of quantize_model_'s re-quantization (it is not a plain nn.Linear)."""

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.detach()


class ConcatLinear(nn.Module):
    """Several Linear layers side by side (a fused q/k/v or gate/up projection whose parts the
    file stores in different formats): their outputs concatenated."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def dequantized_weight(self) -> torch.Tensor:
        return torch.cat([p.dequantized_weight() for p in self.parts])


def kernel_layer(qtype, shape: tuple[int, int]) -> tuple[type, dict] | None:
    """(layer class, its format attrs) that runs a block-quantized weight of this type and shape
    [out, in] on tallow's CPU kernels from its repacked tiles, or None (a float type, no kernels
    here, or a shape they do not take: linear_from_raw dequantizes it)."""
    name = type_name(qtype)
    if name not in BLOCK_TYPES or cpu_native.lib() is None:
        return None
    if name in ("Q4_0", "Q4_1", "Q8_0"):
        fits = quant.native_fits(torch.empty(shape, device="meta"))
        return ((quant.Q8Linear if name == "Q8_0" else quant.Q4Linear), {}) if fits else None
    fits = shape[1] % (QK_K if name.endswith("_K") else QK) == 0
    return (GgufLinear, GgufLinear.format_attrs(name)) if fits else None


def linear_from_raw(raw: np.ndarray, qtype, in_features: int, bias: torch.Tensor | None = None,
                    release=None, packed=None, key: str = "") -> nn.Module:
    """The Linear layer of one GGUF weight in its file type. raw: [out, row_bytes] uint8 (whole
    block rows; F32/F16/BF16: the row's values as bytes), e.g. a view of the memory-mapped file;
    release(first_row, end_row), where given, is called once rows are no longer needed (to drop
    the mapped pages from memory as a large tensor is repacked). packed (gguf_packed.PackedWeights),
    where given, supplies the repacked buffers (reading: raw is not read) or keeps them (writing),
    under `key` (the tensors' names)."""
    name = type_name(qtype)
    if name in FLOAT_TYPES:
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
        w = torch.from_numpy(np.ascontiguousarray(raw).copy()).view(dtype).view(raw.shape[0], in_features)
        if release is not None:
            release(0, raw.shape[0])
        if name == "F32":
            layer = nn.Linear(in_features, raw.shape[0], bias=bias is not None, device="meta")
            layer.weight = nn.Parameter(w, requires_grad=False)
            if bias is not None:
                layer.bias = nn.Parameter(bias.float(), requires_grad=False)
            return layer
        return HalfLinear(w, bias)
    if name not in BLOCK_TYPES:
        raise ValueError(f"GGUF tensor type {name} is not supported (supported: {', '.join(SUPPORTED_TYPES)})")
    shape = (raw.shape[0], in_features)
    kernel = kernel_layer(name, shape)
    if kernel is not None:
        cls, attrs = kernel
        tile = cls.kernel_tile()
        record = [key, name, raw.shape[0], raw.shape[1], in_features, tile]
        if packed is not None and packed.reading:
            buffers = packed.take(record)
        else:
            buffers = repacked(raw, name, in_features, tile, release)
            if packed is not None:
                packed.put(record, buffers)
        return cls.from_tiles(shape, buffers, bias, **attrs)
    # No kernels for it here: dequantized on its own.
    layer = DequantizedLinear(in_features, raw.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(dequantize_raw(raw, name), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.float(), requires_grad=False)
    return layer


REPACK_CHUNK_BYTES = 32 << 20  # raw bytes repacked per call (then released, where a release is given)


def repacked(raw: np.ndarray, qtype, in_features: int, tile: int, release=None) -> dict[str, torch.Tensor | None]:
    """A block-quantized tensor's rows [out, row_bytes] in its kernel's tiles, by
    tl_gguf_repack (C, parallel, straight from the file's blocks: no other copy of the codes),
    REPACK_CHUNK_BYTES of rows (whole tiles) at a time, release(r0, r1) after each: the buffers
    of Q4Linear / Q8Linear / GgufLinear by name."""
    from gguf.constants import GGMLQuantizationType

    name = type_name(qtype)
    rows, nb = raw.shape[0], in_features // QK
    tiles = -(-rows // tile)
    u8, f16 = torch.uint8, torch.float16

    def zeros(*shape, dtype=u8) -> torch.Tensor:
        # numpy's zeros come from calloc: pages zeroed by the kernel as the repack first writes
        # them, not by a memset pass of their own (torch.zeros: ~3 s of Gemma 3 270M's load here)
        np_dtype = {u8: np.uint8, f16: np.float16, torch.int8: np.int8}[dtype]
        return torch.from_numpy(np.zeros((tiles, *shape), dtype=np_dtype))

    if name in ("Q4_0", "Q4_1"):
        out = {"qweight": zeros(nb, tile * 16), "d": zeros(nb, tile, dtype=f16), "m": zeros(nb, tile, dtype=f16)}
    elif name == "Q8_0":
        out = {"qweight": zeros(nb, tile * 32, dtype=torch.int8), "d": zeros(nb, tile, dtype=f16), "m": None}
    else:
        planes = GgufLinear.format_attrs(name)["planes"]
        nd = nb // 8 if name.endswith("_K") else nb
        out = {"qweight": zeros(nb, 256 + 64 * planes), "d": zeros(nd, tile, dtype=f16),
               "m": None if name in ("Q5_0", "Q6_K") else zeros(nd, tile, dtype=f16),
               "sc": zeros(nb, 2, tile, dtype=torch.int8) if name == "Q6_K" else
               zeros(nb, tile) if name in ("Q4_K", "Q5_K") else None,
               "mn": zeros(nb, tile) if name in ("Q4_K", "Q5_K") else None}
    if not raw.flags.c_contiguous:
        raw = np.ascontiguousarray(raw)
    row_bytes = raw.shape[1]
    step = max(tile, REPACK_CHUNK_BYTES // max(row_bytes, 1) // tile * tile)
    bufs = [out.get(k) for k in ("qweight", "d", "m", "sc", "mn")]
    base = raw.ctypes.data
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        t0 = r0 // tile  # whole tiles: each buffer's first dimension
        ptrs = [None if b is None else b.data_ptr() + t0 * b.stride(0) * b.element_size() for b in bufs]
        if cpu_native.lib().tl_gguf_repack(int(GGMLQuantizationType[name]), base + r0 * row_bytes, r1 - r0,
                                           in_features, tile, *ptrs, torch.get_num_threads()):
            raise ValueError(f"tl_gguf_repack cannot take {name} in tiles of {tile}")
        if release is not None:
            release(r0, r1)
    return out


class GgufEmbedding(nn.Module):
    """An embedding table in its file type, looked up by dequantizing only the rows asked for.
    table: [vocab, row_bytes] uint8, typically a view of the memory-mapped file (rows that are
    never looked up are never read)."""

    def __init__(self, table: np.ndarray, qtype, embedding_dim: int):
        super().__init__()
        self.table, self.gguf_type = table, type_name(qtype)
        self.num_embeddings, self.embedding_dim = table.shape[0], embedding_dim
        if self.gguf_type not in SUPPORTED_TYPES:
            raise ValueError(f"GGUF embedding type {self.gguf_type} is not supported")

    def rows(self, ids: np.ndarray) -> torch.Tensor:
        return dequantize_raw(self.table[ids], self.gguf_type)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).cpu().numpy()
        out = self.rows(ids)
        return out.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.gguf_type}, {self.num_embeddings}, {self.embedding_dim}"


def from_readonly(array: np.ndarray) -> torch.Tensor:
    """torch.from_numpy of a read-only array (a memory map), without torch's warning; the tensor
    must not be written."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)
