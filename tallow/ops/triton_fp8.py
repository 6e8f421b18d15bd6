"""FP8 (e4m3) linear layers in Triton: y[M, N] = x[M, K] @ (W[N, K] * scale[N, None])^T.

The weight is float8_e4m3fn with one float32 scale per output channel (a per-tensor scale is
held as N equal ones: a fused q/k/v layer carries each part's). Three kernels:

- `fp8_gemv` (decode, one row): each program streams BLOCK_N whole rows of the weight (1 byte
  a weight: half of bf16's), widens them to float32 in registers, multiplies by x in float32
  and applies the row's scale once at the end. At batch 1 a step only streams weights, so
  this is where fp8 halves the bytes read. The bytes become float32 through their bits
  (`_widen_fp8`), not conversion instructions.
- `fp8_gemm_swap` (weight-only, opt-in in Fp8Linear): the fp8 tile widened in registers as the
  MMA's left operand, the activation the right one.
- `fp8_gemm` with bfloat16 / float16 activations (weight-only): tiles of the weight widened to
  the activations' type in registers (e4m3 values are exact in both) and multiplied on tensor
  cores with `tl.dot`; float32 accumulation (float32 activations: float32 products); the per-channel scale applied to the accumulator. K is split
  over programs (float32 partials, summed after) when the tiles are too few to fill the GPU.
- `fp8_gemm` with fp8 activations (W8A8): the rows quantized per token first
  (`quantize_rows`: scale = amax / 448), then an fp8 x fp8 `tl.dot` (wgmma on sm_90, twice
  bf16's tensor-core rate), output = acc * a_scale[m] * w_scale[n].

`Fp8Linear` holds the weight and picks: one row -> `fp8_gemv`; up to `w8a8_min_rows` rows ->
weight-only `fp8_gemm`; more -> `large_batch` ("weight_only", the default; "w8a8":
quantize_rows + fp8 `fp8_gemm`; "scaled_mm": quantize_rows + torch._scaled_mm (cuBLASLt,
row-wise scales)). Weight-only everywhere keeps greedy decoding batch invariant (a row's
result does not depend on the path its batch size picks, up to float32 summation order);
the W8A8 paths quantize activations only in batches of w8a8_min_rows rows or more, so a
prompt prefilled alone or in a batch can see different activations (2^-4 per element).
Off CUDA (tests of the loader on the CPU) it falls back to torch on the dequantized weight.

Defaults are reasoned, not tuned yet: benchmarks/gpu_quant_linear.py --fp8 times each path.
Checked on the CPU under Triton's interpreter and compiled for sm_90 (tests/test_triton_fp8.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tallow.ops.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, dequantize, quantize_per_channel
from tallow.ops.triton_quant import split_output, sum_splits


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr):
    """One program per row: scale = max(amax / 448, MIN_SCALE); q = clamp(x / scale) as e4m3."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + ks, mask=ks < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / 448.0, 1e-12)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + ks, mask=ks < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(q_ptr + row * stride_qm + ks, q.to(tl.float8e4nv), mask=ks < K)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor, block_k: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization: x [M, K] -> (float8_e4m3fn [M, K], float32 scale [M])."""
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        _quant_rows_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0),
                                 BLOCK_K=min(block_k, triton.next_power_of_2(K)), num_warps=4)
    return q, s


# The sign (bit 31, from the sign-extended byte) and the 7 exponent-mantissa bits at 20..26 of
# a float32: 0x87F00000 as a signed int32.
_E4M3_BITS = tl.constexpr(0x87F00000 - (1 << 32))


@triton.jit
def _widen_fp8(w, FASTCVT: tl.constexpr):
    """e4m3 weights -> float32. FASTCVT: w holds the bytes as int8 and the result is the value
    times 2^-120 (the bytes' 7 exponent-mantissa bits under float32's exponent bias: e4m3
    subnormals land on float32 subnormals, exact), two integer ops instead of the e4m3 -> f16
    -> f32 conversions (16 per clock per SM on sm_90); the caller multiplies its sums by 2^120."""
    if FASTCVT:
        return ((w.to(tl.int32) << 20) & _E4M3_BITS).to(tl.float32, bitcast=True)
    else:
        return w.to(tl.float32)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_w,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     FASTCVT: tl.constexpr = False):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + ks).to(tl.float32)
            w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None], other=0.0)
        else:
            k_mask = ks < K
            x = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc += _widen_fp8(w, FASTCVT) * x[None, :]
    scale = tl.load(s_ptr + rows, mask=row_mask, other=0.0)
    y = tl.sum(acc, axis=1)
    if FASTCVT:
        y = y * 1.329227995784916e36  # 2^120
    y = y * scale
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


# fp8_gemv's defaults: block_k 1024 was the fastest of the stop 30 H200 sweep on o and gate_up
# (12.0 / 45.5 us against 14.4 / 59.1 at 2048; fp8_linear.log); fastcvt: _widen_fp8 through the
# bits (TALLOW_FP8_FASTCVT=0: Triton's conversions, as before).
FP8_GEMV_DEFAULTS = dict(block_n=4, block_k=1024, num_warps=4, num_stages=2,
                         fastcvt=os.environ.get("TALLOW_FP8_FASTCVT", "0") == "1")


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, block_n: int | None = None,
             block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
             fastcvt: bool | None = None) -> torch.Tensor:
    """x [1, K] (or [K]) @ (weight * scale[:, None])^T -> [1, N] in x's dtype. weight: [N, K]
    float8_e4m3fn with unit stride along K; scale: float32 [N]. Unset settings: FP8_GEMV_DEFAULTS."""
    d = FP8_GEMV_DEFAULTS
    block_n, block_k = block_n or d["block_n"], block_k or d["block_k"]
    num_warps, num_stages = num_warps or d["num_warps"], num_stages or d["num_stages"]
    fastcvt = d["fastcvt"] if fastcvt is None else fastcvt
    N, K = weight.shape
    assert x.numel() == K and weight.stride(1) == 1 and weight.dtype == FP8_DTYPE
    x = x.reshape(K)
    if not x.is_contiguous():
        x = x.contiguous()
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight.view(torch.int8) if fastcvt else weight, scale, y, N, K, weight.stride(0), BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=K % block_k == 0, FASTCVT=fastcvt, num_warps=num_warps, num_stages=num_stages)
    return y


@triton.jit
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, y_ptr, M, N, K,
                     stride_am, stride_wn, stride_ym, k_per_split,
                     A_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, SPLIT: tl.constexpr, A16: tl.constexpr):
    # Programs that share a weight tile run together (M tiles vary fastest): the tile comes
    # from DRAM once and from L2 for the others. Axis 1 splits K (SPLIT: float32 partials
    # [split, M, N], summed by triton_quant.sum_splits).
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # (a multiple of BLOCK_K, said so: the tiles' addresses are then known aligned, which the
    # software pipeliner's asynchronous copies need; without it the loop ran unpipelined)
    k_start = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs + k0, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + rk) < k_end
            a = tl.load(a_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if A_FP8:
            acc = tl.dot(a, tl.trans(w), acc)
        elif A16:  # bf16 / fp16 activations: the weight widened to their type (e4m3 fits both exactly)
            acc = tl.dot(a, tl.trans(w.to(a_ptr.dtype.element_ty)), acc)
        else:  # float32 activations (float32 models, the interpreter): exact float32 products
            acc = tl.dot(a, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    acc = acc * tl.load(w_scale_ptr + rn, mask=n_mask, other=0.0)[None, :]
    if A_FP8:
        acc = acc * tl.load(a_scale_ptr + rm, mask=m_mask, other=0.0)[:, None]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tl.store(y_ptr + (pid_k * M + rm.to(tl.int64))[:, None] * N + rn[None, :], acc, mask=out_mask)
    else:
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=out_mask)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, x_scale: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None, block_m: int | None = None, block_n: int = 64,
             block_k: int | None = None, split_k: int | None = None, num_warps: int = 4,
             num_stages: int = 3) -> torch.Tensor:
    """x [M, K] @ (weight * scale[:, None])^T -> [M, N]. x bfloat16/float16 (weight-only: tensor-core
    products in x's type, exact), float32 (exact float32 products, no tensor cores: float32 models
    and tests), or float8_e4m3fn with x_scale [M] float32
    (its per-row scales, from quantize_rows: fp8 products; out_dtype needed, bfloat16 default).
    Float32 accumulation either way. K is split over programs (float32 partials summed after,
    the same order for any M) when the tiles are too few to fill the GPU."""
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and weight.stride(1) == 1 and weight.dtype == FP8_DTYPE
    a_fp8 = x.dtype == FP8_DTYPE
    if a_fp8 and x_scale is None:
        raise ValueError("fp8 activations need their per-row x_scale")
    if x.stride(1) != 1:
        x = x.contiguous()
    out_dtype = out_dtype or (torch.bfloat16 if a_fp8 else x.dtype)
    if block_m is None:
        block_m = 128 if M >= 128 else max(16, triton.next_power_of_2(M))
    if block_k is None:
        block_k = 128 if a_fp8 else 64
    block_k = min(block_k, max(32, triton.next_power_of_2(K)))
    n_tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    steps = triton.cdiv(K, block_k)
    if split_k is None:
        split_k = 1
        if x.device.type == "cuda":
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            split_k = triton.cdiv(sms, n_tiles)
    split_k = max(1, min(split_k, steps))
    k_per_split = triton.cdiv(steps, split_k) * block_k
    split = triton.cdiv(K, k_per_split)
    if M == 0:
        return torch.empty(0, N, dtype=out_dtype, device=x.device)
    y = split_output(split, M, N, out_dtype, x.device)
    _fp8_gemm_kernel[(n_tiles, split)](
        x, x_scale if a_fp8 else scale, weight, scale, y, M, N, K, x.stride(0), weight.stride(0), N, k_per_split,
        A_FP8=a_fp8, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k_per_split % block_k == 0
        and K % block_k == 0, SPLIT=split > 1, A16=x.dtype in (torch.bfloat16, torch.float16),
        num_warps=num_warps, num_stages=num_stages)
    return sum_splits(y, split, out_dtype)


@triton.jit
def _fp8_swap_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     SPLIT: tl.constexpr):
    """Weight-only y^T = (W * s) x^T with the weight as the MMA's left operand ("swap AB"): the
    fp8 tile [BLOCK_N, BLOCK_K] is widened to x's 16-bit type in registers and used from there
    (wgmma reads its left operand from registers: no shared-memory round trip of the widened
    tile), the activation tile [BLOCK_K, BLOCK_M] is the right operand (any BLOCK_M of 16..256,
    so a few rows waste little). Float32 accumulation; M tiles vary fastest; axis 1 splits K
    (SPLIT: float32 partials [split, M, N])."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm.to(tl.int64)[None, :] * stride_xm + rk[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None], other=0.0)
            x = tl.load(x_ptrs + k0, mask=m_mask[None, :], other=0.0)
        else:
            k_mask = (k0 + rk) < k_end
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs + k0, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        acc = tl.dot(w.to(x_ptr.dtype.element_ty), x, acc)
    acc = acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0)[:, None]
    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT:
        tl.store(y_ptr + (pid_k * M + rm.to(tl.int64))[None, :] * N + rn[:, None], acc, mask=out_mask)
    else:
        tl.store(y_ptr + rm.to(tl.int64)[None, :] * stride_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=out_mask)


def fp8_gemm_swap(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, block_m: int | None = None,
                  block_n: int = 64, block_k: int = 128, split_k: int | None = None, num_warps: int = 4,
                  num_stages: int = 3) -> torch.Tensor:
    """Weight-only x [M, K] (bfloat16 / float16) @ (weight * scale[:, None])^T -> [M, N] in x's
    dtype, the weight as the MMA's left operand (_fp8_swap_kernel): the same products and
    float32 sums as fp8_gemm's weight-only path. K is split (float32 partials summed after)
    until there are about as many programs as SMs."""
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and weight.stride(1) == 1 and weight.dtype == FP8_DTYPE
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_gemm_swap takes bfloat16 / float16 activations, got {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if M == 0:
        return torch.empty(0, N, dtype=x.dtype, device=x.device)
    if block_m is None:
        block_m = min(128, max(16, triton.next_power_of_2(M)))
    block_k = min(block_k, max(32, triton.next_power_of_2(K)))
    n_tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    steps = triton.cdiv(K, block_k)
    if split_k is None:
        split_k = 1
        if x.device.type == "cuda":
            split_k = triton.cdiv(torch.cuda.get_device_properties(x.device).multi_processor_count, n_tiles)
    split_k = max(1, min(split_k, steps))
    k_per_split = triton.cdiv(steps, split_k) * block_k
    split = triton.cdiv(K, k_per_split)
    y = split_output(split, M, N, x.dtype, x.device)
    _fp8_swap_kernel[(n_tiles, split)](
        x, weight, scale, y, M, N, K, x.stride(0), weight.stride(0), N, k_per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k_per_split % block_k == 0 and K % block_k == 0,
        SPLIT=split > 1, num_warps=num_warps, num_stages=num_stages)
    return sum_splits(y, split, x.dtype)


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """quantize_rows + torch._scaled_mm (cuBLASLt fp8 GEMM, row-wise scales; sm_89+, K and N
    multiples of 16)."""
    q, s = quantize_rows(x)
    return torch._scaled_mm(q, weight.t(), scale_a=s[:, None], scale_b=scale[None, :], out_dtype=out_dtype)


class Fp8Linear(torch.nn.Module):
    """A Linear whose weight [N, K] is float8_e4m3fn with a float32 scale per output channel.
    The engine sets each layer's large_batch from EngineConfig.fp8_large_batch.

    weight and weight_scale are parameters (requires_grad False), so a checkpoint's tensors
    load into them by name (LlamaForCausalLM.load_weights). Class attributes set the paths
    (the benchmarks switch them): one row -> fp8_gemv; up to w8a8_min_rows - 1 rows ->
    weight-only fp8_gemm; from w8a8_min_rows on -> large_batch ("weight_only" | "w8a8" |
    "scaled_mm")."""

    w8a8_min_rows = 64
    large_batch = "weight_only"
    gemv_config: dict = {}
    # Opt-in (TALLOW_FP8_SWAP=1): bf16 / fp16 batches that take the weight-only GEMM use
    # fp8_gemm_swap (the weight as the MMA's left operand) instead of fp8_gemm, until a GPU run
    # shows it ahead (benchmarks/gpu_fp8_linear.py times both).
    swap_ab = os.environ.get("TALLOW_FP8_SWAP") == "1"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                         requires_grad=False)
        self.weight_scale = torch.nn.Parameter(torch.ones(out_features, dtype=torch.float32, device=device),
                                               requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: torch.nn.Linear) -> "Fp8Linear":
        """Dynamic per-channel quantization of a float Linear (quantize_per_channel)."""
        w = linear.weight
        out = cls(w.shape[1], w.shape[0], bias=linear.bias is not None, device=w.device, dtype=w.dtype)
        q, s = quantize_per_channel(w)
        out.weight.data, out.weight_scale.data = q, s
        if linear.bias is not None:
            out.bias.data = linear.bias.data
        return out

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        M = x2.shape[0]
        if not x.is_cuda:  # the torch fallback (loader tests on the CPU)
            y = torch.nn.functional.linear(x2, self.dequantized_weight(x.dtype))
        elif M == 1:
            y = fp8_gemv(x2, self.weight, self.weight_scale, **self.gemv_config)
        elif M < self.w8a8_min_rows or self.large_batch == "weight_only":
            if self.swap_ab and x2.dtype in (torch.bfloat16, torch.float16):
                y = fp8_gemm_swap(x2, self.weight, self.weight_scale)
            else:
                y = fp8_gemm(x2, self.weight, self.weight_scale)
        elif self.large_batch == "scaled_mm":
            y = scaled_mm(x2, self.weight, self.weight_scale, x.dtype)
        else:
            q, s = quantize_rows(x2)
            y = fp8_gemm(q, self.weight, self.weight_scale, x_scale=s, out_dtype=x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"fp8_e4m3, in_features={self.in_features}, out_features={self.out_features}"


__all__ = ["FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "Fp8Linear", "dequantize", "fp8_gemm", "fp8_gemm_swap", "fp8_gemv",
           "quantize_per_channel", "quantize_rows", "scaled_mm"]
