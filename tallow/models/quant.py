"""Weight-only quantized Linear layers for the CPU.

Decoding reads every weight once per step, so on the CPU a small batch runs at memory
bandwidth over weight bytes: 4-bit weights read 6x fewer bytes than float32. torch's packed
int4 kernel (`_weight_int4pack_mm_for_cpu`) is vectorised for bfloat16 activations only
(with float32 activations it is 3-15x slower than a float32 GEMV), so Int4Linear rounds
activations to bfloat16 inside; Int8Linear quantizes them to int8 for an integer GEMM. Both
return float32.

Past a few rows (prefill, large decode batches) the work is compute-bound and a dense
bfloat16 GEMM (avx512_bf16) can beat the packed kernels: a layer built with `dense_min_rows`
keeps a dense bfloat16 copy and switches to it from that many rows on. The engine does not:
each kernel alone gives a row the same result whatever the batch, but switching kernels by
batch size would make a sequence's greedy text depend on what it was batched with (and on
prefill chunking). benchmarks/cpu_linear.py has the figures.

Int4 has the layout of GGUF's Q4_1: groups of 32 along the input, w = (q - 8) * scale + zero,
q in 0..15. A Q4_1 weight (w = d * q + m, d and m float16) is scale = d, zero = m + 8 d, and
the min/max fit below recovers q, d and m exactly from the dequantized float32 weights: with
float32 scales the layer holds the file's weights bit for bit; the bfloat16 scales of the
fast path round d and zero to 8 significant bits (a relative 2^-9).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tallow.ops import cpu_native

SCHEMES = ("int4", "int8", "int4-torch", "int8-torch", "bf16", "none")
GROUP_SIZE = 32
INT4_OUT_MULTIPLE = 16  # the int4 packing works on blocks of 16 output channels
INT8_IN_MULTIPLE = 16  # as int8pack_mm needed; torch._int_mm takes any width, tests pin the fallback
# None: always the packed kernel, so results do not depend on the batch (see the docstring).
DENSE_MIN_ROWS: int | None = None


def cpu_has_vnni() -> bool:
    """Whether this CPU has AVX512-VNNI or AVX-VNNI. torch._int_mm's fast int8 GEMM needs one;
    without (AVX2-only machines, e.g. AMD Zen 1-3) it falls back to a reference loop that took
    10 ms for a 17 x 576 x 1536 product (an LM head step over 300 ms)."""
    return bool({"avx512_vnni", "avx_vnni"} & cpu_native.cpu_flags())


# The Int8Linear kernel: "int_mm" (exact int8 x int8 products, VNNI) or "int8pack" (int8
# weights times bfloat16 activations, torch._weight_int8pack_mm, vectorised on AVX2).
INT8_KERNEL = "int_mm" if cpu_has_vnni() else "int8pack"


class _QuantizedLinear(nn.Module):
    """Shared plumbing: flatten leading dims, pick the packed kernel or the dense copy, add bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dense_min_rows: int | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dense_min_rows = dense_min_rows
        dense = weight.detach().to(torch.bfloat16) if dense_min_rows is not None else None
        self.register_buffer("dense_weight", dense)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def _packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 [out, in] weight the packed kernel multiplies by."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this ~120 times on tiny inputs: plain attributes before buffers,
        # and no reshapes of inputs that are already rows.
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.dense_min_rows is not None and rows.shape[0] >= self.dense_min_rows:
            y = F.linear(rows.to(torch.bfloat16), self.dense_weight).float()
        else:
            y = self._packed_matmul(rows).float()
        if self.bias is not None:
            y = y + self.bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dense_min_rows={self.dense_min_rows}"


class Int8Linear(_QuantizedLinear):
    """int8 weights with one symmetric float32 scale per output channel.

    kernel "int_mm" (the default where the CPU has VNNI): the activations are quantized too,
    per row and in two int8 parts, x ~ s * (hi + lo / 254) with s = max|x| / 127: about 15 bits of the row's range, as precise as bfloat16
    activations (the LM head's logits agree as closely with the float32 ones), but the
    product is one int8 GEMM of 2M rows (torch._int_mm, AVX512-VNNI) whose int32 sums are
    exact: a row's result cannot depend on the batch, and many rows cost little more than
    one (int8pack_mm with bfloat16 activations takes ~10x longer for 32 rows than for one).

    kernel "int8pack" (elsewhere): activations rounded to bfloat16 times the int8 weights
    (torch._weight_int8pack_mm, one row at a time, so also batch invariant); the scales are
    rounded to bfloat16 (the kernel's dtype), a relative 2^-9 below the int8 step.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 dense_min_rows: int | None = DENSE_MIN_ROWS, kernel: str | None = None):
        super().__init__(weight, bias, dense_min_rows)
        self.kernel = INT8_KERNEL if kernel is None else kernel
        if self.kernel not in ("int_mm", "int8pack"):
            raise ValueError(f"unknown int8 kernel {self.kernel!r}")
        if not int8_fits(weight):
            raise ValueError(f"Int8Linear needs in_features divisible by {INT8_IN_MULTIPLE}, got {self.in_features}")
        w = weight.detach()
        row_max = torch.maximum(w.amax(dim=1), -w.amin(dim=1)).float()
        scales = (row_max / 127).clamp_min(torch.finfo(torch.float32).tiny)
        inv_scales = 1 / scales[:, None]
        qweight = torch.empty(w.shape, dtype=torch.int8)
        for rows in _row_chunks(*w.shape):
            qweight[rows] = (w[rows].float() * inv_scales[rows]).round_().clamp_(-127, 127)
        if self.kernel == "int8pack":
            self.register_buffer("qweight", qweight)  # [out, in], the kernel's layout
            self.register_buffer("scales", scales.to(torch.bfloat16))
            return
        # [in, out]: the GEMM reads the weight faster in this layout than as a transposed view.
        self.register_buffer("qweight_t", qweight.T.contiguous())
        self.register_buffer("scales", scales)

    def _packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "int8pack":
            return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales)
        x = x.float()
        step = x.abs().amax(dim=1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny) / 127
        x = x / step
        hi = x.round()
        lo = x.sub_(hi).mul_(254).round_()
        acc = torch._int_mm(torch.cat((hi, lo)).to(torch.int8), self.qweight_t)
        m = hi.shape[0]
        return acc[m:].float().div_(254).add_(acc[:m]).mul_(step).mul_(self.scales)

    def dequantized_weight(self) -> torch.Tensor:
        if self.kernel == "int8pack":
            return self.qweight.float() * self.scales.float()[:, None]
        return self.qweight_t.T.float() * self.scales[:, None]


class Int4Linear(_QuantizedLinear):
    """4-bit weights in groups of 32 inputs, asymmetric (torch._weight_int4pack_mm_for_cpu).

    dtype is the kernel's activation and scale dtype: bfloat16 is the fast path; float32 keeps
    scales exact (a GGUF Q4_1 weight bit for bit) at a tenth of the speed.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 dtype: torch.dtype = torch.bfloat16, dense_min_rows: int | None = DENSE_MIN_ROWS):
        super().__init__(weight, bias, dense_min_rows)
        if not int4_fits(weight):
            raise ValueError(f"Int4Linear needs in_features divisible by {GROUP_SIZE} and out_features by "
                             f"{INT4_OUT_MULTIPLE}, got {tuple(weight.shape)}")
        n, k = weight.shape
        qweight = torch.empty(n, k // 2, dtype=torch.uint8)
        # [in / 32, out, 2]: (scale, zero) per group, the kernel's layout.
        scales_and_zeros = torch.empty(k // GROUP_SIZE, n, 2, dtype=dtype)
        for rows in _row_chunks(n, k):
            q, scale, zero = quantize_int4(weight[rows].detach().float())
            qweight[rows] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            scales_and_zeros[:, rows, 0], scales_and_zeros[:, rows, 1] = scale.T, zero.T
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    def _packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        sz = self.scales_and_zeros
        return torch._weight_int4pack_mm_for_cpu(x.to(sz.dtype), self.qweight, GROUP_SIZE, sz)

    def dequantized_weight(self) -> torch.Tensor:
        # The kernel applied to the identity in float32 (its own unpacking, nothing reimplemented):
        # bfloat16 scales widen exactly, and a float32 output is not rounded.
        eye = torch.eye(self.in_features)
        sz = self.scales_and_zeros.float()
        return torch._weight_int4pack_mm_for_cpu(eye, self.qweight, GROUP_SIZE, sz).T.contiguous()


class _NativeBlockLinear(nn.Module):
    """Block-quantized weights (groups of 32 inputs) run by tallow's own CPU kernels
    (tallow/ops/cpu/kernels.c): float32 in and out, activations quantized per block of 32
    inside the kernel (Q4: 12-bit integers, Q8: 16-bit), exact integer dot products per block. A row's result does not
    depend on the batch.

    A decode step calls ~120 of these on one row each: the kernel and the weights' addresses
    are kept as plain attributes (refreshed when the buffers move, see _apply), so a call
    costs one allocation and one ctypes call."""

    _kernel = ""  # the C function's name
    _weight_buffers: tuple[str, ...] = ()  # buffers passed to it, in order (None entries: NULL)

    def __init__(self, weight: torch.Tensor | tuple[int, int], bias: torch.Tensor | None):
        """weight: the float weight, or only its shape (out, in) where a subclass packs codes
        it was given (from_codes)."""
        super().__init__()
        lib = cpu_native.lib()
        if lib is None:
            raise RuntimeError(f"tallow's CPU kernels are unavailable: {cpu_native.unavailable_reason()}")
        self._fn = getattr(lib, self._kernel)
        self.tile = self._tile_channels(lib)  # the kernels' weight layout
        self.out_features, self.in_features = shape = tuple(weight if isinstance(weight, tuple) else weight.shape)
        self._check_shape(shape)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._ptrs: tuple[int | None, ...] = ()

    @staticmethod
    def _tile_channels(lib) -> int:
        return cpu_native.tile_channels(lib)

    @classmethod
    def kernel_tile(cls) -> int:
        """Output channels per weight tile of the kernels lib() hands out, for this layer."""
        return cls._tile_channels(cpu_native.lib())

    @classmethod
    def from_tiles(cls, shape: tuple[int, int], tiles: dict[str, torch.Tensor | None],
                   bias: torch.Tensor | None = None, **attrs):
        """The layer around weights already in its kernel's tiles (the buffers of
        _weight_buffers by name, as tile_codes makes them); attrs: plain attributes the layer
        needs before its shape check (GgufLinear's format)."""
        layer = cls.__new__(cls)
        layer.__dict__.update(attrs)
        _NativeBlockLinear.__init__(layer, tuple(shape), bias)
        for name in cls._weight_buffers:
            layer.register_buffer(name, tiles.get(name))
        layer._set_pointers()
        return layer

    def _check_shape(self, shape: tuple[int, int]) -> None:
        if not native_fits(torch.empty(shape, device="meta")):
            raise ValueError(f"{type(self).__name__} needs in_features divisible by {GROUP_SIZE}, got {shape}")

    def _set_pointers(self) -> None:
        tensors = [getattr(self, name) for name in self._weight_buffers] + [self.bias]
        assert all(t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in tensors)
        self._ptrs = tuple(None if t is None else t.data_ptr() for t in tensors)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._set_pointers()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        m = rows.shape[0]
        y = torch.empty(m, self.out_features)
        if m and self._fn(rows.data_ptr(), m, self.in_features, self.out_features, *self._ptrs, y.data_ptr(),
                          torch.get_num_threads()):
            raise MemoryError(f"{type(self).__name__}: out of memory for {m} rows")
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _half(t: torch.Tensor, what: str) -> torch.Tensor:
    """float32 scales to float16, refusing values beyond its range (a weight block over 65504)."""
    if t.numel() and t.abs().max() > torch.finfo(torch.float16).max:
        raise ValueError(f"{what}: a weight block's scale or minimum ({t.abs().max().item():.4g}) is beyond float16")
    return t.half()


# The kernels' weight layouts (tallow/ops/cpu/linear_avx2.h, linear_avx512.h): tiles of `tile`
# output channels (the last one padded with zero channels), each tile's blocks in order, a
# block's `tile` channels in one run of bytes; scales [tiles, blocks, tile].

def _tiles_of(t: torch.Tensor, tile: int) -> torch.Tensor:
    """[n, ...] -> [ceil(n / tile), tile, ...], zero channels appended."""
    pad = -t.shape[0] % tile
    if pad:
        t = torch.cat((t, t.new_zeros(pad, *t.shape[1:])))
    return t.view(-1, tile, *t.shape[1:])


def _tile_scales(d: torch.Tensor, tile: int) -> torch.Tensor:
    """[n, blocks] -> [tiles, blocks, tile]."""
    return _tiles_of(d, tile).transpose(1, 2).contiguous()


def _untile_scales(d: torch.Tensor, n: int) -> torch.Tensor:
    return d.transpose(1, 2).reshape(-1, d.shape[1])[:n]


def _tile_q4(q: torch.Tensor, tile: int) -> torch.Tensor:
    """Q4 codes [n, k] (0..15) -> [tiles, blocks, tile * 16] bytes of nibbles: 8 groups of 32
    bytes, group g's byte 2c + e = element 4g + e of channel c | element 4g + 2 + e << 4."""
    t = _tiles_of(q.to(torch.uint8), tile)
    T, nb = t.shape[0], q.shape[1] // GROUP_SIZE
    t = t.view(T, tile, nb, 8, 2, 2)  # (c, b, g, half, e)
    return (t[..., 0, :] | (t[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(T, nb, -1).contiguous()


def _untile_q4(packed: torch.Tensor, n: int, tile: int) -> torch.Tensor:
    """The inverse of _tile_q4: codes [n, k] as uint8."""
    T, nb = packed.shape[:2]
    lo, hi = packed & 0x0F, packed >> 4
    q = torch.stack((lo.view(T, nb, 8, tile, 2), hi.view(T, nb, 8, tile, 2)), dim=4)  # (b, g, c, half, e)
    return q.permute(0, 3, 1, 2, 4, 5).reshape(T * tile, -1)[:n]


def _tile_q8(q: torch.Tensor, tile: int) -> torch.Tensor:
    """Q8 codes [n, k] int8 -> [tiles, blocks, tile * 32]: 16 groups of 32 bytes, group j's
    byte 2c + e = element 2j + e of channel c."""
    t = _tiles_of(q, tile)
    T, nb = t.shape[0], q.shape[1] // GROUP_SIZE
    return t.view(T, tile, nb, 16, 2).permute(0, 2, 3, 1, 4).reshape(T, nb, -1).contiguous()


def _untile_q8(packed: torch.Tensor, n: int, tile: int) -> torch.Tensor:
    T, nb = packed.shape[:2]
    return packed.view(T, nb, 16, tile, 2).permute(0, 3, 1, 2, 4).reshape(T * tile, -1)[:n]


class Q4Linear(_NativeBlockLinear):
    """4-bit weights, GGUF's Q4_1: w = d * q + m per group of 32, q in 0..15, d and m float16
    as in the file, so a Q4_1 tensor of a GGUF file is held exactly (the min/max fit recovers
    q, d and m; q is refit to the rounded d and m, which changes nothing for such a tensor)."""

    _kernel = "tl_q4_linear"
    _weight_buffers = ("qweight", "d", "m")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight, bias)
        n, k = weight.shape
        q = torch.empty(n, k, dtype=torch.uint8)
        d = torch.empty(n, k // GROUP_SIZE, dtype=torch.float16)
        m = torch.empty(n, k // GROUP_SIZE, dtype=torch.float16)
        for rows in _row_chunks(n, k):
            w = weight[rows].detach().float()
            d[rows], m[rows] = (_half(t, "Q4Linear") for t in q4_scales(w))
            q[rows] = q4_codes(w, d[rows].float(), m[rows].float())
        self._pack(q, d, m)

    @staticmethod
    def tile_codes(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, tile: int) -> dict[str, torch.Tensor]:
        """w = d * q + m as given (codes q [out, in] uint8 0..15, d and m float16 [out, in / 32]:
        a GGUF Q4_1 tensor's own values; Q4_0's are m = -8 d) in the kernel's tiles."""
        return {"qweight": _tile_q4(q, tile), "d": _tile_scales(d, tile), "m": _tile_scales(m, tile)}

    def _pack(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        for name, t in self.tile_codes(q, d, m, self.tile).items():
            self.register_buffer(name, t)
        self._set_pointers()

    def dequantized_weight(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        q = _untile_q4(self.qweight, n, self.tile).view(n, -1, GROUP_SIZE).float()
        d, m = _untile_scales(self.d, n).float(), _untile_scales(self.m, n).float()
        return (q * d[..., None] + m[..., None]).view(n, k)


class Q8Linear(_NativeBlockLinear):
    """8-bit weights, GGUF's Q8_0: w = d * q per group of 32, q in -127..127, d float16 (as in
    the file: a Q8_0 tensor is held exactly)."""

    _kernel = "tl_q8_linear"
    _weight_buffers = ("qweight", "d", "m")  # m: always None (no offsets)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight, bias)
        n, k = weight.shape
        qweight = torch.empty(n, k, dtype=torch.int8)
        d = torch.empty(n, k // GROUP_SIZE, dtype=torch.float16)
        for rows in _row_chunks(n, k):
            groups = weight[rows].detach().float().reshape(-1, k // GROUP_SIZE, GROUP_SIZE)
            scale = _half(groups.abs().amax(-1) / 127, "Q8Linear").float()
            inv = torch.where(scale > 0, 1 / scale, 0.0)
            qweight[rows] = (groups * inv[..., None]).round_().clamp_(-127, 127).reshape(-1, k).to(torch.int8)
            d[rows] = scale
        self._pack(qweight, d)

    @staticmethod
    def tile_codes(q: torch.Tensor, d: torch.Tensor, tile: int) -> dict[str, torch.Tensor]:
        """w = d * q as given (q [out, in] int8, d float16 [out, in / 32]: a GGUF Q8_0 tensor's
        own values) in the kernel's tiles."""
        return {"qweight": _tile_q8(q, tile), "d": _tile_scales(d, tile)}

    def _pack(self, q: torch.Tensor, d: torch.Tensor) -> None:
        for name, t in self.tile_codes(q, d, self.tile).items():
            self.register_buffer(name, t)
        self.m = None
        self._set_pointers()

    def dequantized_weight(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        q = _untile_q8(self.qweight, n, self.tile).view(n, -1, GROUP_SIZE).float()
        return (q * _untile_scales(self.d, n).float()[..., None]).view(n, k)


class Bf16Linear(nn.Module):
    """Dense bfloat16 weights (oneDNN avx512_bf16 GEMM); float32 in and out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias).float()


def int8_fits(weight: torch.Tensor) -> bool:
    return weight.shape[1] % INT8_IN_MULTIPLE == 0


def native_fits(weight: torch.Tensor) -> bool:
    """Whether tallow's kernels take the weight: whole blocks of inputs (any number of output
    channels: the last tile is padded)."""
    return weight.shape[1] % GROUP_SIZE == 0


def int4_fits(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return in_features % GROUP_SIZE == 0 and out_features % INT4_OUT_MULTIPLE == 0


def q4_scales(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max fit of a float32 [out, in] weight in groups of 32, as Q4_1 quantizes: (d, m),
    each [out, in / 32], with w ~= d * q + m for q in 0..15."""
    groups = w.reshape(w.shape[0], -1, GROUP_SIZE)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    return (hi - lo) / 15, lo


def q4_codes(w: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q (int32 [out, in], 0..15) nearest to (w - m) / d per group of 32."""
    groups = w.reshape(w.shape[0], -1, GROUP_SIZE)
    inv = torch.where(d > 0, 1 / d, 0.0)
    return (groups - m[..., None]).mul_(inv[..., None]).round_().clamp_(0, 15).to(torch.int32).view_as(w)


def q4_fit(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, d, m) of q4_scales and q4_codes."""
    d, m = q4_scales(w)
    return q4_codes(w, d, m), d, m


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q4_fit in Int4Linear's terms: (q, scale, zero) with w ~= (q - 8) * scale + zero."""
    q, scale, lo = q4_fit(w)
    return q, scale, lo + 8 * scale


def _row_chunks(rows: int, cols: int) -> Iterator[slice]:
    """Row slices of about a million weights, in multiples of 64 rows: quantizing chunk by chunk
    keeps temporaries small (fresh memory is slow to fault in), and int4 packing works on
    blocks of 64 rows, so packed chunks are rows of the packed whole."""
    step = max(64, (1 << 20) // cols // 64 * 64)
    return (slice(start, min(start + step, rows)) for start in range(0, rows, step))


def quantize_model_(model: nn.Module, scheme: str = "auto") -> str:
    """Replace the model's nn.Linear layers in place with quantized ones; returns the scheme used.

    scheme: "auto" (int4 on the CPU), "int4", "int8", "bf16" or "none". Under int4 the LM head
    (a module named lm_head) is int8: it is the one layer whose 4-bit error shows in the
    logits, and often a tied embedding stored at 8 bits. A tied LM head gets its own quantized
    copy; the embedding stays a float lookup table. Layers whose shape a kernel cannot take
    fall back from int4 to int8 to bf16. A model off the CPU is left alone ("none").

    Only plain nn.Linear layers are replaced: a GGUF file loaded in its own formats
    (gguf.load_native) keeps its Q4_0 ... Q6_K, F16 and BF16 layers whatever the scheme; the
    scheme applies to its F32 weights only (float sources).
    """
    if scheme == "auto":
        scheme = "int4"
    if scheme not in SCHEMES:
        from tallow.config import quantization_error

        raise ValueError(quantization_error(scheme).message)  # EngineConfig refuses it before anything loads
    if scheme == "none" or any(p.device.type != "cpu" for p in model.parameters()):
        return "none"
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in linears:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, _quantized(linear, scheme, is_head=attr == "lm_head"))
    return scheme


def _quantized(linear: nn.Linear, scheme: str, is_head: bool) -> nn.Module:
    if scheme == "bf16":
        return Bf16Linear(linear.weight, linear.bias)
    if scheme in ("int4", "int8") and native_fits(linear.weight) and cpu_native.lib() is not None:
        try:
            if scheme == "int4" and not is_head:
                return Q4Linear(linear.weight, linear.bias)
            return Q8Linear(linear.weight, linear.bias)
        except ValueError:  # scales beyond float16: torch's kernels take float32 / bfloat16 scales
            pass
    if scheme.startswith("int4") and not is_head and int4_fits(linear.weight):
        return Int4Linear(linear.weight, linear.bias)
    if int8_fits(linear.weight):
        return Int8Linear(linear.weight, linear.bias)
    return Bf16Linear(linear.weight, linear.bias)
