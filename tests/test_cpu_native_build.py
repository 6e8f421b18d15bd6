"""Where tallow's CPU kernels come from (tallow/ops/cpu_native.py, tallow/ops/cpu_build.py): the
builds a wheel carries, used only when their digest matches the sources; the first-use build
into the cache; the torch path, said at start-up, when there is neither; TALLOW_CPU_KERNELS read
through tallow/config.py; one OpenMP runtime shared with torch, a second one ahead of it refused
loudly. The slow tier builds the wheel with `pip wheel .` and runs it in a fresh venv with no
compiler on PATH."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile

import pytest
import torch

from tallow import config
from tallow.ops import cpu_build, cpu_native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILT = cpu_native.lib()._name if cpu_native.lib() is not None else None  # as this checkout runs them
VARIANT = cpu_native.variant()
needs_kernels = pytest.mark.skipif(BUILT is None,
                                   reason=f"no CPU kernels: {cpu_native.unavailable_reason()}")
needs_compiler = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """cpu_native as in a new process, with an empty package prebuilt dir and an empty cache."""
    prebuilt, cache = tmp_path / "prebuilt", tmp_path / "cache"
    prebuilt.mkdir()
    monkeypatch.setattr(cpu_build, "PREBUILT_DIR", str(prebuilt))
    monkeypatch.setenv("TALLOW_CACHE_DIR", str(cache))
    monkeypatch.delenv("TALLOW_CPU_KERNELS", raising=False)
    for name, value in (("_lib", None), ("_tried", False), ("_error", None), ("_loaded", {}),
                        ("_amx", "off: not probed")):
        monkeypatch.setattr(cpu_native, name, value)
    return prebuilt, cache / "kernels"


def test_build_names_carry_a_digest_of_every_source_and_the_flags(tmp_path):
    copy = tmp_path / "cpu"
    shutil.copytree(cpu_build.CPU_DIR, copy, ignore=shutil.ignore_patterns("prebuilt"))
    names = {v: cpu_build.file_name(v) for v in cpu_build.VARIANTS}
    assert {v: cpu_build.file_name(v, cpu_dir=str(copy)) for v in cpu_build.VARIANTS} == names  # same sources
    assert len(set(names.values())) == len(names)  # each build's flags in its name
    with open(copy / "linear_avx2.h", "a") as f:
        f.write("\n/* changed */\n")
    changed = cpu_build.file_name("avx2", cpu_dir=str(copy))
    (copy / "new_block_format.h").write_text("/* a header added beside the others */\n")
    added = cpu_build.file_name("avx2", cpu_dir=str(copy))
    assert len({names["avx2"], changed, added}) == 3


def test_the_build_recipe_is_torch_free_and_the_wheel_builds_without_torch():
    """setup.py loads cpu_build.py by path in pip's isolated build environment: only setuptools
    and wheel there (a bare torch would pull a CUDA build into it)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    assert not any(r.lower().startswith("torch") for r in requires), requires
    code = ("import importlib.util, sys; "
            "spec = importlib.util.spec_from_file_location('recipe', 'tallow/ops/cpu_build.py'); "
            "recipe = importlib.util.module_from_spec(spec); spec.loader.exec_module(recipe); "
            "assert 'torch' not in sys.modules and 'tallow' not in sys.modules; print(recipe.file_name('avx2'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == cpu_build.file_name("avx2")  # as setup.py loads it


@needs_kernels
def test_a_prebuilt_build_is_used_only_when_its_digest_matches(fresh, monkeypatch):
    prebuilt, cache = fresh
    built = BUILT
    stale = prebuilt / f"tallow_cpu_{VARIANT}_0123456789abcdef.so"  # a build of other sources
    shutil.copy(built, stale)
    monkeypatch.setattr(cpu_build, "compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no build of the kernels in the package .* no C compiler"):
        cpu_native.load(VARIANT)
    assert VARIANT not in cpu_native._loaded
    matching = prebuilt / cpu_build.file_name(VARIANT)
    shutil.copy(built, matching)
    assert cpu_native.load(VARIANT)._name == str(matching)
    assert not cache.exists()  # nothing built


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
@needs_kernels
@needs_compiler
def test_without_a_prebuilt_build_the_kernels_build_into_the_cache_on_first_use(fresh):
    prebuilt, cache = fresh
    kernels = cpu_native.select(VARIANT)
    assert kernels._name == str(cache / cpu_build.file_name(VARIANT))
    assert cpu_native.report() == f"tallow CPU kernels: {kernels._name} ({cpu_native.kernels_in_use()})"
    assert sorted(os.listdir(cache)) == [cpu_build.file_name(VARIANT)]  # no temporary left behind
    assert kernels.tl_abi_version() == cpu_native.ABI_VERSION


def test_a_new_build_prunes_the_variants_builds_used_least_lately(fresh, monkeypatch):
    """Each change of the sources makes a new cached build: a new one deletes the variant's
    builds beyond the KEEP_BUILDS used last (a load marks one used); other variants and files stay."""
    prebuilt, cache = fresh
    cache.mkdir(parents=True)
    monkeypatch.setattr(cpu_native, "KEEP_BUILDS", 3)
    monkeypatch.setattr(cpu_build, "compiler", lambda: "cc")
    monkeypatch.setattr(cpu_build, "build", lambda variant, out, **kw: open(out, "wb").close())  # (no compile)
    old = [cache / f"tallow_cpu_{VARIANT}_{i:016x}.so" for i in range(5)]
    for age, path in enumerate(old):  # old[0] the newest, old[4] the oldest
        path.write_bytes(b"")
        os.utime(path, (1e9 - age * 1000, 1e9 - age * 1000))
    other = cache / "tallow_cpu_other_0000000000000000.so"
    other.write_bytes(b"")
    os.utime(other, (1.0, 1.0))
    os.utime(old[3], None)  # used just now: kept over older-used ones
    built = cpu_native.library_path(VARIANT)
    assert os.path.exists(built)
    left = set(os.listdir(cache))
    assert left == {os.path.basename(built), old[3].name, old[0].name, other.name}
    before = os.path.getmtime(old[0])
    os.utime(built, (1.0, 1.0))
    assert cpu_native.library_path(VARIANT) == built and os.path.getmtime(built) > before  # a load marks it used


def test_neither_a_build_nor_a_compiler_logs_the_slow_torch_path(fresh, monkeypatch, caplog):
    monkeypatch.setattr(cpu_build, "compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert cpu_native.lib() is None
    assert cpu_native.variant() is None and cpu_native.lib() is None
    [line] = [r.getMessage() for r in caplog.records]
    assert "the slow torch path is in use" in line
    if cpu_native.supported_variants():
        assert "no C compiler" in line, line
    assert cpu_native.report().startswith("tallow CPU kernels unavailable: ")
    assert cpu_native.kernels_in_use() == "none: torch's kernels"  # what the engine's start-up line says
    assert not cpu_native.usable(torch.zeros(2, 8))  # the ops take torch's path


def test_tallow_cpu_kernels_is_read_in_config_and_passed_in(fresh, monkeypatch, caplog):
    monkeypatch.setenv("TALLOW_CPU_KERNELS", "none")
    assert config.cpu_kernels_variant() == "none"
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert cpu_native.lib() is None
    assert "TALLOW_CPU_KERNELS=none" in caplog.text and "slow torch path" in caplog.text
    monkeypatch.delenv("TALLOW_CPU_KERNELS")
    assert config.cpu_kernels_variant() is None
    with open(cpu_native.__file__) as f:
        assert "environ" not in f.read()  # config.py is the one reader


@needs_kernels
def test_tallow_cpu_kernels_picks_the_build(fresh, monkeypatch):
    monkeypatch.setenv("TALLOW_CPU_KERNELS", VARIANT)
    assert cpu_native.lib() is cpu_native.load(VARIANT) and cpu_native.variant() == VARIANT
    assert cpu_native.tile_channels() == 16  # one weight layout for both builds
    # the engine's start-up line: the build, and for AVX-512 whether the tiles are on and why not
    assert cpu_native.kernels_in_use() == (f"avx512, AMX {cpu_native.amx_state()}" if VARIANT == "avx512" else VARIANT)
    if VARIANT != "avx512":
        return
    was_on = cpu_native.amx_state() == "on"
    monkeypatch.setenv("TALLOW_AMX", "0")
    for name, value in (("_lib", None), ("_tried", False), ("_error", None), ("_loaded", {})):
        monkeypatch.setattr(cpu_native, name, value)
    kernels = cpu_native.lib()
    try:
        assert cpu_native.kernels_in_use() == "avx512, AMX off: TALLOW_AMX=0"
        assert kernels.tl_amx_set(0) == 0  # and the library's own switch is off too
    finally:
        kernels.tl_amx_set(int(was_on))  # the same library (dlopen hands the loaded one back)


@needs_kernels
def test_the_kernels_name_no_openmp_library_and_bind_torchs():
    """Nothing in the kernels' own dependencies defines an OpenMP symbol (no libgomp for
    auditwheel to vendor under a new name); the process's global scope resolves each to the
    runtime torch's code calls."""
    kernels = cpu_native.lib()
    torch_c = cpu_native.ctypes.CDLL(torch._C.__file__, mode=os.RTLD_NOLOAD)
    for symbol in cpu_native.OPENMP_SYMBOLS:
        assert cpu_native._address(kernels, symbol) is None
        assert cpu_native._address(cpu_native.ctypes.CDLL(None), symbol) == cpu_native._address(torch_c, symbol)
    assert os.path.realpath(cpu_native.torch_openmp_runtime()).startswith(os.path.realpath(
        os.path.dirname(torch.__file__))) or "gomp" in os.path.basename(cpu_native.torch_openmp_runtime())
    cpu_native.check_one_openmp_runtime(kernels)  # passes


STUB_OPENMP = """
void GOMP_parallel(void (*fn)(void *), void *data, unsigned n, unsigned flags) { fn(data); }
void GOMP_barrier(void) {}
int omp_get_thread_num(void) { return 0; }
int omp_get_num_threads(void) { return 1; }
"""


@needs_kernels
@needs_compiler
@pytest.mark.parametrize("scope", ["global", "local"])
def test_a_second_openmp_runtime_ahead_of_torchs_fails_loudly(scope, tmp_path):
    """Another runtime loaded globally before torch would take the kernels' OpenMP calls: lib()
    raises (each time) instead of running on a second thread pool. One loaded locally, as an
    extension module's vendored libgomp is (sentencepiece's), is no conflict."""
    (tmp_path / "stub.c").write_text(STUB_OPENMP)
    stub = tmp_path / "libstubomp.so"
    subprocess.run([cpu_build.compiler(), "-shared", "-fPIC", "-o", str(stub), str(tmp_path / "stub.c")], check=True)
    code = textwrap.dedent(f"""
        import ctypes, os
        ctypes.CDLL({str(stub)!r}, mode=os.RTLD_{scope.upper()})
        from tallow.ops import cpu_native
        for attempt in range(2):
            try:
                kernels = cpu_native.lib()
            except cpu_native.OpenMPRuntimeConflict as e:
                print("conflict:", e)
            else:
                print("loaded:", kernels._name)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    assert len(lines) == 2, out
    if scope == "global":
        assert all(line.startswith("conflict:") and str(stub) in line and "GOMP_parallel" in line
                   and "TALLOW_CPU_KERNELS=none" in line for line in lines), out
    else:
        assert all(line.startswith("loaded:") for line in lines), out


# ---- the wheel ----------------------------------------------------------------------------------

FRESH_VENV_CHECK = """
import json, shutil, sys
import torch
from tallow.ops import cpu_build, cpu_native
kernels = cpu_native.lib()
torch.manual_seed(0)
x = torch.randn(5, 64)
ref = torch.nn.functional.silu(x[:, :32]) * x[:, 32:]
# beyond assert_close's rtol=1e-6 (the fast tier's bound): products of up to ~10 carry ~1e-6 of rounding
err = ((cpu_native.silu_and_mul(x) - ref).abs() - 1e-6 * ref.abs()).max().item()
maps = sorted({l.split()[-1] for l in open("/proc/self/maps") if "gomp" in l or "omp5" in l})
print(json.dumps({"compiler": cpu_build.compiler(), "report": cpu_native.report(), "variant": cpu_native.variant(),
                  "in_use": cpu_native.kernels_in_use(),
                  "path": kernels._name, "err": err, "openmp": maps, "prefix": sys.prefix}))
"""


@pytest.mark.slow
@needs_kernels
def test_pip_wheel_carries_the_kernels_and_a_fresh_venv_without_a_compiler_uses_them(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "prebuilt", "benchmarks"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w", str(tmp_path / "dist")],
                   cwd=src, env=env, check=True, capture_output=True, text=True)
    [wheel] = os.listdir(tmp_path / "dist")
    assert wheel.startswith("tallow-") and wheel.endswith("-py3-none-linux_x86_64.whl"), wheel
    with zipfile.ZipFile(tmp_path / "dist" / wheel) as z:
        shipped = sorted(n for n in z.namelist() if n.endswith(".so"))
    assert shipped == sorted(f"tallow/ops/cpu/prebuilt/{cpu_build.file_name(v)}" for v in cpu_build.VARIANTS)

    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], check=True, env=env)
    python = venv / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(tmp_path / "dist" / wheel)],
                   check=True, env=env)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # tallow's dependencies (torch, ...) from this environment, after the venv's own tallow
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(os.path.dirname(os.path.dirname(torch.__file__)) + "\n")
    cache = tmp_path / "cache"
    for variant in cpu_native.supported_variants():
        run_env = {"HOME": str(tmp_path), "PATH": str(venv / "bin"), "TALLOW_CACHE_DIR": str(cache),
                   "TALLOW_CPU_KERNELS": variant}
        out = subprocess.run([python, "-c", FRESH_VENV_CHECK], capture_output=True, text=True, env=run_env,
                             cwd=tmp_path, check=True).stdout
        got = __import__("json").loads(out.strip().splitlines()[-1])
        assert got["compiler"] is None and got["variant"] == variant
        assert got["path"] == os.path.join(site, "tallow", "ops", "cpu", "prebuilt", cpu_build.file_name(variant))
        assert got["report"] == f"tallow CPU kernels: {got['path']} ({got['in_use']})"
        assert got["in_use"] == variant or got["in_use"].startswith("avx512, AMX ")
        assert got["err"] <= 1e-6
        assert len(got["openmp"]) == 1, got["openmp"]  # torch's runtime, no second one
    assert not cache.exists()  # nothing was built at run time
