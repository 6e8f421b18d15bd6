"""tallow's own CPU kernels (tallow/ops/cpu/kernels.c), loaded through ctypes.

The source compiles for one of three instruction sets, the best this CPU has: "avx512" (AVX-512
with VNNI: the linear layers' tiles of 16 channels multiplied by vpdpwssd), "avx2" (AVX2, FMA,
F16C: the same tiles, 8 channels to a register, the same floats) or "avxvnni" (avx2's code with
AVX-VNNI's one-instruction multiply-adds: the same floats again); TALLOW_CPU_KERNELS (read in
tallow/config.py) picks one, or "none" for torch's kernels. How they compile is tallow/ops/cpu_build.py. Where they come from,
in order: the builds a wheel made at install (tallow/ops/cpu/prebuilt/, named by a digest of the
sources and flags, so a stale one is never used), the cache of first-use builds
(~/.cache/tallow/kernels: editable installs, built with the system C compiler), else none:
`lib()` returns None, the start-up log says the slow torch path is in use, and the model runs
on torch's kernels (the quantization schemes "int4-torch" and "int8-torch" ask for those
directly).

The shared objects name no OpenMP library: their GOMP_* / omp_* symbols bind, when loaded, to
the runtime torch itself loaded, so the kernels' threads are torch's intra-op pool, not a second
one competing for the cores. `load()` checks that before and after loading and raises
OpenMPRuntimeConflict where another runtime would take the kernels' calls (fail loudly rather
than run slowly).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os
import subprocess
import sys
import threading

import torch

from tallow.config import _default_cache_dir, cpu_amx_allowed, cpu_kernels_variant
from tallow.ops import cpu_build

log = logging.getLogger(__name__)

VARIANTS = cpu_build.VARIANTS
ABI_VERSION = 14
# The OpenMP entry points gcc's code calls: the kernels must find torch's definitions of them.
OPENMP_SYMBOLS = ("GOMP_parallel", "GOMP_barrier", "omp_get_thread_num", "omp_get_num_threads")

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
    "tl_gelu_tanh_and_mul": ([_p, _i, _i, _p, _i], None),
    "tl_head_rms_norm": ([_p, _i, _i, _i, _l, _p, _f, _i], None),
    "tl_rotary": ([_p, _i, _i, _i, _l, _p, _p, _i], None),
    "tl_kv_write": ([_p, _l, _p, _l, _i, _i, _i, _p, _p, _p, _i], None),
    "tl_paged_attention": ([_p, _l, _p, _l, _p, _p, _p, _p, _p, _l, _i, _i, _i, _i, _i, _f, _i, _i, _i], _i),
    "tl_llama_layer": ([_p, _p, _p, _p, _p, _p, _i, _i], _i),
    "tl_tile_channels": ([], _i),
    "tl_gguf_linear": ([_p, _i, _i, _i, _i, _p, _p, _p, _p, _p, _p, _p, _i], _i),
    "tl_gguf_tile_channels": ([], _i),
    "tl_gguf_plane_layout": ([], _i),
    "tl_gguf_repack": ([_i, _p, _i, _i, _i, _p, _p, _p, _p, _p, _i], _i),
    "tl_half_linear": ([_p, _i, _i, _i, _p, _i, _p, _p, _i], _i),
    "tl_amx_enable": ([], _i),
    "tl_amx_set": ([_i], _i),
    "tl_rows_max": ([_p, _l, _l, _l, _p, _p, _i], None),
}


class OpenMPRuntimeConflict(RuntimeError):
    """The kernels would not share torch's OpenMP runtime (two thread pools fighting over the
    cores): raised, not logged, so the server does not start slow."""


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
    return [name for name in VARIANTS if runs(name)]


def runs(variant: str) -> bool:
    """Whether this CPU runs a build of VARIANTS or cpu_build.CHECK_VARIANTS (the tests' builds)."""
    return all(flag in cpu_flags() for flag in cpu_build.needs(variant))


def cpu_supported() -> bool:
    return bool(supported_variants())


def _cache_dir() -> str:
    return os.path.join(_default_cache_dir(), "kernels")


KEEP_BUILDS = 8  # cached builds of each variant kept (each change of the sources makes a new one)


def library_path(variant: str) -> str:
    """The shared object of one build for the sources here: the one a wheel carries if it
    matches them, else the first-use build in the cache (compiled now if missing; raises
    RuntimeError where there is no compiler). A cached build is marked used (its mtime); a new
    one prunes the variant's builds to the KEEP_BUILDS used last."""
    name = cpu_build.file_name(variant)
    prebuilt = os.path.join(cpu_build.PREBUILT_DIR, name)
    if os.path.exists(prebuilt):
        return prebuilt
    cached = os.path.join(_cache_dir(), name)
    if os.path.exists(cached):
        try:
            os.utime(cached)
        except OSError:  # a read-only cache still serves
            pass
        return cached
    if cpu_build.compiler() is None:
        raise RuntimeError(f"no build of the kernels in the package ({cpu_build.PREBUILT_DIR}) and "
                           "no C compiler (gcc or cc) on PATH to build them")
    cpu_build.build(variant, cached)
    prune_builds(variant, keep=cached)
    return cached


def prune_builds(variant: str, keep: str) -> None:
    """Delete the variant's cached builds beyond the KEEP_BUILDS used last (never `keep`). (A
    process that has one loaded keeps its mapping.)"""
    builds = sorted(glob.glob(os.path.join(_cache_dir(), cpu_build.NAME.format(variant=variant, digest="*"))),
                    key=os.path.getmtime, reverse=True)
    for path in builds[KEEP_BUILDS:]:
        if path != keep:
            try:
                os.remove(path)
            except OSError:
                pass


# ---- one OpenMP runtime ---------------------------------------------------------------------------

class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _address(handle: ctypes.CDLL, symbol: str) -> int | None:
    """dlsym(handle, symbol) as an address (None where the handle's scope lacks it)."""
    try:
        return ctypes.cast(getattr(handle, symbol), ctypes.c_void_p).value
    except AttributeError:
        return None


def _file_of(address: int) -> str:
    """The loaded file that holds an address (dladdr)."""
    libc = ctypes.CDLL(None)
    libc.dladdr.argtypes, libc.dladdr.restype = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)], ctypes.c_int
    info = _DlInfo()
    return os.fsdecode(info.dli_fname) if libc.dladdr(address, ctypes.byref(info)) and info.dli_fname else "?"


@functools.cache
def torch_openmp_runtime() -> str:
    """The file of the OpenMP runtime torch's own code calls, made global (RTLD_GLOBAL) so the
    kernels' undefined GOMP_* / omp_* symbols bind to it whatever its file is called (a wheel's
    renamed libgomp-<hash>.so.1 too). Raises RuntimeError where torch loaded none."""
    torch_c = ctypes.CDLL(torch._C.__file__, mode=os.RTLD_NOLOAD)  # dlsym searches its dependencies
    address = _address(torch_c, "omp_get_num_threads")
    if address is None:
        raise RuntimeError("torch loaded no OpenMP runtime")
    path = _file_of(address)
    ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
    return path


def check_one_openmp_runtime(kernels: ctypes.CDLL | None = None) -> None:
    """Raise OpenMPRuntimeConflict unless each OpenMP symbol the kernels call resolves to torch's
    runtime: in the process's global scope, where a shared object naming no OpenMP library
    binds them, and, given loaded kernels, in their own dependencies too (a build that named
    some libgomp binds there first)."""
    runtime = torch_openmp_runtime()
    torch_c = ctypes.CDLL(torch._C.__file__, mode=os.RTLD_NOLOAD)
    scopes = [("the global scope", ctypes.CDLL(None))]
    if kernels is not None:
        scopes.append((f"the dependencies of {kernels._name}", kernels))
    for symbol in OPENMP_SYMBOLS:
        want = _address(torch_c, symbol)
        for where, handle in scopes:
            got = _address(handle, symbol)
            if got == want or (got is None and handle is kernels):
                continue
            found = f"finds {symbol} in {_file_of(got)}" if got is not None else f"lacks {symbol}"
            raise OpenMPRuntimeConflict(
                f"tallow's CPU kernels would not share torch's OpenMP runtime ({runtime}): {where} {found}; "
                "two thread pools would compete for the cores. Load no other OpenMP runtime globally "
                "before torch, or set TALLOW_CPU_KERNELS=none to run torch's kernels")


def load(variant: str) -> ctypes.CDLL:
    """The kernels built for one instruction set of VARIANTS (built at install or on first use);
    raises where this CPU or machine cannot run or build them, OpenMPRuntimeConflict where they
    would not share torch's OpenMP runtime."""
    with _lock:
        if variant in _loaded:
            return _loaded[variant]
        if variant not in VARIANTS and variant not in cpu_build.CHECK_VARIANTS:
            raise RuntimeError(f"unknown kernel variant {variant!r}; one of {', '.join(VARIANTS)}, none")
        if not runs(variant):
            raise RuntimeError(f"the CPU lacks one of {', '.join(cpu_build.needs(variant))}")
        path = library_path(variant)
        check_one_openmp_runtime()  # before: a conflicting runtime would take the kernels' calls
        loaded = ctypes.CDLL(path)
        check_one_openmp_runtime(loaded)
        if loaded.tl_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path}: ABI {loaded.tl_abi_version()}, expected {ABI_VERSION}")
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(loaded, name)
            fn.argtypes, fn.restype = argtypes, restype
        if variant == "avx512":
            _enable_amx(loaded)
        _loaded[variant] = loaded
        return loaded


# ---- AMX tiles ------------------------------------------------------------------------------------

AMX_FLAGS = ("amx_tile", "amx_int8")
_amx: str = "off: not probed"  # what amx_state() reports


# The probe's child: a fresh interpreter that maps the kernels lazily (their OpenMP symbols
# unresolved: tl_amx_enable calls none) and exits 0 only if the tile products were right.
_PROBE = ("import ctypes, os, sys; "
          "sys.exit(0 if ctypes.CDLL(sys.argv[1], mode=os.RTLD_LAZY).tl_amx_enable() == 1 else 1)")


def _tile_probe_survives(path: str) -> bool:
    """Whether a child process lives through the kernels' tl_amx_enable (a tile product checked
    against integer sums): some CPUs list amx_int8 and die of SIGILL on the first tile
    instruction. A new process rather than a fork: this one may have threads."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, path], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _enable_amx(kernels: ctypes.CDLL) -> None:
    """Turns the AVX-512 build's AMX kernel on where $TALLOW_AMX allows it, the CPU lists the
    tile flags and a child process has run a tile product correctly."""
    global _amx
    kernels.tl_amx_set(0)  # off unless enabled below (a library loaded again keeps its state)
    if not cpu_amx_allowed():
        _amx = "off: TALLOW_AMX=0"
    elif not all(flag in cpu_flags() for flag in AMX_FLAGS):
        _amx = "off: the CPU lists no amx_tile / amx_int8"
    elif not _tile_probe_survives(kernels._name):
        _amx = "off: the CPU lists AMX but a tile product failed in a child process"
        log.warning("AMX: the CPU lists amx_int8 but a tile instruction failed in a probe; AMX stays off")
    elif kernels.tl_amx_enable() != 1:
        _amx = "off: the kernel refused the tile state"
    else:
        _amx = "on"


def amx_state() -> str:
    """Whether the AVX-512 build's linear kernels (Q4/Q8 and the GGUF formats) run many rows on
    AMX tiles ("on"), else "off: <why>"."""
    lib()
    return _amx


def kernels_in_use() -> str:
    """A few words on the CPU kernels lib() hands out, for the start-up log: "avx512, AMX on",
    "avx2", or "none: torch's kernels"."""
    name = variant()
    if name is None:
        return "none: torch's kernels"
    return f"{name}, AMX {amx_state()}" if name == "avx512" else name


def lib() -> ctypes.CDLL | None:
    """The loaded kernels of the instruction set `config.cpu_kernels_variant()` names, by default
    the best one here; None where they cannot be built or loaded, or with "none" (the reason is
    logged once: the slow torch path is in use). OpenMPRuntimeConflict is raised, not logged."""
    return _lib if _tried else select(cpu_kernels_variant())


def select(wanted: str | None) -> ctypes.CDLL | None:
    """lib() for a given choice: a key of VARIANTS, "none", or None for the best this CPU runs;
    the first call decides what lib() hands out from then on."""
    global _lib, _tried, _error
    if _tried:
        return _lib
    if wanted == "none":
        _error = "TALLOW_CPU_KERNELS=none"
    else:
        # the one asked for, else the best this CPU runs; an optional build that fails (a
        # compiler too old for its instructions) gives way to the next
        for candidate in [wanted] if wanted else supported_variants() or [None]:
            try:
                if candidate is None:
                    raise RuntimeError(f"the CPU lacks one of {', '.join(cpu_build.needs('avx2'))}")
                _lib, _error = load(candidate), None
                break
            except OpenMPRuntimeConflict:
                raise
            except subprocess.CalledProcessError as e:
                _error = f"build failed: {e.stderr.strip()[:2000]}"
            except Exception as e:  # no build and no compiler, unsupported CPU, load error: torch's kernels serve
                _error = f"{type(e).__name__}: {e}"
            if wanted or candidate not in cpu_build.OPTIONAL:
                break
            log.warning("tallow CPU kernels (%s) unavailable (%s): trying the next build", candidate, _error)
    if _error:
        log.warning("tallow CPU kernels unavailable (%s): the slow torch path is in use", _error)
    _tried = True
    return _lib


def variant() -> str | None:
    """The instruction set of the kernels lib() hands out (a key of VARIANTS), or None."""
    kernels = lib()
    return next((name for name, loaded in _loaded.items() if loaded is kernels), None) if kernels else None


def tile_channels(kernels: ctypes.CDLL | None = None) -> int:
    """Output channels per weight tile of these kernels (default: lib()'s): 16 in every build."""
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


def rows_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x.max(dim=-1) of a float32 [N, V] tensor with contiguous rows: (values, int64 indices)."""
    N, V = x.shape
    values, indices = x.new_empty(N), torch.empty(N, dtype=torch.int64)
    lib().tl_rows_max(x.data_ptr(), N, V, x.stride(0), values.data_ptr(), indices.data_ptr(), torch.get_num_threads())
    return values, indices


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    T, I2 = x.shape
    out = x.new_empty(T, I2 // 2)
    lib().tl_silu_and_mul(x.data_ptr(), T, I2 // 2, out.data_ptr(), torch.get_num_threads())
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    T, I2 = x.shape
    out = x.new_empty(T, I2 // 2)
    lib().tl_gelu_tanh_and_mul(x.data_ptr(), T, I2 // 2, out.data_ptr(), torch.get_num_threads())
    return out


def head_rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """RMSNorm of each head of x [T, heads, head_dim] (heads contiguous, rows at any stride), in place."""
    T, heads, D = x.shape
    assert x.stride(2) == 1 and x.stride(1) == D and weight.is_contiguous() and weight.shape == (D,)
    lib().tl_head_rms_norm(x.data_ptr(), T, heads, D, x.stride(0), weight.data_ptr(), eps, torch.get_num_threads())


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
    if lib() is None:
        return f"tallow CPU kernels unavailable: {_error}"
    return f"tallow CPU kernels: {lib()._name} ({kernels_in_use()})"
