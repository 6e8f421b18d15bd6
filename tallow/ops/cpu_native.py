"""tallow's own CPU kernels (tallow/ops/cpu/kernels.c): built with the system C compiler on
first use, cached by source hash, loaded through ctypes.

The build needs a C compiler (gcc or cc on PATH) and a CPU with AVX2, FMA and F16C; without
them `lib()` returns None and the model falls back to torch's kernels (the quantization schemes
"int4-torch" and "int8-torch" ask for those directly). The
shared object links the OpenMP runtime torch itself loaded (libgomp.so.1), so the kernels'
threads are torch's intra-op pool, not a second one competing for the cores.
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

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu", "kernels.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
ABI_VERSION = 6
_REQUIRED_FLAGS = ("avx2", "fma", "f16c")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None

_p, _i, _l, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "tl_q4_linear": ([_p, _i, _i, _i, _p, _p, _p, _p, _p, _i], _i),
    "tl_q8_linear": ([_p, _i, _i, _i, _p, _p, _p, _p, _p, _i], _i),
    "tl_exp": ([_p, _p, _i], None),
    "tl_add_rms_norm": ([_p, _p, _p, _f, _i, _i, _p, _p, _i], None),
    "tl_silu_and_mul": ([_p, _i, _i, _p, _i], None),
    "tl_rotary": ([_p, _i, _i, _i, _l, _p, _p, _i], None),
    "tl_kv_write": ([_p, _l, _p, _l, _i, _i, _i, _p, _p, _p], None),
    "tl_paged_attention": ([_p, _l, _p, _l, _p, _p, _p, _p, _p, _l, _i, _i, _i, _i, _i, _f, _i], _i),
    "tl_llama_layer": ([_p, _p, _p, _p, _p, _p, _i, _i], _i),
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


def cpu_supported() -> bool:
    return all(flag in cpu_flags() for flag in _REQUIRED_FLAGS)


def _cache_dir() -> str:
    from tallow.config import _default_cache_dir

    return os.path.join(_default_cache_dir(), "kernels")


def _build(path: str) -> None:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, "-o", tmp, SOURCE, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, path)  # atomic: concurrent builders leave one complete file
    except BaseException:
        os.unlink(tmp)
        raise


def lib() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be built or loaded (the reason is logged once)."""
    global _lib, _tried, _error
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            if not cpu_supported():
                raise RuntimeError(f"the CPU lacks one of {', '.join(_REQUIRED_FLAGS)}")
            with open(SOURCE, "rb") as f:
                digest = hashlib.sha256(f.read() + " ".join(FLAGS).encode()).hexdigest()[:16]
            path = os.path.join(_cache_dir(), f"tallow_cpu_{digest}.so")
            if not os.path.exists(path):
                _build(path)
            loaded = ctypes.CDLL(path)
            if loaded.tl_abi_version() != ABI_VERSION:
                raise RuntimeError(f"{path}: ABI {loaded.tl_abi_version()}, expected {ABI_VERSION}")
            for name, (argtypes, restype) in _SIGNATURES.items():
                fn = getattr(loaded, name)
                fn.argtypes, fn.restype = argtypes, restype
            _lib = loaded
        except subprocess.CalledProcessError as e:
            _error = f"build failed: {e.stderr.strip()[:2000]}"
        except Exception as e:  # no compiler, unsupported CPU, load error: torch's kernels serve
            _error = f"{type(e).__name__}: {e}"
        if _error:
            log.warning("tallow CPU kernels unavailable (%s); using torch's kernels", _error)
        _tried = True
        return _lib


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
