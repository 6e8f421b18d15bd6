"""Shared bits of the benchmark scripts: machine description, JSON output, tables."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time


def machine() -> dict:
    info = {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
        info["threads"] = torch.get_num_threads()
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                elif line.startswith(("cpu family", "model\t")):
                    info[line.split(":")[0].strip().replace(" ", "_")] = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    break
    except OSError:
        pass
    try:
        from tallow.ops import cpu_native

        info["cpu_kernels"] = cpu_native.variant()  # the build tallow's CPU kernels run (avx512, avx2)
    except ImportError:
        pass
    return info


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def write_json(path: str | None, payload: dict) -> None:
    payload = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "commit": commit(),
               "machine": machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **payload}
    text = json.dumps(payload, indent=2)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")
    return text


def table(rows: list[dict], cols: list[str]) -> str:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    head = "  ".join(c.rjust(widths[c]) for c in cols)
    lines = [head, "  ".join("-" * widths[c] for c in cols)]
    for r in rows:
        lines.append("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in cols))
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return "" if v is None else str(v)


def tree_kernels(tree: str, variant: str, out_dir: str, tag: str, names: list[str]):
    """The CPU kernels of another source tree (its tallow/ops/cpu) built as `variant` into
    out_dir/tag.so and loaded into this process (bound to torch's OpenMP runtime), with the named
    functions' signatures from this tree's cpu_native: for A/B runs of two trees' kernels."""
    import ctypes

    from tallow.ops import cpu_build, cpu_native

    out = os.path.join(out_dir, f"{tag}.so")
    cpu_build.build(variant, out, cpu_dir=os.path.join(tree, "tallow", "ops", "cpu"))
    cpu_native.torch_openmp_runtime()
    lib = ctypes.CDLL(out)
    for name in names:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = cpu_native._SIGNATURES[name]
    return lib
