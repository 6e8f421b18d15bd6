"""tallow's own CPU kernels (tallow/ops/cpu/kernels.c): built with the system C compiler on
first use, cached by source hash, loaded through ctypes.

The source compiles for one of two instruction sets, the best this CPU has: "avx512" (AVX-512
with VNNI: the linear layers' tiles of 16 channels multiplied by vpdpwssd) or "avx2" (AVX2,
FMA, F16C: tiles of 4 channels). The environment variable TALLOW_CPU_KERNELS=avx2 picks the
AVX2 build on a machine that has both. Without a C compiler or AVX2 `lib()` returns None and
the model falls back to torch's kernels (the quantization schemes "int4-torch" and
"int8-torch" ask for those directly). The shared object links the OpenMP runtime torch
itself loaded (libgomp.so.1), so the kernels' threads are torch's intra-op pool, not a second
one competing for the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import torch

log = logging.getLogger(__name__)

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu")
SOURCE = os.path.join(_DIR, "kernels.c")
HEADERS = [os.path.join(_DIR, name) for name in ("linear_avx2.h", "linear_avx512.h", "linear_gguf.h", "attention_avx512.h")]
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
# instruction set -> (compiler flags, the /proc/cpuinfo flags it needs), best first
VARIANTS = {
    "avx512": (["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
               ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni")),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], ("avx2", "fma", "f16c")),
}
ENV_VARIANT = "TALLOW_CPU_KERNELS"
ABI_VERSION = 8

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None  # the variant lib() hands out
_tried = False
_error: str | None = None
_loaded: dict[str, ctypes.CDLL] = {}

_p, _i, _l, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "tl_q4_linear": ([_p, _i, _i, _i, _p, _p, _p, _p, _p, _i], _i),
    "tl_q8_linear": ([_p, _i, _i, _i, _p, _p, _p, _p, _p, _i], _i),
    "tl_exp": ([_p, _p, _i], None),
    "tl_add_rms_norm": ([_p, _p, _p, _f, _i, _i, _p, _p, _i], None),
    "tl_silu_and_mul": ([_p, _i, _i, _p, _i], None),
    "tl_rotary": ([_p, _i, _i, _i, _l, _p, _p, _i], None),
    "tl_kv_write": ([_p, _l, _p, _l, _i, _i, _i, _p, _p, _p, _i], None),
    "tl_paged_attention": ([_p, _l, _p, _l, _p, _p, _p, _p, _p, _l, _i, _i, _i, _i, _i, _f, _i, _i], _i),
    "tl_llama_layer": ([_p, _p, _p, _p, _p, _p, _i, _i], _i),
    "tl_tile_channels": ([], _i),
    "tl_gguf_linear": ([_p, _i, _i, _i, _i, _p, _p, _p, _p, _p, _p, _p, _i], _i),
    "tl_gguf_tile_channels": ([], _i),
    "tl_gguf_repack": ([_i, _p, _i, _i, _i, _p, _p, _p, _p, _p, _i], _i),
    "tl_half_linear": ([_p, _i, _i, _i, _p, _i, _p, _p, _i], _i),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_variants() -> list[str]:
    """The instruction sets of VARIANTS this CPU can run, best first."""
    return [name for name, (_, needs) in VARIANTS.items() if all(flag in cpu_flags() for flag in needs)]


def cpu_supported() -> bool:
    return bool(supported_variants())


def _cache_dir() -> str:
    from tallow.config import _default_cache_dir

    return os.path.join(_default_cache_dir(), "kernels")


def _build(path: str, flags: list[str]) -> None:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        subprocess.run([cc, *flags, "-o", tmp, SOURCE, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, path)  # atomic: concurrent builders leave one complete file
    except BaseException:
        os.unlink(tmp)
        raise


def load(variant: str) -> ctypes.CDLL:
    """The kernels built for one instruction set of VARIANTS (built on first use, cached);
    raises where this CPU or machine cannot run or build them."""
    with _lock:
        if variant in _loaded:
            return _loaded[variant]
        if variant not in supported_variants():
            raise RuntimeError(f"the CPU lacks one of {', '.join(VARIANTS[variant][1])}" if variant in VARIANTS
                               else f"unknown kernel variant {variant!r}; one of {', '.join(VARIANTS)}")
        flags = FLAGS + VARIANTS[variant][0]
        digest = hashlib.sha256()
        for source in (SOURCE, *HEADERS):
            with open(source, "rb") as f:
                digest.update(f.read())
        digest.update(" ".join(flags).encode())
        path = os.path.join(_cache_dir(), f"tallow_cpu_{variant}_{digest.hexdigest()[:16]}.so")
        if not os.path.exists(path):
            _build(path, flags)
        loaded = ctypes.CDLL(path)
        if loaded.tl_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path}: ABI {loaded.tl_abi_version()}, expected {ABI_VERSION}")
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(loaded, name)
            fn.argtypes, fn.restype = argtypes, restype
        _loaded[variant] = loaded
        return loaded


def lib() -> ctypes.CDLL | None:
    """The loaded kernels of the best instruction set here (or of $TALLOW_CPU_KERNELS), or None
    where they cannot be built or loaded (the reason is logged once)."""
    global _lib, _tried, _error
    if _tried:
        return _lib
    variants = supported_variants()
    wanted = os.environ.get(ENV_VARIANT) or (variants[0] if variants else None)
    try:
        if wanted is None:
            raise RuntimeError(f"the CPU lacks one of {', '.join(VARIANTS['avx2'][1])}")
        _lib = load(wanted)
    except subprocess.CalledProcessError as e:
        _error = f"build failed: {e.stderr.strip()[:2000]}"
    except Exception as e:  # no compiler, unsupported CPU, load error: torch's kernels serve
        _error = f"{type(e).__name__}: {e}"
    if _error:
        log.warning("tallow CPU kernels unavailable (%s); using torch's kernels", _error)
    _tried = True
    return _lib


def variant() -> str | None:
    """The instruction set of the kernels lib() hands out (a key of VARIANTS), or None."""
    kernels = lib()
    return next((name for name, loaded in _loaded.items() if loaded is kernels), None) if kernels else None


def tile_channels(kernels: ctypes.CDLL | None = None) -> int:
    """Output channels per weight tile of these kernels (default: lib()'s): 4 (AVX2) or 16."""
    return (kernels or lib()).tl_tile_channels()


def unavailable_reason() -> str | None:
    lib()
    return _error


# ---- the elementwise ops on float32 CPU tensors (tallow.ops dispatches here) --------------------

def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors: float32, on the CPU, rows contiguous,
    the last dimension a multiple of 8. (Called per op in the decode loop: kept cheap.)"""
    if _lib is None:
        return lib() is not None and usable(*tensors)
    for t in tensors:
        if t.dtype is not torch.float32 or t.is_cuda or t.stride(-1) != 1 or t.shape[-1] % 8:
            return False
    return True


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) for contiguous float32 [T, D]; new tensors."""
    T, D = x.shape
    out = torch.empty_like(x)
    res = torch.empty_like(x) if residual is not None else x
    lib().tl_add_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                          eps, T, D, out.data_ptr(), res.data_ptr(), torch.get_num_threads())
    return out, res


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    T, I2 = x.shape
    out = x.new_empty(T, I2 // 2)
    lib().tl_silu_and_mul(x.data_ptr(), T, I2 // 2, out.data_ptr(), torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Rotate x [T, heads, head_dim] (heads contiguous, rows at any stride) in place."""
    T, heads, D = x.shape
    assert x.stride(2) == 1 and x.stride(1) == D and positions.dtype == torch.int64 and positions.is_contiguous()
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
    lib().tl_rotary(x.data_ptr(), T, heads, D, x.stride(0), positions.data_ptr(), cos_sin_cache.data_ptr(),
                    torch.get_num_threads())


def report() -> str:
    """One line on the kernels: where the built library is, or why there is none (make install
    prints it after building them)."""
    return f"tallow CPU kernels: {lib()._name}" if lib() is not None else f"tallow CPU kernels unavailable: {_error}"
