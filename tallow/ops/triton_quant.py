"""Weight-only GGUF block-quantized linear layers in Triton: y[M, N] = x[M, K] @ W[N, K]^T.

W is a `QuantWeight` (tallow/ops/triton_quant_layout.py: the GGUF blocks split into planes).
Both kernels walk K one quant block at a time and, inside a block, one *piece* at a time: a run
of PW consecutive columns whose quant bits are one contiguous byte run of every row and whose
scale (and min) is one value per row, so a piece dequantizes as `q * scale[:, None] (+ min)`
with only 2-D tiles and [BLOCK_N] vector loads of the scales. Bytes map to columns as in GGUF:

- Q8_0: one piece of 32 (the block).
- Q4_0/Q4_1/Q5_0/Q5_1: the block's 16 bytes twice: low nibbles are columns 0..15, high
  nibbles 16..31 (Q5: fifth bit j of the block's 32-bit qh).
- Q4_K/Q5_K: 8 pieces of 32, one per sub-block: sub-block 2g + s is nibble s of bytes
  32g..32g+31 (Q5_K: bit 2g + s of the block's 32 qh bytes); scale d * sc, min dmin * mn.
- Q6_K: 8 pieces of 32 (two 16-element sub-blocks each, the scale picked per column): column
  128h + 64s + 32v + i is nibble s of ql byte 64h + 32v + i with bits 2(2s + v) of qh byte
  32h + i as its high pair, minus 32.

`quant_gemv` (decode: M up to 16): each program owns BLOCK_N rows and reads each of their
blocks once for all M rows, float32 products accumulated per column slot and reduced once at
the end; when there are too few row tiles to fill the GPU, K is split over programs and the
float32 partials summed after. `quant_gemm` (prefill): tiles of BLOCK_M x BLOCK_N, each piece
dequantized in registers, cast to bfloat16 and multiplied by the activation piece with tl.dot
(tensor cores), float32 accumulation, one piece per K step (so the software pipeline buffers
one activation tile per stage), K split the same way when the tiles are few.
`quant_gemv1` (one row) widens codes through their bits instead of int-to-float conversions
(`_code_f32`); `quant_gemv2` (1-4 rows) and `kq_gemm` (the weight tile as the MMA's left
operand) are opt-in until a GPU run times them (`TritonQuantLinear.gemv2` / `.kq_gemm`).
`TritonQuantLinear` holds the planes and picks one by M.

Checked on the CPU only so far (interpreter; sm_90 compiles: 16-byte weight loads in the GEMV,
wgmma in the GEMM); the defaults are reasoned, not tuned: benchmarks/gpu_quant_linear.py
--sweep times the alternatives on a GPU.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from tallow.ops.triton_quant_layout import QuantWeight, repack

# format -> (KIND, QH, ASYM, OFFSET, piece width PW, pieces per block); KIND 0: Q8_0, 1: the
# 32-element nibble formats, 2: Q4_K/Q5_K, 3: Q6_K. QH: a fifth bit plane; ASYM: a min plane
# (q * d + m); OFFSET: subtracted from the unsigned quant of the symmetric 32-element formats.
_FORMAT_ARGS = {
    "Q8_0": (0, False, False, 0, 32, 1),
    "Q4_0": (1, False, False, 8, 16, 2), "Q4_1": (1, False, True, 0, 16, 2),
    "Q5_0": (1, True, False, 16, 16, 2), "Q5_1": (1, True, True, 0, 16, 2),
    "Q4_K": (2, False, True, 0, 32, 8), "Q5_K": (2, True, True, 0, 32, 8),
    "Q6_K": (3, True, False, 32, 32, 8),
}


def _format_constexprs(fmt: str) -> dict:
    kind, qh, asym, offset, pw, pieces = _FORMAT_ARGS[fmt]
    return dict(KIND=kind, QH=qh, ASYM=asym, OFFSET=offset, PW=pw, PIECES=pieces)


@triton.jit
def _rows(rows, NB, BYTES: tl.constexpr):
    """The byte offsets [BLOCK_N, 1] of row starts in a plane of BYTES per block, marked as
    multiples of 16 so that a row's piece loads as 16-byte vectors."""
    return tl.multiple_of(rows * (NB * BYTES), 16)[:, None]


@triton.jit
def _piece(KIND: tl.constexpr, QH: tl.constexpr, ASYM: tl.constexpr, OFFSET: tl.constexpr,
           PW: tl.constexpr, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rows, rmask, NB, b, P):
    """Piece P of block b of BLOCK_N rows (int64 row ids, mask) -> (weights [BLOCK_N, PW] float32,
    the piece's first column). Masked rows read as zero. P may be a constant (the GEMV unrolls
    a block's pieces) or a runtime value (the GEMM's K loop steps one piece at a time)."""
    j = tl.arange(0, PW)
    m2 = rmask[:, None]
    d = tl.load(d_ptr + rows * NB + b, mask=rmask, other=0.0).to(tl.float32)
    if KIND == 0:  # Q8_0
        q = tl.load(qs_ptr + _rows(rows, NB, 32) + b * 32 + j[None, :], mask=m2, other=0).to(tl.float32)
        w = q * d[:, None]
        c0 = b * 32
    elif KIND == 1:  # Q4_0, Q4_1, Q5_0, Q5_1
        byte = tl.load(qs_ptr + _rows(rows, NB, 16) + b * 16 + j[None, :], mask=m2, other=0).to(tl.int32)
        q = (byte >> (4 * P)) & 0xF
        if QH:
            qh = tl.load(qh_ptr + rows * NB + b, mask=rmask, other=0)
            q = q | (((qh[:, None] >> (j[None, :] + 16 * P)) & 1) << 4)
        if ASYM:
            mins = tl.load(m_ptr + rows * NB + b, mask=rmask, other=0.0).to(tl.float32)
            w = q.to(tl.float32) * d[:, None] + mins[:, None]
        else:
            w = (q - OFFSET).to(tl.float32) * d[:, None]
        c0 = b * 32 + 16 * P
    elif KIND == 2:  # Q4_K, Q5_K
        byte = tl.load(qs_ptr + _rows(rows, NB, 128) + b * 128 + 32 * (P // 2) + j[None, :],
                       mask=m2, other=0).to(tl.int32)
        q = (byte >> (4 * (P % 2))) & 0xF
        if QH:  # Q5_K
            qh = tl.load(qh_ptr + _rows(rows, NB, 32) + b * 32 + j[None, :], mask=m2, other=0).to(tl.int32)
            q = q | (((qh >> P) & 1) << 4)
        dmin = tl.load(m_ptr + rows * NB + b, mask=rmask, other=0.0).to(tl.float32)
        sc = tl.load(sc_ptr + rows * (NB * 8) + b * 8 + P, mask=rmask, other=0).to(tl.float32)
        mn = tl.load(mn_ptr + rows * (NB * 8) + b * 8 + P, mask=rmask, other=0).to(tl.float32)
        w = q.to(tl.float32) * (d * sc)[:, None] - (dmin * mn)[:, None]
        c0 = b * 256 + 32 * P
    else:  # Q6_K: P = 4h + 2s + v
        h = P // 4
        s = (P // 2) % 2
        v = P % 2
        byte = tl.load(qs_ptr + _rows(rows, NB, 128) + b * 128 + (64 * h + 32 * v) + j[None, :],
                       mask=m2, other=0).to(tl.int32)
        lo = (byte >> (4 * s)) & 0xF
        qh = tl.load(qh_ptr + _rows(rows, NB, 64) + b * 64 + 32 * h + j[None, :], mask=m2, other=0).to(tl.int32)
        q = (lo | (((qh >> (2 * (2 * s + v))) & 3) << 4)) - OFFSET
        sc0 = tl.load(sc_ptr + rows * (NB * 16) + b * 16 + 2 * P, mask=rmask, other=0).to(tl.float32)
        sc1 = tl.load(sc_ptr + rows * (NB * 16) + b * 16 + 2 * P + 1, mask=rmask, other=0).to(tl.float32)
        scale = tl.where(j[None, :] < 16, sc0[:, None], sc1[:, None]) * d[:, None]
        w = q.to(tl.float32) * scale
        c0 = b * 256 + 32 * P
    return w, c0


@triton.jit
def _quant_gemv_kernel(x_ptr, y_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr,
                       M, N, NB, stride_xm, stride_ym, blocks_per_split,
                       KIND: tl.constexpr, QH: tl.constexpr, ASYM: tl.constexpr, OFFSET: tl.constexpr,
                       PW: tl.constexpr, PIECES: tl.constexpr, BPS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    ms = tl.arange(0, BLOCK_M)
    mmask = ms < M
    j = tl.arange(0, PW)
    # One row: a 2-D accumulator, so the weight loads keep their coalesced, vectorized layout.
    # More rows: a 3-D one [M, N, PW], whose layout gives every thread a single column (byte
    # loads of the weights and a shared-memory conversion per piece in the sm_90 PTX); M
    # multiply-adds per weight on CUDA cores besides. The benchmark times quant_gemm with one
    # 16-row tile (tensor cores) against it at M = 8.
    if BLOCK_M == 1:
        acc1 = tl.zeros([BLOCK_N, PW], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, PW], dtype=tl.float32)
    b_start = pid_k * blocks_per_split
    b_end = tl.minimum(b_start + blocks_per_split, NB)
    for b0 in range(b_start, b_end, BPS):
        for u in tl.static_range(BPS):
            for p in tl.static_range(PIECES):
                w, c0 = _piece(KIND, QH, ASYM, OFFSET, PW, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr,
                               rows64, rmask, NB, b0 + u, p)
                if BLOCK_M == 1:
                    x1 = tl.load(x_ptr + c0 + j).to(tl.float32)
                    acc1 += w * x1[None, :]
                else:
                    x = tl.load(x_ptr + ms[:, None] * stride_xm + (c0 + j)[None, :], mask=mmask[:, None],
                                other=0.0).to(tl.float32)
                    acc += x[:, None, :] * w[None, :, :]
    if BLOCK_M == 1:
        y = tl.sum(acc1, axis=1)[None, :]
    else:
        y = tl.sum(acc, axis=2)
    out_mask = mmask[:, None] & rmask[None, :]
    if SPLIT:
        tl.store(y_ptr + pid_k * M * N + ms[:, None] * N + rows[None, :], y, mask=out_mask)
    else:
        tl.store(y_ptr + ms[:, None] * stride_ym + rows[None, :], y.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _code_f32(q, OFFSET: tl.constexpr, FASTCVT: tl.constexpr):
    """Non-negative int32 codes q (< 2^23) -> float32 q - OFFSET, exactly. FASTCVT: through the
    bits, float(2^23 + q) is (q | 0x4B000000) as a float, minus 2^23 + OFFSET (two full-rate ops;
    an int-to-float conversion runs at 16 per clock per SM on sm_80/90, an eighth of the FMA
    rate); else (q - OFFSET).to(float32)."""
    if FASTCVT:
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)
    else:
        return (q - OFFSET).to(tl.float32)


@triton.jit
def _gemv1_kernel(x_ptr, y_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, N, NB, blocks_per_split,
                  KIND: tl.constexpr, QH: tl.constexpr, BB: tl.constexpr, BLOCK_N: tl.constexpr,
                  SPLIT: tl.constexpr, FASTCVT: tl.constexpr = False):
    """One activation row (decode at batch 1) for Q8_0 (KIND 0), Q4_K / Q5_K (2) and Q6_K (3):
    each step loads whole blocks of BLOCK_N rows as one 3-D tile (a row's block bytes
    contiguous: 16-byte loads; BB blocks per step), block scales as [BLOCK_N] and sub-block
    scales as [BLOCK_N, pieces] vectors broadcast into the tile, the activation as a tile of
    the same shape (its rows all read the same addresses, from L1), and accumulates the exact
    products w * x per element in float32 (one cross-thread reduction at the end). Loading x
    and the scales in these shapes keeps every tensor in the weight tile's layout: no shared-
    memory conversion in the loop (sm_90 PTX checked with BLOCK_N = 4 * num_warps, one
    16-byte weight load per thread and block). Rows past N read row 0 and are not stored.
    FASTCVT: the codes become float32 through their bits (_code_f32), not I2F."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    r1 = tl.where(rmask, rows, 0).to(tl.int64)
    r2 = r1[:, None]
    r3 = r1[:, None, None]
    z3 = r3 * 0  # broadcasts x's addresses over the rows (the tile's shape and layout)
    b_start = pid_k * blocks_per_split
    b_end = tl.minimum(b_start + blocks_per_split, NB)
    if KIND == 0:  # Q8_0: BB blocks of 32 per step
        jb2 = tl.arange(0, BB)[None, :]
        jb = tl.arange(0, BB)[None, :, None]
        i3 = tl.arange(0, 32)[None, None, :]
        acc = tl.zeros([BLOCK_N, BB, 32], dtype=tl.float32)
        for b in range(b_start, b_end, BB):
            q = _code_f32(tl.load(qs_ptr + r3 * (NB * 32) + (b + jb) * 32 + i3).to(tl.int32) + 128, 128, FASTCVT)
            d = tl.load(d_ptr + r2 * NB + b + jb2).to(tl.float32)
            x = tl.load(x_ptr + (b + jb) * 32 + i3 + z3).to(tl.float32)
            acc += q * d[:, :, None] * x
    elif KIND == 2:  # Q4_K / Q5_K: byte 32g + i holds element 64g + i (low) and 64g + 32 + i (high)
        g2 = tl.arange(0, 4)[None, :]
        g3 = tl.arange(0, 4)[None, :, None]
        i3 = tl.arange(0, 32)[None, None, :]
        acc = tl.zeros([BLOCK_N, 4, 32], dtype=tl.float32)
        for b0 in range(b_start, b_end, BB):
            for u in tl.static_range(BB):
                b = b0 + u
                q = tl.load(qs_ptr + r3 * (NB * 128) + b * 128 + g3 * 32 + i3).to(tl.int32)
                lo = q & 0xF
                hi = q >> 4
                if QH:
                    qh = tl.load(qh_ptr + r3 * (NB * 32) + b * 32 + i3 + g3 * 0).to(tl.int32)
                    lo = lo | (((qh >> (2 * g3)) & 1) << 4)
                    hi = hi | (((qh >> (2 * g3 + 1)) & 1) << 4)
                d = tl.load(d_ptr + r1 * NB + b).to(tl.float32)[:, None]
                dmin = tl.load(m_ptr + r1 * NB + b).to(tl.float32)[:, None]
                s_base = r2 * (NB * 8) + b * 8 + 2 * g2
                sc_lo = (tl.load(sc_ptr + s_base).to(tl.float32) * d)[:, :, None]
                sc_hi = (tl.load(sc_ptr + s_base + 1).to(tl.float32) * d)[:, :, None]
                mn_lo = (tl.load(mn_ptr + s_base).to(tl.float32) * dmin)[:, :, None]
                mn_hi = (tl.load(mn_ptr + s_base + 1).to(tl.float32) * dmin)[:, :, None]
                x_lo = tl.load(x_ptr + b * 256 + g3 * 64 + i3 + z3).to(tl.float32)
                x_hi = tl.load(x_ptr + b * 256 + g3 * 64 + 32 + i3 + z3).to(tl.float32)
                acc += (_code_f32(lo, 0, FASTCVT) * sc_lo - mn_lo) * x_lo + (_code_f32(hi, 0, FASTCVT) * sc_hi - mn_hi) * x_hi
    else:  # Q6_K: 16-byte chunk c of ql: chunk c of element e0 = 128(c//4) + 32((c//2)%2) + 16(c%2) + i (low
        # nibble; high nibble e0 + 64); high bits in qh byte 32(c//4) + 16(c%2) + i; a scale per 16.
        c2 = tl.arange(0, 8)[None, :]
        c3 = tl.arange(0, 8)[None, :, None]
        i3 = tl.arange(0, 16)[None, None, :]
        e0 = 128 * (c3 // 4) + 32 * ((c3 // 2) % 2) + 16 * (c3 % 2)
        s0 = 8 * (c2 // 4) + 2 * ((c2 // 2) % 2) + (c2 % 2)  # e0 // 16
        s0 = tl.max_contiguous(s0, [1, 1])
        sh = 2 * ((c3 // 2) % 2)
        acc = tl.zeros([BLOCK_N, 8, 16], dtype=tl.float32)
        for b0 in range(b_start, b_end, BB):
            for u in tl.static_range(BB):
                b = b0 + u
                ql = tl.load(qs_ptr + r3 * (NB * 128) + b * 128 + c3 * 16 + i3).to(tl.int32)
                qh = tl.load(qh_ptr + r3 * (NB * 64) + b * 64 + 32 * (c3 // 4) + 16 * (c3 % 2) + i3).to(tl.int32)
                d = tl.load(d_ptr + r1 * NB + b).to(tl.float32)[:, None]
                s_base = r2 * (NB * 16) + b * 16 + s0
                sc_lo = (tl.load(sc_ptr + s_base).to(tl.float32) * d)[:, :, None]
                sc_hi = (tl.load(sc_ptr + s_base + 4).to(tl.float32) * d)[:, :, None]
                lo = (ql & 0xF) | (((qh >> sh) & 3) << 4)
                hi = (ql >> 4) | (((qh >> (sh + 4)) & 3) << 4)
                x_lo = tl.load(x_ptr + b * 256 + e0 + i3 + z3).to(tl.float32)
                x_hi = tl.load(x_ptr + b * 256 + e0 + 64 + i3 + z3).to(tl.float32)
                acc += _code_f32(lo, 32, FASTCVT) * sc_lo * x_lo + _code_f32(hi, 32, FASTCVT) * sc_hi * x_hi
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if SPLIT:
        tl.store(y_ptr + pid_k * N + rows, y, mask=rmask)
    else:
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _dequant_kernel(y_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, N, NB, K,
                    KIND: tl.constexpr, QH: tl.constexpr, BB: tl.constexpr, BLOCK_N: tl.constexpr):
    """W [N, K] written out (y's dtype) from the planes of Q8_0 / Q4_K / Q5_K / Q6_K: program
    (i, j) writes BLOCK_N rows of BB blocks (the tiles and index maps of _gemv1_kernel)."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1) * BB
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    r1 = tl.where(rmask, rows, 0).to(tl.int64)
    r2 = r1[:, None]
    r3 = r1[:, None, None]
    m3 = rmask[:, None, None]
    out = y_ptr + r3 * K
    if KIND == 0:
        jb2 = tl.arange(0, BB)[None, :]
        jb = tl.arange(0, BB)[None, :, None]
        i3 = tl.arange(0, 32)[None, None, :]
        q = tl.load(qs_ptr + r3 * (NB * 32) + (b + jb) * 32 + i3).to(tl.float32)
        d = tl.load(d_ptr + r2 * NB + b + jb2).to(tl.float32)
        tl.store(out + (b + jb) * 32 + i3, (q * d[:, :, None]).to(y_ptr.dtype.element_ty), mask=m3)
    elif KIND == 2:
        g2 = tl.arange(0, 4)[None, :]
        g3 = tl.arange(0, 4)[None, :, None]
        i3 = tl.arange(0, 32)[None, None, :]
        for u in tl.static_range(BB):
            bu = b + u
            q = tl.load(qs_ptr + r3 * (NB * 128) + bu * 128 + g3 * 32 + i3).to(tl.int32)
            lo = q & 0xF
            hi = q >> 4
            if QH:
                qh = tl.load(qh_ptr + r3 * (NB * 32) + bu * 32 + i3 + g3 * 0).to(tl.int32)
                lo = lo | (((qh >> (2 * g3)) & 1) << 4)
                hi = hi | (((qh >> (2 * g3 + 1)) & 1) << 4)
            d = tl.load(d_ptr + r1 * NB + bu).to(tl.float32)[:, None]
            dmin = tl.load(m_ptr + r1 * NB + bu).to(tl.float32)[:, None]
            s_base = r2 * (NB * 8) + bu * 8 + 2 * g2
            sc_lo = (tl.load(sc_ptr + s_base).to(tl.float32) * d)[:, :, None]
            sc_hi = (tl.load(sc_ptr + s_base + 1).to(tl.float32) * d)[:, :, None]
            mn_lo = (tl.load(mn_ptr + s_base).to(tl.float32) * dmin)[:, :, None]
            mn_hi = (tl.load(mn_ptr + s_base + 1).to(tl.float32) * dmin)[:, :, None]
            col = bu * 256 + g3 * 64 + i3
            tl.store(out + col, (lo.to(tl.float32) * sc_lo - mn_lo).to(y_ptr.dtype.element_ty), mask=m3)
            tl.store(out + col + 32, (hi.to(tl.float32) * sc_hi - mn_hi).to(y_ptr.dtype.element_ty), mask=m3)
    else:
        c2 = tl.arange(0, 8)[None, :]
        c3 = tl.arange(0, 8)[None, :, None]
        i3 = tl.arange(0, 16)[None, None, :]
        e0 = 128 * (c3 // 4) + 32 * ((c3 // 2) % 2) + 16 * (c3 % 2)
        s0 = tl.max_contiguous(8 * (c2 // 4) + 2 * ((c2 // 2) % 2) + (c2 % 2), [1, 1])
        sh = 2 * ((c3 // 2) % 2)
        for u in tl.static_range(BB):
            bu = b + u
            ql = tl.load(qs_ptr + r3 * (NB * 128) + bu * 128 + c3 * 16 + i3).to(tl.int32)
            qh = tl.load(qh_ptr + r3 * (NB * 64) + bu * 64 + 32 * (c3 // 4) + 16 * (c3 % 2) + i3).to(tl.int32)
            d = tl.load(d_ptr + r1 * NB + bu).to(tl.float32)[:, None]
            s_base = r2 * (NB * 16) + bu * 16 + s0
            sc_lo = (tl.load(sc_ptr + s_base).to(tl.float32) * d)[:, :, None]
            sc_hi = (tl.load(sc_ptr + s_base + 4).to(tl.float32) * d)[:, :, None]
            lo = ((ql & 0xF) | (((qh >> sh) & 3) << 4)) - 32
            hi = ((ql >> 4) | (((qh >> (sh + 4)) & 3) << 4)) - 32
            col = bu * 256 + e0 + i3
            tl.store(out + col, (lo.to(tl.float32) * sc_lo).to(y_ptr.dtype.element_ty), mask=m3)
            tl.store(out + col + 64, (hi.to(tl.float32) * sc_hi).to(y_ptr.dtype.element_ty), mask=m3)


@triton.jit
def _quant_gemm_kernel(x_ptr, y_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr,
                       M, N, NB, stride_xm, stride_ym, blocks_per_split,
                       KIND: tl.constexpr, QH: tl.constexpr, ASYM: tl.constexpr, OFFSET: tl.constexpr,
                       PW: tl.constexpr, PIECES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       SPLIT: tl.constexpr):
    # Programs that share a weight tile are launched together (M tiles vary fastest), so the
    # tile is read from DRAM once and from L2 by the others. Axis 1 splits K (SPLIT: float32
    # partials [split, M, N], summed by _sum_splits_kernel).
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = ms < M
    x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_xm
    j = tl.arange(0, PW)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # One piece per step (not a block's pieces unrolled): the pipeliner then buffers one
    # [BLOCK_M, PW] activation tile per stage, not eight.
    t_start = pid_k * blocks_per_split * PIECES
    t_end = tl.minimum(pid_k * blocks_per_split + blocks_per_split, NB) * PIECES
    for t in range(t_start, t_end):
        w, c0 = _piece(KIND, QH, ASYM, OFFSET, PW, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rows64, rmask, NB,
                       t // PIECES, t % PIECES)
        x = tl.load(x_rows + (c0 + j)[None, :], mask=mmask[:, None], other=0.0).to(tl.bfloat16)
        acc = tl.dot(x, tl.trans(w.to(tl.bfloat16)), acc)
    out_mask = mmask[:, None] & rmask[None, :]
    if SPLIT:
        tl.store(y_ptr + (pid_k * M + ms.to(tl.int64))[:, None] * N + rows[None, :], acc, mask=out_mask)
    else:
        y_ptrs = y_ptr + ms.to(tl.int64)[:, None] * stride_ym + rows[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """y[i] = sum over s of part[s, i] (float32, in split order), cast to y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _planes(w: QuantWeight) -> list[torch.Tensor]:
    """The six plane arguments; absent planes are passed as qs (never read)."""
    return [p if p is not None else w.qs for p in (w.qs, w.qh, w.d, w.m, w.sc, w.mn)]


def _check(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != w.K:
        raise ValueError(f"x must be [M, {w.K}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported activation dtype {x.dtype}")
    return x if x.stride(1) == 1 else x.contiguous()


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_plan(NB: int, bps: int, n_tiles: int, split_k: int | None, device: torch.device) -> tuple[int, int]:
    """(number of K splits, blocks per split, a multiple of bps). By default (split_k None) K is
    split until there are about two programs per SM on CUDA; not at all elsewhere."""
    steps = NB // bps
    if split_k is None:
        split_k = 1
        if device.type == "cuda":
            sms = _sm_count(device)
            split_k = triton.cdiv(2 * sms, n_tiles)
    split = max(1, min(split_k, steps))
    blocks_per_split = triton.cdiv(steps, split) * bps
    return triton.cdiv(NB, blocks_per_split), blocks_per_split


def split_output(split: int, M: int, N: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Where a kernel split `split` ways over K writes: float32 partials [split, M, N], or the
    [M, N] output itself when it is not split. Shared by the fp8 GEMM (triton_fp8.py)."""
    if split > 1:
        return torch.empty(split, M, N, dtype=torch.float32, device=device)
    return torch.empty(M, N, dtype=dtype, device=device)


def sum_splits(y: torch.Tensor, split: int, dtype: torch.dtype) -> torch.Tensor:
    """split_output's partials summed in split order into [M, N] of `dtype` (y itself unsplit)."""
    if split == 1:
        return y
    M, N = y.shape[1:]
    out = torch.empty(M, N, dtype=dtype, device=y.device)
    _sum_splits_kernel[(triton.cdiv(M * N, 1024),)](y, out, M * N, SPLIT=split, BLOCK=1024)
    return out


def quant_gemv(x: torch.Tensor, w: QuantWeight, *, block_n: int | None = None, split_k: int | None = None,
               num_warps: int | None = None, num_stages: int = 2) -> torch.Tensor:
    """x[M, K] @ W^T for small M (<= 16): each weight block is read once for all rows.
    Output [M, N] in x's dtype; products and sums in float32. The defaults: one row, tiles of
    32 rows on 2 warps (a thread loads 16 contiguous bytes of a row); more rows, 16 on 4."""
    x = _check(x, w)
    M, N, NB = x.shape[0], w.N, w.blocks_per_row
    if M > 16:
        raise ValueError(f"quant_gemv takes up to 16 rows, got {M}")
    if block_n is None:
        block_n = 32 if M == 1 else 16
    if num_warps is None:
        num_warps = 2 if M == 1 else 4
    pieces = _FORMAT_ARGS[w.fmt][5]
    bps = next(n for n in (4, 2, 1) if NB % n == 0) if pieces < 8 else 1
    n_tiles = triton.cdiv(N, block_n)
    split, blocks_per_split = _split_plan(NB, bps, n_tiles, split_k, x.device)
    block_m = max(1, triton.next_power_of_2(M))
    y = split_output(split, M, N, x.dtype, x.device)
    _quant_gemv_kernel[(n_tiles, split)](
        x, y, *_planes(w), M, N, NB, x.stride(0), N, blocks_per_split,
        **_format_constexprs(w.fmt), BPS=bps, BLOCK_M=block_m, BLOCK_N=block_n,
        SPLIT=split > 1, num_warps=num_warps, num_stages=num_stages)
    return sum_splits(y, split, x.dtype)


# Formats with the one-row kernel (_gemv1_kernel): format -> (KIND, QH).
_GEMV1_FORMATS = {"Q8_0": (0, False), "Q4_K": (2, False), "Q5_K": (2, True), "Q6_K": (3, False)}
# Its defaults (block_n, num_warps, num_stages, programs per SM before K is split), and
# settings per (format, N, K) that override them (filled by a tuning run, e.g.
# benchmarks/gpu_gguf_model.py decode --tune-gemv).
# num_warps = block_n / 4 gives one 16-byte weight load per thread and block (the layout the
# loop keeps without conversions); unroll: K-quant super-blocks per loop step (Q8_0: up to 4
# blocks of 32 per step).
# fastcvt: codes widened through their bits (_code_f32; TALLOW_GEMV1_FASTCVT=0 takes the I2F
# conversions of stop 29 back, the same results: benchmarks/gpu_gguf_model.py kernels times both).
GEMV1_DEFAULTS = dict(block_n=16, num_stages=3, waves=8, unroll=2,
                      fastcvt=os.environ.get("TALLOW_GEMV1_FASTCVT", "1") != "0")
# The stop 30 H200 tune of the Q4_K_M 8B model's shapes (`gpu_gguf_model.py decode --tune-gemv`,
# I2F kernel; benchmarks/results/stop30/gpu/decode_q4km.log): where the best beat the defaults by
# 5% or more. (Q4_K 28672 x 4096 and Q6_K 4096 x 14336 / 128256 x 4096: the defaults.)
GEMV1_TUNED: dict[tuple[str, int, int], dict] = {
    ("Q4_K", 4096, 4096): dict(block_n=8, num_warps=4, num_stages=3, waves=2),      # 13.16 -> 10.60 us
    ("Q4_K", 5120, 4096): dict(block_n=8, num_warps=4, num_stages=3, waves=2),      # 14.84 -> 12.64
    ("Q4_K", 6144, 4096): dict(block_n=16, num_warps=8, num_stages=3, waves=2),     # 16.32 -> 14.12
    ("Q4_K", 4096, 14336): dict(block_n=32, num_warps=8, num_stages=3, waves=2),    # 28.19 -> 26.56
    ("Q6_K", 1024, 4096): dict(block_n=8, num_warps=8, num_stages=3, waves=2),      # 8.26 -> 6.76
}


def quant_gemv1(x: torch.Tensor, w: QuantWeight, *, block_n: int | None = None, split_k: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None, waves: int | None = None,
                unroll: int | None = None, fastcvt: bool | None = None) -> torch.Tensor:
    """x[1, K] @ W^T for Q8_0 / Q4_K / Q5_K / Q6_K: whole blocks per load (_gemv1_kernel),
    float32 products and sums. K is split over programs (float32 partials summed in a second
    pass) until there are `waves` programs per SM."""
    x = _check(x, w)
    if x.shape[0] != 1 or w.fmt not in _GEMV1_FORMATS:
        raise ValueError(f"quant_gemv1 takes one row of {', '.join(_GEMV1_FORMATS)}")
    if x.stride(0) != w.K:
        x = x.contiguous()
    opts = {**GEMV1_DEFAULTS, **GEMV1_TUNED.get((w.fmt, w.N, w.K), {})}
    if unroll is not None:
        opts["unroll"] = unroll
    if fastcvt is not None:
        opts["fastcvt"] = fastcvt
    block_n = block_n or opts["block_n"]
    num_warps = num_warps or opts.get("num_warps") or max(1, min(8, block_n // 4))
    num_stages = num_stages or opts["num_stages"]
    waves = waves or opts["waves"]
    N, NB = w.N, w.blocks_per_row
    kind, qh = _GEMV1_FORMATS[w.fmt]
    bb = next(n for n in ((4, 2, 1) if kind == 0 else (opts["unroll"], 1)) if NB % n == 0)
    n_tiles = triton.cdiv(N, block_n)
    if split_k is None and x.device.type == "cuda":
        split_k = triton.cdiv(waves * _sm_count(x.device), n_tiles)
    split, blocks_per_split = _split_plan(NB, bb, n_tiles, split_k or 1, x.device)
    y = split_output(split, 1, N, x.dtype, x.device)
    _gemv1_kernel[(n_tiles, split)](
        x, y, *_planes(w), N, NB, blocks_per_split, KIND=kind, QH=qh, BB=bb, BLOCK_N=block_n,
        SPLIT=split > 1, FASTCVT=bool(opts["fastcvt"]), num_warps=num_warps, num_stages=num_stages)
    return sum_splits(y, split, x.dtype)


# --- gemv2: K-quant GEMV for 1..8 rows without int-to-float conversions ----------------------
# A nibble (or 5- / 6-bit code) q becomes a float32 with integer ops only: its bits are moved
# into the top of a float's mantissa under the exponent of 1.0, giving 1 + q / 2^bits exactly
# (no I2F, which runs at 16 per clock per SM on sm_80/90 against 128 FMAs: the old kernels'
# limit). Per sub-block, sum (1 + q/2^b) x = sum x + (sum q x) / 2^b, so
#     sum (q * d*sc - dmin*mn) x = 2^b d*sc (P - X) - dmin*mn X,   P = sum q' x, X = sum x,
# P, X per thread and 32-bit word of codes (4 columns): one FMA per weight, the scales applied
# per word. Codes are read as int32 words (16-byte loads), the activation as [words] tiles
# broadcast over the rows (a slice of the weight tile's layout: loaded once per program, reused
# by every row a thread holds), float32 throughout.

@triton.jit
def _bits(w, lsb: tl.constexpr, width: tl.constexpr, dst: tl.constexpr):
    """Bits [lsb, lsb + width) of the int32 words w moved to [dst, dst + width), others zero."""
    mask: tl.constexpr = ((1 << width) - 1) << dst
    if lsb >= dst:
        return (w >> (lsb - dst)) & mask
    else:
        return (w << (dst - lsb)) & mask


@triton.jit
def _one_plus(bits):
    """int32 bits (a code under 2^23 already shifted into the mantissa) -> 1 + bits / 2^23."""
    return (bits | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _gemv2_kernel(x_ptr, y_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, N, NB, stride_xm,
                  blocks_per_split, KIND: tl.constexpr, QH: tl.constexpr, BLOCK_M: tl.constexpr,
                  BB: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """y[m, n] for the BLOCK_M (1..4) rows of x of Q4_K / Q5_K (KIND 2) or Q6_K (KIND 3); qs_ptr
    (and Q5_K / Q6_K's qh_ptr) are the code planes as int32 words. Rows past N read row 0 and
    are not stored. SPLIT: float32 partials [split, M, N] (summed by sum_splits)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    r1 = tl.where(rmask, rows, 0).to(tl.int64)
    b_start = pid_k * blocks_per_split
    b_end = tl.minimum(b_start + blocks_per_split, NB)
    if KIND == 2:
        # word j of group g (bytes 32g + 4j .. +3): byte p's low nibble is column 64g + 4j + p
        # (sub-block 2g), its high nibble column 64g + 32 + 4j + p (sub-block 2g + 1).
        g1 = tl.arange(0, 4)
        j1 = tl.arange(0, 8)
        g3 = g1[None, :, None]
        w_off = r1[:, None, None] * (NB * 32) + g3 * 8 + j1[None, None, :]
        xg4 = (g1[:, None] * 64 + j1[None, :] * 4)[:, :, None] + tl.arange(0, 4)[None, None, :]  # [4, 8, 4]
        s_off = r1[:, None] * (NB * 8) + 2 * g1[None, :]
        for mi in tl.static_range(BLOCK_M):
            if mi == 0:
                acc0 = tl.zeros([BLOCK_N, 4, 8], dtype=tl.float32)
            elif mi == 1:
                acc1 = tl.zeros([BLOCK_N, 4, 8], dtype=tl.float32)
            elif mi == 2:
                acc2 = tl.zeros([BLOCK_N, 4, 8], dtype=tl.float32)
            elif mi == 3:
                acc3 = tl.zeros([BLOCK_N, 4, 8], dtype=tl.float32)
        for b0 in range(b_start, b_end, BB):
            for u in tl.static_range(BB):
                b = b0 + u
                w = tl.load(qs_ptr + w_off + b * 32)
                if QH:  # Q5_K: qh byte i (= 4j + p) bit 2g + h is the fifth bit of sub-block 2g + h
                    qh = tl.load(qh_ptr + r1[:, None, None] * (NB * 8) + b * 8 + j1[None, None, :] + g3 * 0)
                d = tl.load(d_ptr + r1 * NB + b).to(tl.float32)[:, None]
                dmin = tl.load(m_ptr + r1 * NB + b).to(tl.float32)[:, None]
                for h in tl.static_range(2):
                    sc = tl.load(sc_ptr + s_off + b * 8 + h).to(tl.float32)
                    mn = tl.load(mn_ptr + s_off + b * 8 + h).to(tl.float32)
                    if QH:
                        A = (d * sc * 32.0)[:, :, None]
                    else:
                        A = (d * sc * 16.0)[:, :, None]
                    AB = A + (dmin * mn)[:, :, None]
                    for mi in tl.static_range(BLOCK_M):
                        # x[64g + 32h + 4j + p] as one [4, 8, 4] tile (16 contiguous elements a
                        # thread: vector loads), split into its four p planes in registers
                        x4 = tl.load(x_ptr + mi * stride_xm + b * 256 + 32 * h + xg4).to(tl.float32)
                        xa, xb = tl.split(tl.reshape(x4, [4, 8, 2, 2]))  # p = 2k and p = 2k + 1
                        xa0, xa2 = tl.split(xa)
                        xb1, xb3 = tl.split(xb)
                        P = tl.zeros([BLOCK_N, 4, 8], dtype=tl.float32)
                        X = tl.zeros([4, 8], dtype=tl.float32)
                        for p in tl.static_range(4):
                            if p == 0:
                                xv = xa0
                            elif p == 1:
                                xv = xb1
                            elif p == 2:
                                xv = xa2
                            else:
                                xv = xb3
                            if QH:
                                bits = _bits(w, 8 * p + 4 * h, 4, 18) | (((qh >> (8 * p + 2 * g3 + h)) & 1) << 22)
                            else:
                                bits = _bits(w, 8 * p + 4 * h, 4, 19)
                            P += _one_plus(bits) * xv[None, :, :]
                            X += xv
                        t = A * P - AB * X[None, :, :]
                        if mi == 0:
                            acc0 += t
                        elif mi == 1:
                            acc1 += t
                        elif mi == 2:
                            acc2 += t
                        else:
                            acc3 += t
    else:
        # Q6_K: ql word 8c + j (c = 2hh + v: bytes 64hh + 32v + 4j .. +3), byte p: low nibble
        # (s = 0) is column 128hh + 32v + 4j + p, high nibble (s = 1) that + 64; their top two
        # bits are bits 2(2s + v) of qh byte 32hh + 4j + p (qh word 8hh + j). Sub-block of 16:
        # 8hh + 4s + 2v + j // 4, so j is split into jh (4 words each side) and jl.
        c1 = tl.arange(0, 4)
        jh1 = tl.arange(0, 2)
        jl1 = tl.arange(0, 4)
        c4 = c1[None, :, None, None]
        j4 = jh1[None, None, :, None] * 4 + jl1[None, None, None, :]
        r4 = r1[:, None, None, None]
        w_off = r4 * (NB * 32) + c4 * 8 + j4
        h_off = r4 * (NB * 16) + (c4 // 2) * 8 + j4
        vshift = 2 * (c4 % 2)
        c2 = c1[:, None, None]
        j3 = jh1[None, :, None] * 4 + jl1[None, None, :]
        xg4 = ((c2 // 2) * 128 + (c2 % 2) * 32 + j3 * 4)[:, :, :, None] + tl.arange(0, 4)[None, None, None, :]
        s_off = r1[:, None, None] * (NB * 16) + (c1 // 2 * 8 + (c1 % 2) * 2)[None, :, None] + jh1[None, None, :]
        for mi in tl.static_range(BLOCK_M):
            if mi == 0:
                acc0 = tl.zeros([BLOCK_N, 4, 2, 4], dtype=tl.float32)
            elif mi == 1:
                acc1 = tl.zeros([BLOCK_N, 4, 2, 4], dtype=tl.float32)
            elif mi == 2:
                acc2 = tl.zeros([BLOCK_N, 4, 2, 4], dtype=tl.float32)
            elif mi == 3:
                acc3 = tl.zeros([BLOCK_N, 4, 2, 4], dtype=tl.float32)
        for b0 in range(b_start, b_end, BB):
            for u in tl.static_range(BB):
                b = b0 + u
                w = tl.load(qs_ptr + w_off + b * 32)
                qh = tl.load(qh_ptr + h_off + b * 16)
                d = tl.load(d_ptr + r1 * NB + b).to(tl.float32)[:, None, None]
                for s in tl.static_range(2):
                    sc = tl.load(sc_ptr + s_off + b * 16 + 4 * s).to(tl.float32)
                    A = (d * sc * 64.0)[:, :, :, None]  # (q - 32) d sc = 64 d sc (q' - 1) - 32 d sc
                    for mi in tl.static_range(BLOCK_M):
                        x4 = tl.load(x_ptr + mi * stride_xm + b * 256 + 64 * s + xg4).to(tl.float32)
                        xa, xb = tl.split(tl.reshape(x4, [4, 2, 4, 2, 2]))  # p = 2k and p = 2k + 1
                        xa0, xa2 = tl.split(xa)
                        xb1, xb3 = tl.split(xb)
                        P = tl.zeros([BLOCK_N, 4, 2, 4], dtype=tl.float32)
                        X = tl.zeros([4, 2, 4], dtype=tl.float32)
                        for p in tl.static_range(4):
                            if p == 0:
                                xv = xa0
                            elif p == 1:
                                xv = xb1
                            elif p == 2:
                                xv = xa2
                            else:
                                xv = xb3
                            bits = _bits(w, 8 * p + 4 * s, 4, 17) | (((qh >> (vshift + (8 * p + 4 * s))) & 3) << 21)
                            P += _one_plus(bits) * xv[None, :, :, :]
                            X += xv
                        t = A * (P - 1.5 * X[None, :, :, :])
                        if mi == 0:
                            acc0 += t
                        elif mi == 1:
                            acc1 += t
                        elif mi == 2:
                            acc2 += t
                        else:
                            acc3 += t
    for mi in tl.static_range(BLOCK_M):
        if mi == 0:
            acc = acc0
        elif mi == 1:
            acc = acc1
        elif mi == 2:
            acc = acc2
        else:
            acc = acc3
        if KIND == 2:
            y = tl.sum(tl.sum(acc, axis=2), axis=1)
        else:
            y = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)
        if SPLIT:
            tl.store(y_ptr + (pid_k * BLOCK_M + mi) * N + rows, y, mask=rmask)
        else:
            tl.store(y_ptr + mi * N + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


# Formats of gemv2 -> (KIND, QH); its defaults (like GEMV1_DEFAULTS) and per-shape overrides.
_GEMV2_FORMATS = {"Q4_K": (2, False), "Q5_K": (2, True), "Q6_K": (3, False)}
GEMV2_MAX_ROWS = 4
GEMV2_DEFAULTS = dict(block_n=32, num_warps=4, num_stages=3, waves=4, unroll=2)
GEMV2_TUNED: dict[tuple[str, int, int, int], dict] = {}


def quant_gemv2(x: torch.Tensor, w: QuantWeight, *, block_n: int | None = None, split_k: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None, waves: int | None = None,
                unroll: int | None = None) -> torch.Tensor:
    """x[M, K] @ W^T for M <= GEMV2_MAX_ROWS rows of Q4_K / Q5_K / Q6_K (_gemv2_kernel): codes
    read once as int32 words for all rows, widened without int-to-float conversions, float32
    sums. K is split over programs (float32 partials summed after) until there are `waves`
    programs per SM. Output [M, N] in x's dtype."""
    x = _check(x, w)
    M = x.shape[0]
    if w.fmt not in _GEMV2_FORMATS or not 1 <= M <= GEMV2_MAX_ROWS:
        raise ValueError(f"quant_gemv2 takes 1..{GEMV2_MAX_ROWS} rows of {', '.join(_GEMV2_FORMATS)}")
    opts = {**GEMV2_DEFAULTS, **GEMV2_TUNED.get((w.fmt, w.N, w.K, M), {})}
    block_n = block_n or opts["block_n"]
    num_warps = num_warps or opts["num_warps"]
    num_stages = num_stages or opts["num_stages"]
    waves = waves or opts["waves"]
    unroll = unroll or opts["unroll"]
    N, NB = w.N, w.blocks_per_row
    kind, qh = _GEMV2_FORMATS[w.fmt]
    bb = unroll if NB % unroll == 0 else 1
    n_tiles = triton.cdiv(N, block_n)
    if split_k is None and x.device.type == "cuda":
        split_k = triton.cdiv(waves * _sm_count(x.device), n_tiles)
    split, blocks_per_split = _split_plan(NB, bb, n_tiles, split_k or 1, x.device)
    y = split_output(split, M, N, x.dtype, x.device)
    qs = w.qs.view(torch.int32)
    qhw = w.qh.view(torch.int32) if w.qh is not None else qs
    _gemv2_kernel[(n_tiles, split)](
        x, y, qs, qhw, w.d, w.m if w.m is not None else w.d, w.sc, w.mn if w.mn is not None else w.sc,
        N, NB, x.stride(0), blocks_per_split, KIND=kind, QH=qh, BLOCK_M=M, BB=bb, BLOCK_N=block_n,
        SPLIT=split > 1, num_warps=num_warps, num_stages=num_stages)
    return sum_splits(y, split, x.dtype)


def dequantize_weight(w: QuantWeight, dtype: torch.dtype = torch.bfloat16, *, block_n: int = 16) -> torch.Tensor:
    """The weight [N, K] in `dtype`, written by a Triton kernel from the planes (Q8_0, Q4_K,
    Q5_K, Q6_K): for a cuBLAS GEMM where many activation rows share it (TritonQuantLinear)."""
    if w.fmt not in _GEMV1_FORMATS:
        raise ValueError(f"dequantize_weight takes {', '.join(_GEMV1_FORMATS)}")
    kind, qh = _GEMV1_FORMATS[w.fmt]
    NB = w.blocks_per_row
    bb = next(n for n in ((4, 2, 1) if kind == 0 else (2, 1)) if NB % n == 0)
    y = torch.empty(w.N, w.K, dtype=dtype, device=w.device)
    _dequant_kernel[(triton.cdiv(w.N, block_n), NB // bb)](
        y, *_planes(w), w.N, NB, w.K, KIND=kind, QH=qh, BB=bb, BLOCK_N=block_n,
        num_warps=max(1, min(8, block_n // 4)))
    return y


def quant_gemm(x: torch.Tensor, w: QuantWeight, *, block_m: int | None = None, block_n: int = 64,
               split_k: int | None = None, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """x[M, K] @ W^T for any M: bfloat16 tensor-core products of the activation and the weight
    dequantized in registers, float32 accumulation. Output [M, N] in x's dtype. K is split
    (float32 partials summed after) when the tiles are too few to fill the GPU."""
    x = _check(x, w)
    M, N = x.shape[0], w.N
    if block_m is None:
        block_m = 128 if M >= 128 else max(16, triton.next_power_of_2(M))
    n_tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    split, blocks_per_split = _split_plan(w.blocks_per_row, 1, n_tiles, split_k, x.device)
    y = split_output(split, M, N, x.dtype, x.device)
    _quant_gemm_kernel[(n_tiles, split)](
        x, y, *_planes(w), M, N, w.blocks_per_row, x.stride(0), N, blocks_per_split,
        **_format_constexprs(w.fmt), BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split > 1,
        num_warps=num_warps, num_stages=num_stages)
    return sum_splits(y, split, x.dtype)


# --- kq_gemm: K-quant GEMM with the weight as the MMA's left operand (many rows) -------------

@triton.jit
def _kq_gemm_kernel(x_ptr, y_ptr, qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, M, N, NB, stride_xm, stride_ym,
                    blocks_per_split, KIND: tl.constexpr, QH: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """y^T[n, m] = W[n, :] . x[m, :] for Q4_K / Q5_K (KIND 2) and Q6_K (KIND 3), "swap AB": the
    weight tile [BLOCK_N, 64] dequantized in registers (codes through their bits, float32
    scales, rounded to bf16) is the left operand of a bf16 tl.dot, the activation tile
    [64, BLOCK_M] the right one (wgmma takes any BLOCK_M of 16..256 there, so a few rows waste
    little), float32 accumulation. Each super-block is 2 halves x 2 nibbles of 64 columns:
    half t, nibble s, tile position p = 32u + i holds column 128t + 64u + 32s + i for Q4_K/Q5_K
    (u: group 2t + u), 128t + 64s + 32u + i for Q6_K (u: v). Programs that share a weight tile are launched together (M
    tiles vary fastest); axis 1 splits K (SPLIT: float32 partials [split, M, N])."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    r1 = tl.where(rmask, rows, 0).to(tl.int64)
    r4 = r1[:, None, None, None]
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = ms < M
    u1 = tl.arange(0, 2)
    u4 = u1[None, :, None, None]
    i4 = (tl.arange(0, 2)[:, None] * 16 + tl.arange(0, 16)[None, :])[None, None, :, :]  # i = 16 i16 + il
    u3 = u1[None, :, None]
    p = tl.arange(0, 64)
    x_rows = x_ptr + ms.to(tl.int64)[None, :] * stride_xm
    col = 64 * (p // 32) + p % 32  # + 128 t + 32 s
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    b_start = pid_k * blocks_per_split
    b_end = tl.minimum(b_start + blocks_per_split, NB)
    for b in range(b_start, b_end):
        d = tl.load(d_ptr + r1 * NB + b).to(tl.float32)[:, None, None, None]
        if KIND == 2:
            dmin = tl.load(m_ptr + r1 * NB + b).to(tl.float32)[:, None, None, None]
        for t in tl.static_range(2):
            q8 = tl.load(qs_ptr + r4 * (NB * 128) + b * 128 + 64 * t + 32 * u4 + i4).to(tl.int32)
            if KIND == 3:
                qh = tl.load(qh_ptr + r4 * (NB * 64) + b * 64 + 32 * t + i4 + u4 * 0).to(tl.int32)
            if KIND == 2 and QH:
                qh = tl.load(qh_ptr + r4 * (NB * 32) + b * 32 + i4 + u4 * 0).to(tl.int32)
            for s in tl.static_range(2):
                if KIND == 2:
                    q = (q8 >> (4 * s)) & 0xF
                    if QH:
                        q = q | (((qh >> (2 * (2 * t + u4) + s)) & 1) << 4)
                    sub = 2 * (2 * t + u3) + s  # [1, 2, 1]
                    sc = tl.load(sc_ptr + r1[:, None, None] * (NB * 8) + b * 8 + sub).to(tl.float32)
                    mn = tl.load(mn_ptr + r1[:, None, None] * (NB * 8) + b * 8 + sub).to(tl.float32)
                    w = _code_f32(q, 0, True) * (d * sc[:, :, :, None]) - dmin * mn[:, :, :, None]
                else:
                    q = ((q8 >> (4 * s)) & 0xF) | (((qh >> (2 * (2 * s + u4))) & 3) << 4)
                    # sub-block of 16: 8t + 4s + 2v + i // 16
                    sub = 8 * t + 4 * s + 2 * u3 + tl.arange(0, 2)[None, None, :]  # [1, 2, 2]
                    sc = tl.load(sc_ptr + r1[:, None, None] * (NB * 16) + b * 16 + sub).to(tl.float32)
                    w = _code_f32(q, 32, True) * (d * sc[:, :, :, None])
                a = tl.reshape(w, [BLOCK_N, 64]).to(tl.bfloat16)
                if KIND == 2:
                    xcol = b * 256 + 128 * t + 32 * s + col
                else:
                    xcol = b * 256 + 128 * t + 64 * s + p
                xt = tl.load(x_rows + xcol[:, None], mask=mmask[None, :], other=0.0)
                acc = tl.dot(a, xt.to(tl.bfloat16), acc)
    out_mask = rmask[:, None] & mmask[None, :]
    if SPLIT:
        tl.store(y_ptr + (pid_k * M + ms.to(tl.int64))[None, :] * N + rows[:, None], acc, mask=out_mask)
    else:
        tl.store(y_ptr + ms.to(tl.int64)[None, :] * stride_ym + rows[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=out_mask)


_KQ_GEMM_FORMATS = {"Q4_K": (2, False), "Q5_K": (2, True), "Q6_K": (3, False)}


def kq_gemm(x: torch.Tensor, w: QuantWeight, *, block_m: int | None = None, block_n: int = 64,
            split_k: int | None = None, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """x[M, K] @ W^T for Q4_K / Q5_K / Q6_K and any M (_kq_gemm_kernel): bf16 tensor-core products
    of the activation and the weight dequantized in registers, float32 accumulation, output in
    x's dtype. K is split (float32 partials summed after) when the tiles are too few."""
    x = _check(x, w)
    if w.fmt not in _KQ_GEMM_FORMATS:
        raise ValueError(f"kq_gemm takes {', '.join(_KQ_GEMM_FORMATS)}")
    M, N = x.shape[0], w.N
    if block_m is None:
        block_m = 128 if M >= 128 else max(16, triton.next_power_of_2(M))
    n_tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    split, blocks_per_split = _split_plan(w.blocks_per_row, 1, n_tiles, split_k, x.device)
    y = split_output(split, M, N, x.dtype, x.device)
    kind, qh = _KQ_GEMM_FORMATS[w.fmt]
    _kq_gemm_kernel[(n_tiles, split)](
        x, y, *_planes(w), M, N, w.blocks_per_row, x.stride(0), N, blocks_per_split,
        KIND=kind, QH=qh, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split > 1,
        num_warps=num_warps, num_stages=num_stages)
    return sum_splits(y, split, x.dtype)


class TritonQuantLinear(torch.nn.Module):
    """A bias-free Linear whose weight [N, K] is GGUF blocks in planes: `quant_gemv` up to
    `gemv_max_rows` rows, `quant_gemm` above."""

    # From this many rows on, Q8_0 / Q4_K / Q5_K / Q6_K weights are dequantized into a temporary
    # (dequantize_weight, one pass over the blocks) and multiplied by cuBLAS: quant_gemm's
    # in-register dequantization ran 2.6-5x behind cuBLAS at 512 rows (stop 18, H200), the
    # temporary costs about a GEMV's time plus its bytes written. Not above DEQUANT_MAX_BYTES of
    # temporary (a large LM head keeps quant_gemm). Operands are rounded to bf16 on both paths.
    DEQUANT_MIN_ROWS = 128
    DEQUANT_MAX_BYTES = 512 << 20
    # Opt-in (TALLOW_QUANT_GEMV2=1): quant_gemv2 for 1..GEMV2_MAX_ROWS rows of the K-quants,
    # until a GPU run shows it ahead of quant_gemv1 / quant_gemv (benchmarks/gpu_gguf_model.py kernels).
    gemv2 = os.environ.get("TALLOW_QUANT_GEMV2") == "1"
    # Opt-in (TALLOW_QUANT_KQ_GEMM=1): kq_gemm (weight as the MMA's left operand, dequantized in
    # registers) above gemv_max_rows rows of Q4_K / Q5_K / Q6_K, instead of quant_gemm and the
    # bf16 temporary + cuBLAS of DEQUANT_MIN_ROWS rows on; "all": for every row count (one row
    # padded to a 16-row tile: the products on tensor cores, the GEMVs' float32 work per weight
    # left to the dequantization alone).
    kq_gemm = os.environ.get("TALLOW_QUANT_KQ_GEMM", "")

    def __init__(self, weight: QuantWeight, gemv_max_rows: int = 8, bias: torch.Tensor | None = None,
                 dequant_min_rows: int | None = None):
        super().__init__()
        self.weight = weight
        self.gemv_max_rows = gemv_max_rows
        self.dequant_min_rows = self.DEQUANT_MIN_ROWS if dequant_min_rows is None else dequant_min_rows
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_gguf_bytes(cls, raw: torch.Tensor, fmt: str, in_features: int, device=None, **kwargs):
        """raw: the tensor's block bytes as gguf.GGUFReader gives them ([N, row_bytes] uint8)."""
        raw = torch.as_tensor(raw)
        if device is not None:
            raw = raw.to(device)
        return cls(repack(raw, fmt, in_features), **kwargs)

    @property
    def in_features(self) -> int:
        return self.weight.K

    @property
    def out_features(self) -> int:
        return self.weight.N

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.kq_gemm == "all" and self.weight.fmt in _KQ_GEMM_FORMATS:
            y = kq_gemm(x2, self.weight)
        elif self.gemv2 and x2.shape[0] <= GEMV2_MAX_ROWS and self.weight.fmt in _GEMV2_FORMATS:
            y = quant_gemv2(x2, self.weight)
        elif x2.shape[0] == 1 and self.weight.fmt in _GEMV1_FORMATS:
            y = quant_gemv1(x2, self.weight)
        elif x2.shape[0] <= self.gemv_max_rows:
            y = quant_gemv(x2, self.weight)
        elif self.kq_gemm and self.weight.fmt in _KQ_GEMM_FORMATS:
            y = kq_gemm(x2, self.weight)
        elif (x2.shape[0] >= self.dequant_min_rows and self.weight.fmt in _GEMV1_FORMATS
              and self.weight.N * self.weight.K * x2.element_size() <= self.DEQUANT_MAX_BYTES):
            # bf16 operands as quant_gemm's (the same numbers whichever path a row count takes)
            wd = dequantize_weight(self.weight, torch.bfloat16)
            if x2.dtype == torch.bfloat16:
                y = torch.matmul(x2, wd.T)
            else:
                y = torch.matmul(x2.to(torch.bfloat16).float(), wd.float().T).to(x2.dtype)
        else:
            y = quant_gemm(x2, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.weight.N)

    def extra_repr(self) -> str:
        return f"{self.weight.fmt}, in_features={self.in_features}, out_features={self.out_features}"


__all__ = ["TritonQuantLinear", "dequantize_weight", "quant_gemm", "quant_gemv", "quant_gemv1", "quant_gemv2", "kq_gemm"]
