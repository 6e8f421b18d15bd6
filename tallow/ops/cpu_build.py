"""How tallow's CPU kernels (tallow/ops/cpu/kernels.c) are compiled: the sources, the flags of
each instruction-set build, the file name that carries a digest of both, and the compiler call.

Standard library only: setup.py loads this file by path (torch is not in the isolated build
environment) to compile every build into the wheel, and cpu_native uses it for the first-use
build of an editable install. Each build is compiled with -fopenmp but linked without the
OpenMP runtime: the shared object names no libgomp (nothing for auditwheel to vendor under a
renamed copy), and its GOMP_* / omp_* symbols bind at load time to the runtime torch already
loaded, so the kernels' threads are torch's pool (cpu_native checks this when it loads them).
"""

from __future__ import annotations

import glob
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

CPU_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu")
# Where a wheel carries the builds made at install, relative to the package root.
PREBUILT_SUBDIR = ("tallow", "ops", "cpu", "prebuilt")
PREBUILT_DIR = os.path.join(CPU_DIR, "prebuilt")
COMPILE_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-std=c11"]
LINK_FLAGS = ["-shared"]  # no -fopenmp here: that would add DT_NEEDED libgomp.so.1
LIBS = ["-lm"]
# instruction set -> (compiler flags, the /proc/cpuinfo flags it needs), best first
VARIANTS = {
    "avx512": (["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
               ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni")),
    # AVX2's code with AVX-VNNI's one-instruction multiply-adds (kernels.c: TL_VNNI256): Intel's
    # client cores from Alder Lake, AMD's Zen 5 where AVX-512 is off. gcc 11+ / clang 12+.
    "avxvnni": (["-mavx2", "-mfma", "-mf16c", "-mavxvnni"], ("avx2", "fma", "f16c", "avx_vnni")),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], ("avx2", "fma", "f16c")),
}
# Builds a compiler may be too old for: a wheel goes without them (their CPUs run the next
# variant), and a first-use build that fails falls back the same way (cpu_native.select).
OPTIONAL = ("avxvnni",)
# Builds for the tests only, never served nor shipped: "avxvnni-evex" is the avxvnni build's code
# with the EVEX encodings of the same instructions, so that CPUs with AVX-512 VNNI but no AVX-VNNI
# (AMD Zen 4, Intel Xeons before Sapphire Rapids) check its arithmetic (tests/test_cpu_avxvnni.py).
CHECK_VARIANTS = {
    "avxvnni-evex": (["-mavx2", "-mfma", "-mf16c", "-DTL_VNNI256_EVEX"],
                     ("avx2", "fma", "f16c", "avx512_vnni", "avx512vl")),
}


def flags(variant: str) -> list[str]:
    """The compiler flags of a build (VARIANTS or CHECK_VARIANTS)."""
    return (VARIANTS.get(variant) or CHECK_VARIANTS[variant])[0]


def needs(variant: str) -> tuple[str, ...]:
    """The /proc/cpuinfo flags a build (VARIANTS or CHECK_VARIANTS) needs."""
    return (VARIANTS.get(variant) or CHECK_VARIANTS[variant])[1]


def sources(cpu_dir: str = CPU_DIR) -> list[str]:
    """The kernels' source files: kernels.c (the one translation unit) and every header beside it."""
    return [os.path.join(cpu_dir, "kernels.c"), *sorted(glob.glob(os.path.join(cpu_dir, "*.h")))]


def commands(variant: str, obj: str, out: str, cc: str = "cc", cpu_dir: str = CPU_DIR) -> list[list[str]]:
    """The compile and link commands of one build."""
    return [[cc, *COMPILE_FLAGS, *flags(variant), "-c", "-o", obj, os.path.join(cpu_dir, "kernels.c")],
            [cc, *LINK_FLAGS, "-o", out, obj, *LIBS]]


NAME = "tallow_cpu_{variant}_{digest}.so"  # a build's file name (file_name; digest "*": every build of a variant)


def file_name(variant: str, cpu_dir: str = CPU_DIR) -> str:
    """The shared object's name: the variant and a digest of the sources and the commands, so a
    build of other sources or flags (a stale prebuilt or cached file) is never picked up."""
    digest = hashlib.sha256()
    for path in sources(cpu_dir):
        digest.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
    for command in commands(variant, "OBJ", "OUT", cc="CC", cpu_dir="DIR"):
        digest.update(" ".join(command).encode() + b"\n")
    return NAME.format(variant=variant, digest=digest.hexdigest()[:16])


def compiler() -> str | None:
    """The C compiler on PATH (gcc, else cc), or None."""
    return shutil.which("gcc") or shutil.which("cc")


def cannot_build() -> str | None:
    """Why the kernels cannot be compiled here (None when they can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernels are x86-64 code (this machine is {platform.machine()})"
    if compiler() is None:
        return "no C compiler (gcc or cc) on PATH"
    return None


def build(variant: str, out: str, cpu_dir: str = CPU_DIR) -> None:
    """Compile one build into `out` (atomically: concurrent builders leave one complete file).
    Raises RuntimeError without a compiler, subprocess.CalledProcessError (with the compiler's
    output in .stderr) when compiling fails."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    directory = os.path.dirname(os.path.abspath(out))
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
        obj, lib = os.path.join(tmp, "kernels.o"), os.path.join(tmp, "kernels.so")
        for command in commands(variant, obj, lib, cc=cc, cpu_dir=cpu_dir):
            subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(lib, out)
