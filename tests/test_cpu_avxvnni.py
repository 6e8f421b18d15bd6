"""The "avxvnni" build of the CPU kernels (AVX2's code with AVX-VNNI's one-instruction
multiply-adds, kernels.c's TL_VNNI256): the same bits as the AVX2 build for every linear format
and row count, since the integers are exact either way and the float math is untouched.

A CPU without AVX-VNNI cannot run that build, so its arithmetic is checked through
"avxvnni-evex" (cpu_build.CHECK_VARIANTS): the same code with the EVEX encodings of the same
instructions, which AVX-512 VNNI CPUs run. Where the CPU has AVX-VNNI, the real build is checked
too (and the fixtures of test_cpu_kernels / test_gguf_native run it as one more variant)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch
from gguf_files import SCALE_FIELDS, random_blocks
from test_cpu_kernels import random_weight

from tallow.models import gguf_linear as gl
from tallow.models.quant import Q4Linear, Q8Linear
from tallow.ops import cpu_build, cpu_native

VNNI_BUILDS = [v for v in ("avxvnni", "avxvnni-evex") if cpu_native.runs(v)]

pytestmark = [
    pytest.mark.skipif(cpu_build.cannot_build() is not None or not cpu_native.runs("avx2"),
                       reason="the AVX2 kernels cannot be built or run here"),
    pytest.mark.skipif(not VNNI_BUILDS, reason="the CPU has neither AVX-VNNI nor AVX-512 VNNI"),
]


@pytest.fixture(params=VNNI_BUILDS)
def vnni(request):
    return cpu_native.load(request.param)


def with_kernels(lib, fn):
    """fn() with `lib` as the kernels the layers take."""
    old = cpu_native._lib, cpu_native._tried
    cpu_native._lib, cpu_native._tried = lib, True
    try:
        return fn()
    finally:
        cpu_native._lib, cpu_native._tried = old


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows of widely ranging magnitudes, and rows whose blocks round to the largest integers
    (every |x| equal: all codes +-127 / +-2047, the sums' worst case)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 1, k)
    x[1::4] = torch.where(torch.rand(x[1::4].shape, generator=g) < 0.5, -1.0, 1.0)
    return x


@pytest.mark.parametrize("cls", [Q4Linear, Q8Linear])
def test_q4_q8_linear_same_bits_as_avx2(cls, vnni):
    n, k = 100, 192  # a partial last tile
    layer = cls(random_weight(n, k, seed=5), torch.randn(n))
    x = activations(300, k, seed=6)
    avx2 = cpu_native.load("avx2")
    for m in (1, 2, 3, 4, 5, 37, 300):
        ys = []
        for lib in (avx2, vnni):
            y = torch.empty(m, n)
            assert getattr(lib, cls._kernel)(x[:m].data_ptr(), m, k, n, *layer._ptrs, y.data_ptr(), 2) == 0
            ys.append(y)
        assert torch.equal(ys[0], ys[1]), m


def extreme_blocks(name: str, rows: int, cols: int) -> np.ndarray:
    """Blocks whose every byte but the float16 scales is all ones: each code at the format's
    largest (the AVX2 loops' int16 sums at their bound), K-quants' 6-bit scales and mins 63."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = random_blocks(name, rows, cols, np.random.default_rng(11))
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType[name]][1])
    keep = np.zeros(blocks.shape[1], dtype=bool)
    for off in SCALE_FIELDS[name]:
        keep[off:off + 2] = True
    blocks[:, ~keep] = 0xFF
    return raw


@pytest.mark.parametrize("name", list(gl.GGUF_KERNEL_FORMATS))
def test_gguf_linear_same_bits_as_avx2(name, vnni):
    """Every GGUF kernel format through linear_from_raw (each build repacks for itself), at one
    row (the one-row loop), a few and many (the many-row loops, a partial group of rows)."""
    avx2 = cpu_native.load("avx2")
    for raw in (random_blocks(name, 40, 512, np.random.default_rng(3)), extreme_blocks(name, 40, 512)):
        x = activations(70, 512, seed=4)
        layers = [with_kernels(lib, lambda: gl.linear_from_raw(raw, name, 512)) for lib in (avx2, vnni)]
        for m in (1, 2, 3, 7, 70):
            a, b = (with_kernels(lib, lambda: layer(x[:m])) for lib, layer in zip((avx2, vnni), layers))
            assert torch.isfinite(a).all()
            assert torch.equal(a, b), (name, m)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump")
def test_the_avxvnni_build_takes_the_vex_instructions(tmp_path):
    """The served build compiles with AVX-VNNI's VEX encodings (what Intel's client cores run:
    they lack the EVEX ones) in the linear loops, and the AVX2 build has none."""
    out = tmp_path / "k.so"
    try:
        cpu_build.build("avxvnni", str(out))
    except subprocess.CalledProcessError as e:
        pytest.skip(f"the compiler lacks -mavxvnni: {e.stderr[-300:]}")
    asm = subprocess.run(["objdump", "-d", str(out)], capture_output=True, text=True, check=True).stdout
    assert asm.count("{vex} vpdpwssd") >= 16 and asm.count("{vex} vpdpbusd") >= 16
    cpu_build.build("avx2", str(tmp_path / "a.so"))
    asm2 = subprocess.run(["objdump", "-d", str(tmp_path / "a.so")], capture_output=True, text=True, check=True).stdout
    assert "vpdp" not in asm2


def test_an_optional_build_that_fails_gives_way_to_the_next(monkeypatch):
    """A compiler too old for -mavxvnni: the best-variant choice falls back to the AVX2 build,
    not to torch's kernels."""
    avx2 = cpu_native.load("avx2")
    monkeypatch.setattr(cpu_native, "_tried", False)
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "supported_variants", lambda: ["avxvnni", "avx2"])
    real = cpu_native.load

    def load(variant):
        if variant == "avxvnni":
            raise subprocess.CalledProcessError(1, ["cc"], stderr="cc: error: unrecognized option '-mavxvnni'")
        return real(variant)

    monkeypatch.setattr(cpu_native, "load", load)
    assert cpu_native.select(None) is avx2
