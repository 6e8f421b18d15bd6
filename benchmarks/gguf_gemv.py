"""Batch-1 GEMV of tallow's GGUF block kernels against the machine's streaming-read bandwidth.

For each (format, shape) of a SmolLM2-1.7B-shaped Q4_K_M file, one GgufLinear / Q8Linear is made
from random blocks (tests/gguf_files.random_blocks) and timed at M rows; the figure is the file's
bytes read per second (raw GGUF block bytes / time) and its share of the bandwidth measured here by
summing a large float32 array with torch on the same threads (median of rounds, spread min-max).
Rounds alternate the candidates so a shared machine's load hits them alike.

    OMP_NUM_THREADS=2 python benchmarks/gguf_gemv.py
    OMP_NUM_THREADS=2 python benchmarks/gguf_gemv.py --m 1 4 --rounds 9
    OMP_NUM_THREADS=1 python benchmarks/gguf_gemv.py --base /work/main   # A/B: that tree's kernels vs these
    TALLOW_CPU_KERNELS=avxvnni python benchmarks/gguf_gemv.py --m 1 32 512 --base-variant avx2   # two builds

With --base, each layer also runs on the kernels built from BASE/tallow/ops/cpu (same variant),
alternating call samples, and the table gives base / this per shape (median and min-max of the
per-round ratios) and checks the two builds' outputs are bit-identical.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

# (name, format, out, in, uses per token) for SmolLM2-1.7B in Q4_K_M (ffn_down / attn_v: Q6_K in
# half the layers; the tied LM head Q6_K).
SHAPES = [
    ("q/k/v", "Q4_K", 2048, 2048, 24 * 3),
    ("o", "Q4_K", 2048, 2048, 24),
    ("gate/up", "Q4_K", 8192, 2048, 24 * 2),
    ("down", "Q6_K", 2048, 8192, 12),
    ("down", "Q4_K", 2048, 8192, 12),
    ("lm_head", "Q6_K", 49152, 2048, 1),
    ("q8_0", "Q8_0", 2048, 2048, 0),
    ("q5_k", "Q5_K", 2048, 2048, 0),
]
BYTES = {"Q4_K": 144 / 256, "Q5_K": 176 / 256, "Q6_K": 210 / 256, "Q8_0": 34 / 32}


def bandwidth(rounds: int) -> list[float]:
    a = torch.ones(256 << 20 >> 2)  # 256 MiB of float32, far past the caches
    a.sum()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        a.sum()
        out.append(a.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sample-ms", type=float, default=50.0)
    ap.add_argument("--base", help="a source tree whose kernels to compare against (A/B)")
    ap.add_argument("--base-variant", default=None,
                    help="the base's build, if not the one in use (its GGUF layout must be the same: "
                         "avx2 against avxvnni; --base defaults to this tree then)")
    ap.add_argument("--min", action="store_true", help="quote the best round (a loaded machine) instead of the median")
    args = ap.parse_args()
    from gguf_files import random_blocks

    from tallow.models import gguf_linear as gl

    torch.manual_seed(0)
    bw = bandwidth(args.rounds)
    print(f"threads {torch.get_num_threads()}  streaming read (torch sum, 256 MiB): median {statistics.median(bw):.1f} "
          f"GB/s (min {min(bw):.1f}, max {max(bw):.1f})")
    from gguf.constants import GGMLQuantizationType as T

    layers = []
    for name, fmt, n, k, uses in SHAPES:
        raw = random_blocks(fmt, n, k, np.random.default_rng(0))
        layers.append((name, fmt, n, k, uses, gl.linear_from_raw(raw, getattr(T, fmt), k)))
    base_fn = None
    if args.base_variant and not args.base:
        args.base = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if args.base:
        import copy
        import tempfile

        from benchmarks.common import tree_kernels
        from tallow.ops import cpu_native
        variant = args.base_variant or cpu_native.variant()
        base_lib = tree_kernels(args.base, variant, tempfile.mkdtemp(), "base", ["tl_gguf_linear", "tl_q8_linear"])
        base_fn, base_q8 = base_lib.tl_gguf_linear, base_lib.tl_q8_linear
        print(f"A/B against {args.base} ({variant} build)")
        ab = []
        for (name, fmt, n, k, uses, layer) in layers:
            other = copy.copy(layer)
            other._fn = base_q8 if fmt == "Q8_0" else base_fn
            ab.append(other)
    bwm = max(bw) if args.min else statistics.median(bw)
    use_min = args.min
    for m in args.m:
        x = torch.randn(m, 8192)
        times = {i: [] for i in range(len(layers))}
        btimes = {i: [] for i in range(len(layers))}

        def sample(layer, xi):
            layer(xi)
            reps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < args.sample_ms / 1e3:
                layer(xi)
                reps += 1
            return (time.perf_counter() - t0) / reps

        for r in range(args.rounds):
            for i, (_, _, n, k, _, layer) in enumerate(layers):
                xi = x[:, :k].contiguous()
                if base_fn is not None:
                    if r == 0 and not torch.equal(layer(xi), ab[i](xi)):
                        print(f"  !! {layers[i][1]} {layers[i][0]}: the two builds' outputs differ")
                    order = (0, 1) if r % 2 == 0 else (1, 0)
                    for o in order:
                        (times if o == 0 else btimes)[i].append(sample(layer if o == 0 else ab[i], xi))
                else:
                    times[i].append(sample(layer, xi))
        total = 0.0
        print(f"M={m}: format  shape  us/call (min-max)  GB/s  % of bandwidth  ms/token (x uses)")
        for i, (name, fmt, n, k, uses, _) in enumerate(layers):
            med = min(times[i]) if use_min else statistics.median(times[i])
            gbs = n * k * BYTES[fmt] / med / 1e9
            total += med * uses
            extra = ""
            if base_fn is not None:
                ratios = [b / t for b, t in zip(btimes[i], times[i])]
                bmed = min(btimes[i]) if use_min else statistics.median(btimes[i])
                extra = (f"  base {bmed*1e6:7.0f} us  speed-up x{statistics.median(ratios):.2f} "
                         f"({min(ratios):.2f}-{max(ratios):.2f})")
            print(f"  {fmt:5s} {name:8s} {n}x{k}  {med*1e6:8.0f} ({min(times[i])*1e6:.0f}-{max(times[i])*1e6:.0f})"
                  f"  {gbs:5.1f}  {100*gbs/bwm:4.0f}%  {med*uses*1e3:6.1f}{extra}")
        print(f"  sum of the linears per token (x uses): {total*1e3:.1f} ms")


if __name__ == "__main__":
    main()
