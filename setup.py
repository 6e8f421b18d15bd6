"""Compiles tallow's CPU kernels into the wheel (project metadata is in pyproject.toml).

`pip wheel .` / `pip install .` run build_py, which here also compiles tallow/ops/cpu/kernels.c
once per instruction set of tallow/ops/cpu_build.py (AVX-512 VNNI and AVX2, whatever this
machine's CPU runs: cpu_native picks one at run time) into tallow/ops/cpu/prebuilt/ of the build
tree. cpu_build.py is loaded by path: the isolated build environment has setuptools and wheel,
not torch. The wheel is tagged py3-none-<platform> (native code, no CPython extension). An
editable install (`pip install -e .`, `make install`) skips this: cpu_native builds the kernels
into ~/.cache/tallow/kernels on first use. Where the kernels cannot be compiled (no C compiler,
not x86-64) the wheel is built without them, pure, and says so; a compiler error fails the build.
"""

import importlib.util
import os
import shutil

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))


def _cpu_build():
    spec = importlib.util.spec_from_file_location("_tallow_cpu_build", os.path.join(HERE, "tallow", "ops", "cpu_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        cpu_build = _cpu_build()
        reason = cpu_build.cannot_build()
        if reason:
            self.warn(f"tallow CPU kernels not compiled into the wheel: {reason} (built on first use, "
                      "else torch's kernels serve)")
            return
        out_dir = os.path.join(self.build_lib, *cpu_build.PREBUILT_SUBDIR)
        shutil.rmtree(out_dir, ignore_errors=True)  # no stale build of other sources from an earlier run
        for variant in cpu_build.VARIANTS:
            out = os.path.join(out_dir, cpu_build.file_name(variant))
            self.announce(f"compiling tallow CPU kernels ({variant}) -> {out}", level=2)
            try:
                cpu_build.build(variant, out)
            except Exception as e:  # the compiler's own message, not just its exit status
                if variant in cpu_build.OPTIONAL:
                    self.warn(f"tallow CPU kernels ({variant}) not compiled into the wheel (the compiler "
                              f"lacks its instructions?): {getattr(e, 'stderr', '') or e}")
                    continue
                raise RuntimeError(f"compiling tallow's CPU kernels ({variant}) failed:\n"
                                   f"{getattr(e, 'stderr', '') or e}") from e


class DistributionWithKernels(Distribution):
    """Native code (the kernels): installed to platlib, the wheel platform-specific."""

    def has_ext_modules(self):
        return _cpu_build().cannot_build() is None


class PlatformWheel(bdist_wheel):
    """The wheel of the kernels: one platform, any CPython 3 (they are loaded through ctypes)."""

    def get_tag(self):
        python, abi, plat = super().get_tag()
        return (python, abi, plat) if self.root_is_pure else ("py3", "none", plat)


setup(distclass=DistributionWithKernels, cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": PlatformWheel})
