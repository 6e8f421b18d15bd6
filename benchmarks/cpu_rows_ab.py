"""A/B the AVX2/AVX-512 block-quantized linear kernel of two source trees, per row count.

Builds tallow/ops/cpu of each tree (the variant named) into a temporary folder, loads both
into this process (torch's OpenMP runtime) and times tl_q4_linear / tl_q8_linear on random
tiles at the default model's shapes, alternating old and new call by call, round by round;
prints the median and the [p10, p90] spread in microseconds per call, and checks the two
builds' outputs are bit-identical and that each row equals the one-row call's result.

    python benchmarks/cpu_rows_ab.py --old /work/main --new . --rows 1 2 5 8 16 32
    python benchmarks/cpu_rows_ab.py --old OLD --new . --variant avx512 --amx --rows 16 20 24 40
    python benchmarks/cpu_rows_ab.py --old . --new . --variant avx2 --new-variant avxvnni   # two builds

--amx turns both builds' AMX tile kernel on (tl_amx_enable, in this process: only where the
tallow's own probe says tiles run; rows from 12 take the tiles).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import tree_kernels  # noqa: E402

SHAPES = {"gate_up": (3072, 576, 0), "down": (576, 1536, 0), "qkv": (960, 576, 0), "o": (576, 576, 0),
          "up1536": (1536, 576, 0), "kv192": (192, 576, 0), "lm_head_q8": (49152, 576, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--variant", default="avx2")
    ap.add_argument("--new-variant", default=None,
                    help="the new side's build, if not --variant (e.g. --old . --new . --variant avx2 "
                         "--new-variant avxvnni)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8, 16, 32])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=5, help="calls per timed sample")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--amx", action="store_true", help="both builds on AMX tiles (avx512 variant)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {tag: tree_kernels(tree, variant, tmp, tag, ["tl_q4_linear", "tl_q8_linear", "tl_tile_channels"]
                                + (["tl_amx_enable"] if args.amx else []))
                for tag, tree, variant in (("old", args.old, args.variant),
                                           ("new", args.new, args.new_variant or args.variant))}
        if args.amx:
            from tallow.ops import cpu_native

            if cpu_native.amx_state() != "on":
                raise SystemExit("AMX is not on here (tallow's probe)")
            for lib in libs.values():
                if not lib.tl_amx_enable():
                    raise SystemExit("tl_amx_enable failed")
        nt = libs["new"].tl_tile_channels()
        print(f"variant {args.variant}{' / new ' + args.new_variant if args.new_variant else ''}, NT {nt}, "
              f"threads {args.threads}")
        print(f"{'shape':>11} {'M':>3} {'old us':>18} {'new us':>18} {'new/old':>7}")
        for shape in args.shapes:
            n, k, q8 = SHAPES[shape]
            nb = k // 32
            wq = rng.integers(-127 if q8 else 0, 128 if q8 else 256, size=n * nb * (32 if q8 else 16)).astype(
                np.int8 if q8 else np.uint8)
            wd = (rng.standard_normal(n * nb) * 0.01).astype(np.float16).view(np.uint16)
            wm = (rng.standard_normal(n * nb) * 0.01).astype(np.float16).view(np.uint16)
            fn = {k_: getattr(v, "tl_q8_linear" if q8 else "tl_q4_linear") for k_, v in libs.items()}
            for m in args.rows:
                x = rng.standard_normal((m, k)).astype(np.float32)
                ys = {k_: np.empty((m, n), np.float32) for k_ in libs}

                def call(which: str) -> None:
                    rc = fn[which](x.ctypes.data, m, k, n, wq.ctypes.data, wd.ctypes.data,
                                   0 if q8 else wm.ctypes.data, None, ys[which].ctypes.data, args.threads)
                    assert rc == 0

                times = {k_: [] for k_ in libs}
                for _ in range(args.rounds):
                    for which in ("old", "new"):
                        call(which)
                        t0 = time.perf_counter()
                        for _ in range(args.reps):
                            call(which)
                        times[which].append((time.perf_counter() - t0) / args.reps * 1e6)
                same = np.array_equal(ys["old"].view(np.uint32), ys["new"].view(np.uint32))
                # each row alone (M = 1) in the new build: the same bits
                y1 = np.empty((1, n), np.float32)
                inv = True
                for r in range(m):
                    rc = fn["new"](x[r:r + 1].ctypes.data, 1, k, n, wq.ctypes.data, wd.ctypes.data,
                                   0 if q8 else wm.ctypes.data, None, y1.ctypes.data, args.threads)
                    inv &= rc == 0 and np.array_equal(y1[0].view(np.uint32), ys["new"][r].view(np.uint32))

                def fmt(ts: list[float]) -> str:
                    q = np.percentile(ts, [10, 90])
                    return f"{statistics.median(ts):7.0f} [{q[0]:.0f},{q[1]:.0f}]"

                ratio = statistics.median(times["new"]) / statistics.median(times["old"])
                flag = "" if same and inv else f"  MISMATCH same={same} invariant={inv}"
                print(f"{shape:>11} {m:>3} {fmt(times['old']):>18} {fmt(times['new']):>18} {ratio:7.2f}{flag}",
                      flush=True)


if __name__ == "__main__":
    main()
