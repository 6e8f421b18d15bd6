"""tallow.ops.triton_quant (GGUF block-quantized GEMV / GEMM in Triton) against float64 matmuls
with the weight dequantized by gguf's own code (gguf.quants.dequantize; where gguf is not
installed, as on the GPU image, by the planes' torch dequantize, which the fast tier holds
equal to gguf's).

Runs under Triton's interpreter on the CPU (TRITON_INTERPRET=1, marked triton_interp: not in
the fast tier) and on CUDA (marked gpu); a slow-tier test compiles the kernels for sm_90
without a GPU. Random valid blocks: random quant bits and packed scales, finite fp16
d / dmin / m. Odd N (a partial row tile), K of a few blocks, M in {1, 3, 17}.

Tolerances, as a fraction of the largest |reference| output:
- GEMV: products and sums in float32 from the exact dequantized weight: 1e-5 for float32
  activations; bfloat16 / float16 activations only add the output's rounding (2^-8, 2^-11).
- GEMM: the activation and the dequantized weight rounded to bfloat16 (2^-9 each), float32
  accumulation: 1e-2.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from triton_test_devices import CUDA, INTERPRET, INTERPRETER, compile_sm90

try:
    import gguf
except ImportError:  # e.g. a GPU machine without it: the kernel tests fall back (see _case)
    gguf = None

# The interpreter runs are the triton_interp tier (slow: not in the fast tier); CUDA runs are gpu.
INTERP = pytest.param(*INTERPRETER.values, marks=[*INTERPRETER.marks, pytest.mark.triton_interp])

GEMV_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
GEMM_TOL = 1e-2


def _dot_bfloat16_as_float32() -> None:
    """Triton 3.6's interpreter keeps bfloat16 as raw uint16 bits and tl.dot multiplies those
    bits as integers; convert bfloat16 operands to float32 first (what the MMA computes)."""
    from triton import language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot
    if getattr(create_dot, "tallow_bf16", False):
        return

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            data = interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return h

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    patched.tallow_bf16 = True
    interpreter.InterpreterBuilder.create_dot = patched


if INTERPRET:
    _dot_bfloat16_as_float32()

# Small shapes (the interpreter runs every tile op in numpy): K of 2 blocks for the K-quants,
# 3 for the 32-element formats; N = 37 leaves a partial tile of rows.
FORMATS = ["Q8_0", "Q4_K", "Q6_K", "Q5_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
N = 37


def _dequantized(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    """The reference weight in float64: gguf's own dequantize; where gguf is not installed,
    the torch dequantize of the planes (test_layout_dequantizes_like_gguf holds it equal)."""
    from tallow.ops.triton_quant_layout import BLOCK_SIZES, dequantize, repack

    if gguf is not None:
        return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[fmt])).double()
    K = raw.shape[1] // BLOCK_SIZES[fmt][1] * BLOCK_SIZES[fmt][0]
    return dequantize(repack(raw, fmt, K)).double()


def _case(fmt: str, device: str, seed: int = 0):
    from tallow.ops.triton_quant_layout import BLOCK_SIZES, random_blocks, repack

    elems = BLOCK_SIZES[fmt][0]
    K = 2 * elems if elems == 256 else 3 * elems
    g = torch.Generator().manual_seed(seed)
    raw = random_blocks(fmt, N, K, generator=g)
    reference = _dequantized(raw, fmt)
    assert reference.shape == (N, K) and torch.isfinite(reference).all()
    return repack(raw.to(device), fmt, K), reference, g


def _check(y, x, reference, tol):
    want = x.double().cpu() @ reference.T
    assert y.shape == want.shape and y.dtype == x.dtype
    err = (y.double().cpu() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= tol * scale, (err, scale)


@pytest.mark.parametrize("where", ["cpu", CUDA])
@pytest.mark.parametrize("fmt", FORMATS)
def test_layout_dequantizes_like_gguf(where, fmt):
    """The planes hold exactly the file's values (the torch dequantize of the planes equals
    gguf's), and take about the file's bytes. Plain torch: in the fast tier."""
    from tallow.ops.triton_quant_layout import dequantize

    if gguf is None:
        pytest.skip("needs gguf")
    w, reference, _ = _case(fmt, where)
    assert torch.equal(dequantize(w).double().cpu(), reference)
    file_bytes = w.blocks_per_row * N * {"Q4_K": 144, "Q5_K": 176}.get(fmt, 0)
    if file_bytes:
        assert w.nbytes() <= file_bytes * 1.03


@pytest.mark.parametrize("where", [INTERP, CUDA])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_gemv_matches_float64(where, fmt):
    from tallow.ops.triton_quant import quant_gemv

    w, reference, g = _case(fmt, where)
    # (Each case is a compile on CUDA: few of them. The interpreter has no bf16/fp16 rounding.)
    cases = [(1, torch.float32), (3, torch.float32)]
    if where == "cuda":
        cases += [(1, torch.bfloat16), (3, torch.bfloat16), (3, torch.float16)]
    for M, dtype in cases:
        x = torch.randn(M, w.K, generator=g).to(where, dtype)
        _check(quant_gemv(x, w), x, reference, GEMV_TOL[dtype])
    # K split over programs (float32 partials summed after, a ragged last split for the
    # 32-element formats), other tile sizes, and a strided activation view.
    x = torch.randn(3, 2 * w.K, generator=g).to(where)[:, ::2]
    _check(quant_gemv(x[:1], w, split_k=2, block_n=8), x[:1], reference, GEMV_TOL[torch.float32])
    _check(quant_gemv(x, w, split_k=3, block_n=64), x, reference, GEMV_TOL[torch.float32])


@pytest.mark.parametrize("where", [INTERP, CUDA])
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_quant_gemv1_matches_float64(where, fmt):
    """The one-row kernel (whole blocks per load): float32 products of the exact weights, a
    partial tile of rows (N = 37), K split over programs, and every tile setting it takes."""
    from tallow.ops.triton_quant import quant_gemv1

    w, reference, g = _case(fmt, where)
    x = torch.randn(1, w.K, generator=g).to(where)
    _check(quant_gemv1(x, w), x, reference, GEMV_TOL[torch.float32])
    _check(quant_gemv1(x, w, split_k=2, block_n=8), x, reference, GEMV_TOL[torch.float32])
    _check(quant_gemv1(x, w, split_k=1, block_n=32, num_warps=2), x, reference, GEMV_TOL[torch.float32])
    # the codes widened through their bits (fastcvt) or by int-to-float conversions: the same
    # float32 values, so the same outputs bit for bit
    assert torch.equal(quant_gemv1(x, w, fastcvt=True), quant_gemv1(x, w, fastcvt=False))
    if where == "cuda":
        for dtype in (torch.bfloat16, torch.float16):
            xd = torch.randn(1, w.K, generator=g).to(where, dtype)
            _check(quant_gemv1(xd, w), xd, reference, GEMV_TOL[dtype])
    with pytest.raises(ValueError, match="one row"):
        quant_gemv1(torch.randn(2, w.K).to(where), w)
    # More blocks a row: Q8_0's four blocks per step, the K-quants' two super-blocks per step
    # (unrolled) with K split in two, and an odd number of super-blocks (one per step).
    from tallow.ops.triton_quant_layout import random_blocks, repack

    for K, kwargs in ((1024, dict(split_k=2)), (768, {})):
        raw = random_blocks(fmt, N, K, generator=g)
        x = torch.randn(1, K, generator=g).to(where)
        _check(quant_gemv1(x, repack(raw.to(where), fmt, K), **kwargs), x, _dequantized(raw, fmt),
               GEMV_TOL[torch.float32])


@pytest.mark.parametrize("where", [INTERP, CUDA])
@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
def test_quant_gemv2_matches_float64(where, fmt):
    """The K-quant GEMV for 1..4 rows (codes as int32 words widened through their bits, per-
    word sums with the scales applied after): float32 tolerance, a partial row tile, K split
    with a ragged last split, and the layer's opt-in path."""
    from tallow.ops.triton_quant import GEMV2_MAX_ROWS, TritonQuantLinear, quant_gemv2

    w, reference, g = _case(fmt, where)
    for M, kwargs in ((1, {}), (3, dict(split_k=2, block_n=16)), (GEMV2_MAX_ROWS, dict(block_n=64, unroll=1))):
        x = torch.randn(M, w.K, generator=g).to(where)
        _check(quant_gemv2(x, w, **kwargs), x, reference, GEMV_TOL[torch.float32])
    if where == "cuda":
        xd = torch.randn(2, w.K, generator=g).to(where, torch.bfloat16)
        _check(quant_gemv2(xd, w), xd, reference, GEMV_TOL[torch.bfloat16])
    layer = TritonQuantLinear(w)
    layer.gemv2 = True
    x = torch.randn(2, w.K, generator=g).to(where)
    _check(layer(x), x, reference, GEMV_TOL[torch.float32])
    with pytest.raises(ValueError, match="rows"):
        quant_gemv2(torch.randn(GEMV2_MAX_ROWS + 1, w.K).to(where), w)


@pytest.mark.parametrize("where", [INTERP, CUDA])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_gemm_matches_float64(where, fmt):
    from tallow.ops.triton_quant import quant_gemm

    w, reference, g = _case(fmt, where)
    for M in (1, 17):
        x = torch.randn(M, w.K, generator=g).to(where)
        _check(quant_gemm(x, w, block_m=16, block_n=32), x, reference, GEMM_TOL)
    # K split over programs (a ragged last split for the 32-element formats)
    _check(quant_gemm(x, w, block_m=16, block_n=32, split_k=2), x, reference, GEMM_TOL)
    if where == "cuda":  # the default tiles, and 16-bit activations
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(17, w.K, generator=g).to(where, dtype)
            _check(quant_gemm(x, w), x, reference, GEMM_TOL)


@pytest.mark.parametrize("where", [INTERP, CUDA])
@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
def test_kq_gemm_matches_float64(where, fmt):
    """The swap-AB K-quant GEMM (weight tile dequantized in registers as the left bf16 operand):
    bf16 tolerance for 17 rows and for 3 (a padded row tile) with K split, and the layer's
    opt-in path above gemv_max_rows."""
    from tallow.ops.triton_quant import TritonQuantLinear, kq_gemm

    w, reference, g = _case(fmt, where)
    x = torch.randn(17, w.K, generator=g).to(where)
    _check(kq_gemm(x, w, block_n=32), x, reference, GEMM_TOL)
    x3 = torch.randn(3, w.K, generator=g).to(where)
    _check(kq_gemm(x3, w, block_n=16, split_k=2), x3, reference, GEMM_TOL)
    if where == "cuda":  # the default tiles, 16-bit activations
        for dtype in (torch.bfloat16, torch.float16):
            xd = torch.randn(130, w.K, generator=g).to(where, dtype)
            _check(kq_gemm(xd, w), xd, reference, GEMM_TOL)
    layer = TritonQuantLinear(w)
    layer.kq_gemm = "1"
    _check(layer(x), x, reference, GEMM_TOL)
    layer.kq_gemm = "all"  # one row too (a padded 16-row tile): bf16 operands, so the GEMM bound
    x1 = x[:1]
    y1 = layer(x1)
    _check(y1, x1, reference, GEMM_TOL)
    assert torch.equal(y1, kq_gemm(x1, w))


@pytest.mark.parametrize("where", [INTERP, CUDA])
def test_triton_quant_linear_dispatches_by_rows(where):
    """Up to gemv_max_rows rows take the float32 GEMV (tight tolerance), more the bf16 GEMM; the
    layer takes the GGUF bytes directly and keeps leading dimensions."""
    from tallow.ops.triton_quant import TritonQuantLinear
    from tallow.ops.triton_quant_layout import random_blocks

    K = 256
    g = torch.Generator().manual_seed(3)
    raw = random_blocks("Q4_K", N, K, generator=g)
    reference = _dequantized(raw, "Q4_K")
    layer = TritonQuantLinear.from_gguf_bytes(raw.numpy(), "Q4_K", K, device=where, gemv_max_rows=4)
    assert (layer.in_features, layer.out_features) == (K, N)
    x = torch.randn(1, 3, K, generator=g).to(where)
    y = layer(x)
    assert y.shape == (1, 3, N)
    _check(y.reshape(3, N), x.reshape(3, K), reference, GEMV_TOL[torch.float32])
    x = torch.randn(17, K, generator=g).to(where)
    y = layer(x)
    _check(y, x, reference, GEMM_TOL)
    want = x.double().cpu() @ reference.T
    # The bf16 path is measurably less exact than the float32 one: proof it was taken.
    assert (y.double().cpu() - want).abs().max().item() > 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("where", [INTERP, CUDA])
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantize_weight_and_the_cublas_path(where, fmt):
    """dequantize_weight writes the planes' exact weights (float32 output: equal to the torch
    dequantize; bf16: its rounding on CUDA, within one bf16 step under the interpreter), and
    TritonQuantLinear takes it plus a matmul from dequant_min_rows rows on, with bf16 operands
    as quant_gemm (GEMM tolerance)."""
    from tallow.ops.triton_quant import TritonQuantLinear, dequantize_weight
    from tallow.ops.triton_quant_layout import dequantize, random_blocks, repack

    g = torch.Generator().manual_seed(5)
    K = 768 if fmt != "Q8_0" else 96 * 4
    raw = random_blocks(fmt, N, K, generator=g)
    w = repack(raw.to(where), fmt, K)
    exact = dequantize(w)
    assert torch.equal(dequantize_weight(w, torch.float32), exact)
    wb = dequantize_weight(w, torch.bfloat16)
    if where == "cuda":  # round to nearest (the interpreter's float32 -> bf16 cast truncates)
        assert torch.equal(wb, exact.to(torch.bfloat16))
    else:
        assert ((wb.float() - exact).abs() <= exact.abs() * 2.0 ** -7).all()
    layer = TritonQuantLinear(w, dequant_min_rows=17)
    x = torch.randn(17, K, generator=g).to(where)
    _check(layer(x), x, _dequantized(raw, fmt), GEMM_TOL)


def test_repack_rejects_wrong_shapes():
    from tallow.ops.triton_quant_layout import repack

    with pytest.raises(ValueError, match="multiple of the block size"):
        repack(torch.zeros(2, 144, dtype=torch.uint8), "Q4_K", 128)
    with pytest.raises(ValueError, match="bytes"):
        repack(torch.zeros(2, 140, dtype=torch.uint8), "Q4_K", 256)
    with pytest.raises(ValueError, match="unsupported"):
        repack(torch.zeros(2, 144, dtype=torch.uint8), "IQ4_XS", 256)



@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_compile_for_hopper(fmt):
    """Without a GPU: both kernels compile for sm_90 through Triton's own ptxas, the one-row GEMV
    reads weights with 16-byte loads, the GEMM runs on wgmma, and the shared memory of the
    default GEMM tiles fits an H100/H200 (227 KB; unrolling a block's pieces once took 254)."""
    pytest.importorskip("triton")
    from tallow.ops import triton_quant as tq

    if INTERPRET:
        pytest.skip("compiles real kernels: run without TRITON_INTERPRET")
    types = {"x_ptr": "*bf16", "y_ptr": "*bf16", "qs_ptr": "*u8", "qh_ptr": "*u8", "d_ptr": "*fp16",
             "m_ptr": "*fp16", "sc_ptr": "*u8", "mn_ptr": "*u8"}
    types["qs_ptr"] = "*i8" if fmt == "Q8_0" else "*u8"
    types["qh_ptr"] = "*i32" if fmt in ("Q5_0", "Q5_1") else "*u8"
    types["sc_ptr"] = "*i8" if fmt == "Q6_K" else "*u8"

    def compile_(kernel, consts, num_warps, num_stages):
        consts = {**tq._format_constexprs(fmt), **consts}
        # What the launcher specializes on: 16-byte aligned tensors, sizes divisible by 16.
        aligned = [n for n in kernel.arg_names if n.endswith("_ptr") or n in ("NB", "stride_xm", "stride_ym")]
        return compile_sm90(kernel, types, consts, num_warps, num_stages, aligned=aligned)

    bps = 1 if tq._FORMAT_ARGS[fmt][5] == 8 else 4
    gemv = compile_(tq._quant_gemv_kernel, dict(BPS=bps, BLOCK_M=1, BLOCK_N=32, SPLIT=False), 2, 2)
    assert "ld.global.v4.b32" in gemv.asm["ptx"]
    if fmt in tq._GEMV1_FORMATS:  # the one-row kernel: whole blocks in 16-byte loads
        kind, qh = tq._GEMV1_FORMATS[fmt]
        aligned = [n for n in tq._gemv1_kernel.arg_names if n.endswith("_ptr") or n == "NB"]
        i2f = {}
        for fastcvt in (False, True):
            consts = dict(KIND=kind, QH=qh, BB=4 if kind == 0 else 2, BLOCK_N=16, SPLIT=True, FASTCVT=fastcvt)
            gemv1 = compile_sm90(tq._gemv1_kernel, {**types, "y_ptr": "*fp32"}, consts, 4, 3, aligned=aligned)
            ptx = gemv1.asm["ptx"]
            loop = "".join(re.findall(r"Inner Loop Header.*?\n(.*?)bra\s+\$L__BB0_\d+;", ptx, re.S))
            # the weights in 16-byte loads, and no layout conversion through shared memory per block
            assert "ld.global.v4.b32" in loop and "bar.sync" not in loop and "st.shared" not in loop
            # fastcvt: the codes leave no int-to-float conversion in the loop (the K-quants' few
            # left are the per-block scales)
            i2f[fastcvt] = len(re.findall(r"cvt\.rn\.f32\.[su]", loop))
        assert i2f[True] * 4 <= i2f[False] and i2f[False] >= 16, i2f
    if fmt in ("Q4_K", "Q5_K", "Q6_K"):  # quant_gemv2: 16-byte code loads, 1 and 4 rows
        words = {**types, "y_ptr": "*fp32", "qs_ptr": "*i32", "qh_ptr": "*i32"}
        aligned = [n for n in tq._gemv2_kernel.arg_names if n.endswith("_ptr") or n in ("NB", "stride_xm")]
        kind, qh = tq._GEMV2_FORMATS[fmt]
        for bm in (1, 4):
            consts = dict(KIND=kind, QH=qh, BLOCK_M=bm, BB=2, BLOCK_N=32, SPLIT=True)
            gemv2 = compile_sm90(tq._gemv2_kernel, words, consts, 4, 3, aligned=aligned)
            assert "ld.global.v4.b32" in gemv2.asm["ptx"]
        # and the kernel that writes the weight out for the cuBLAS path (bf16)
        consts = dict(KIND=kind, QH=qh, BB=4 if kind == 0 else 2, BLOCK_N=16)
        k = tq._dequant_kernel
        aligned = [n for n in k.arg_names if n.endswith("_ptr") or n in ("NB", "K")]
        deq = compile_sm90(k, types, consts, 4, 1, aligned=aligned)
        assert "ld.global.v4.b32" in deq.asm["ptx"]
    if fmt in tq._KQ_GEMM_FORMATS:  # kq_gemm: wgmma at 128 and 16 rows, shared memory that fits
        kind, qh = tq._KQ_GEMM_FORMATS[fmt]
        aligned = [n for n in tq._kq_gemm_kernel.arg_names
                   if n.endswith("_ptr") or n in ("NB", "stride_xm", "stride_ym")]
        for bm in (128, 16):
            consts = dict(KIND=kind, QH=qh, BLOCK_M=bm, BLOCK_N=64, SPLIT=False)
            kq = compile_sm90(tq._kq_gemm_kernel, types, consts, 4, 2, aligned=aligned)
            assert "wgmma.mma_async" in kq.asm["ptx"] and kq.metadata.shared <= 227 * 1024
    gemm = compile_(tq._quant_gemm_kernel, dict(BLOCK_M=128, BLOCK_N=64, SPLIT=False), 4, 3)
    assert "wgmma.mma_async" in gemm.asm["ptx"]
    assert gemm.metadata.shared <= 227 * 1024
