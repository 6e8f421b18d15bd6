"""tallow.ops (RMSNorm + residual, rotary) against plain float64 references.

Three ways to run each op: the torch fallback on the CPU (always), the Triton kernel under
the interpreter on the CPU (the triton_interp tier: pytest -m triton_interp, make test-triton),
and the public function on CUDA (gpu). Also silu*mul and the one-row GEMV.
"""

from __future__ import annotations

import pytest
import torch

from tallow.ops import apply_rotary, fused_add_rms_norm, rms_norm
from triton_test_devices import CUDA, INTERPRETER

TORCH = pytest.param("torch")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def ops_on(where: str):
    """(device, rms_norm, fused_add_rms_norm, apply_rotary) for one way of running the ops."""
    if where == "cpu":  # the Triton kernels themselves, interpreted
        from tallow.ops.triton_norm import triton_rms_norm
        from tallow.ops.triton_rotary import triton_apply_rotary

        return ("cpu", lambda x, w, eps: triton_rms_norm(x, None, w, eps)[0],
                lambda x, r, w, eps: triton_rms_norm(x, r, w, eps), triton_apply_rotary)
    return ("cpu" if where == "torch" else where, rms_norm, fused_add_rms_norm, apply_rotary)


def dtypes_on(where: str):
    # The interpreter casts float32 -> bfloat16 by truncation (the GPU rounds to nearest even).
    return {"cuda": [torch.float32, torch.bfloat16, torch.float16], "torch": [torch.float32, torch.bfloat16],
            "cpu": [torch.float32]}[where]


def reference_rms_norm(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("where", [TORCH, INTERPRETER, CUDA])
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_with_and_without_residual(where, hidden):
    device, norm, add_norm, _ = ops_on(where)
    g = torch.Generator().manual_seed(0)
    for dtype in dtypes_on(where):
        x = (torch.randn(7, hidden, generator=g) * 3).to(device, dtype)
        residual = torch.randn(7, hidden, generator=g).to(device, dtype)
        weight = (1 + torch.randn(hidden, generator=g) / 4).to(device, dtype)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(norm(x, weight, 1e-6).double(), reference_rms_norm(x, weight, 1e-6),
                                   atol=tol, rtol=tol)
        x_before, residual_before = x.clone(), residual.clone()
        out, new_residual = add_norm(x, residual, weight, 1e-6)
        assert torch.equal(new_residual, x + residual)  # the same rounding as an unfused add
        assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
        torch.testing.assert_close(out.double(), reference_rms_norm(x + residual, weight, 1e-6),
                                   atol=tol, rtol=tol)


def cos_sin_cache(max_positions, head_dim, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float(), angles


def reference_rotary(x, angles):
    """Rotate-half RoPE as complex multiplication: (x1 + i x2) * e^(i angle)."""
    x1, x2 = x.double().chunk(2, dim=-1)
    z = torch.complex(x1, x2) * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.cat((z.real, z.imag), dim=-1)


@pytest.mark.parametrize("where", [TORCH, INTERPRETER, CUDA])
@pytest.mark.parametrize("heads", [(4, 2, 16), (9, 3, 24)], ids=["gqa-d16", "gqa3-d24"])
def test_rotary_matches_complex_rotation(where, heads):
    device, _, _, rotary = ops_on(where)
    num_heads, num_kv_heads, head_dim = heads
    cache, angles = cos_sin_cache(64, head_dim)
    g = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 5, 63, 17, 17, 2])
    for dtype in dtypes_on(where):
        # q and k as strided views of one fused qkv projection output, like the model's.
        qkv = torch.randn(6, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(device, dtype)
        q, k = qkv[:, :num_heads], qkv[:, num_heads: num_heads + num_kv_heads]
        qkv_before = qkv.clone()
        q_rot, k_rot = rotary(q, k, positions.to(device), cache.to(device))
        assert torch.equal(qkv, qkv_before)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(q_rot.double(), reference_rotary(q, angles[positions].to(device)),
                                   atol=tol, rtol=tol)
        torch.testing.assert_close(k_rot.double(), reference_rotary(k, angles[positions].to(device)),
                                   atol=tol, rtol=tol)


@pytest.mark.parametrize("where", [INTERPRETER, CUDA])
@pytest.mark.parametrize("heads", [(4, 2, 16), (9, 3, 24)], ids=["gqa-d16", "gqa3-d24"])
def test_rotary_with_kv_write_equals_rotary_then_write(where, heads):
    """The fused kernel returns the rotated q and leaves in the cache the rotated k and v at
    each token's slot (padding slot -1 untouched, every other cache row unchanged)."""
    from tallow.ops.triton_rotary import triton_rotary_and_write_kv

    num_heads, num_kv_heads, head_dim = heads
    device = where
    cache, angles = cos_sin_cache(64, head_dim)
    g = torch.Generator().manual_seed(2)
    positions = torch.tensor([0, 5, 63, 17, 17, 2])
    slots = torch.tensor([3, 17, -1, 40, 8, 0])  # blocks of 4: different blocks and offsets
    for dtype in dtypes_on(where):
        qkv = torch.randn(6, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(device, dtype)
        q, k = qkv[:, :num_heads], qkv[:, num_heads: num_heads + num_kv_heads]
        v = qkv[:, num_heads + num_kv_heads:]
        k_cache = torch.randn(12, 4, num_kv_heads, head_dim, generator=g).to(device, dtype)
        v_cache = torch.randn(12, 4, num_kv_heads, head_dim, generator=g).to(device, dtype)
        want_k, want_v = k_cache.clone().view(-1, num_kv_heads, head_dim), v_cache.clone().view(-1, num_kv_heads, head_dim)
        k_rot = reference_rotary(k, angles[positions].to(device)).to(dtype)
        real = slots >= 0
        want_k[slots[real].to(device)] = k_rot[real.to(device)]
        want_v[slots[real].to(device)] = v[real.to(device)]
        q_rot = triton_rotary_and_write_kv(q, k, v, positions.to(device), cache.to(device), k_cache, v_cache,
                                           slots.to(device))
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(q_rot.double(), reference_rotary(q, angles[positions].to(device)),
                                   atol=tol, rtol=tol)
        torch.testing.assert_close(k_cache.view(-1, num_kv_heads, head_dim).double(), want_k.double(),
                                   atol=tol, rtol=tol)
        assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim), want_v)


@pytest.mark.parametrize("where, shape", [
    *(pytest.param(where.values[0], shape, marks=where.marks, id=f"{name}-{where.values[0]}")
      for where in (INTERPRETER, CUDA) for name, shape in (("small", (96, 160)), ("ragged", (30, 1000)))),
    pytest.param("cuda", (4096, 4096), marks=CUDA.marks, id="o_proj-cuda"),  # too slow to interpret
])
def test_triton_gemv_matches_float64(where, shape):
    from tallow.ops.triton_gemv import triton_gemv

    g = torch.Generator().manual_seed(0)
    N, K = shape
    dtypes = [torch.float32] if where == "cpu" else [torch.float32, torch.bfloat16]
    for dtype in dtypes:
        w = (torch.randn(N, K, generator=g) * 0.05).to(where, dtype)
        x, bias = torch.randn(1, K, generator=g).to(where, dtype), torch.randn(N, generator=g).to(where, dtype)
        for b in (None, bias):
            ref = x.double() @ w.double().T + (0 if b is None else b.double())
            y = triton_gemv(x, w, b)
            assert y.shape == (1, N) and y.dtype == dtype
            err = (y.double() - ref).abs().max().item()
            assert err <= TOLERANCE[dtype] * max(1.0, ref.abs().max().item()), (dtype, err)


@pytest.mark.parametrize("where", [INTERPRETER, CUDA])
@pytest.mark.parametrize("width", [64, 3000], ids=["one-block", "ragged-blocks"])
def test_silu_and_mul_matches_float64(where, width):
    """silu(gate) * up over [T, 2d] rows, d past the kernel's 1024-column block in the second case."""
    from tallow.ops.triton_activation import triton_silu_and_mul

    g = torch.Generator().manual_seed(4)
    for dtype in dtypes_on(where):
        x = (torch.randn(3, width, generator=g) * 3).to(where, dtype)
        gate, up = x.double().chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(triton_silu_and_mul(x).double(), want, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_row_linear_uses_the_gemv_only_for_one_row_on_cuda():
    from torch import nn

    from tallow.models.llama import one_row_linear

    layer = nn.Linear(256, 64).cuda()
    x = torch.randn(3, 256, device="cuda")
    torch.testing.assert_close(one_row_linear(layer, x[:1]), layer(x[:1]), rtol=1e-4, atol=1e-4)
    assert torch.equal(one_row_linear(layer, x), layer(x))
