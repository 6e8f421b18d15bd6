"""How fast this CPU reads memory in the two patterns a many-sequence decode step reads it:
one long sequential stream (a layer's weights) and short runs at scattered offsets (the paged
KV cache: a 16-token block of the default model's K or V rows is 16 x 3 heads x 64 x 2 bytes =
6 KB, the blocks of a sequence anywhere in the pool), each with and without software prefetch
of the next run's lines (the attention's drip: `--prefetch` lines to L2 per line read).

A C loop (compiled here with the system's C compiler, run on 1 and on all threads through
OpenMP) reads a 1 GB buffer; runs go in a random order over the buffer, each thread its share.
Prints GB/s per pattern and thread count, and writes JSON.

    python benchmarks/cpu_memory_runs.py
    python benchmarks/cpu_memory_runs.py --run-bytes 6144 3456 --prefetch 0 1 2
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.common import table, write_json  # noqa: E402

_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
// Reads n runs of len bytes (len % 64 == 0) at buf + off[i], each thread a contiguous share of
// the n, summing them (so the loads are not dropped). pf > 0: while reading a run, the thread
// prefetches the lines of its next run (never further) to L2, pf lines per line read (the
// first run's at once).
long read_runs(const char *buf, const long *off, long n, long len, int pf, int threads) {
    long total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const int me = omp_get_thread_num(), team = omp_get_num_threads();
        const long lo = n * me / team, hi = n * (me + 1) / team;
        __m256i acc = _mm256_setzero_si256();
        long prun = lo + 1, pline = 0;  // the next line to prefetch
        if (pf && lo < hi)
            for (long i = 0; i < len; i += 64) _mm_prefetch(buf + off[lo] + i, _MM_HINT_T1);
        for (long r = lo; r < hi; r++) {
            const char *p = buf + off[r];
            for (long i = 0; i < len; i += 64) {
                for (int k = 0; k < pf && prun < hi && prun <= r + 1; k++) {
                    _mm_prefetch(buf + off[prun] + pline, _MM_HINT_T1);
                    if ((pline += 64) >= len) pline = 0, prun++;
                }
                acc = _mm256_add_epi64(acc, _mm256_loadu_si256((const __m256i *)(p + i)));
                acc = _mm256_add_epi64(acc, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
            }
        }
        total += _mm256_extract_epi64(acc, 0) + _mm256_extract_epi64(acc, 3);
    }
    return total;
}
"""


def build(folder: str) -> ctypes.CDLL:
    from tallow.ops import cpu_build

    cc = cpu_build.compiler()
    if cc is None:
        raise SystemExit(f"cpu_memory_runs.py compiles its loop: {cpu_build.cannot_build()}")
    src, lib = os.path.join(folder, "runs.c"), os.path.join(folder, "runs.so")
    with open(src, "w") as f:
        f.write(_SOURCE)
    subprocess.run([cc, "-O2", "-fopenmp", "-fPIC", "-shared", "-mavx2", src, "-o", lib], check=True)
    kernel = ctypes.CDLL(lib)
    kernel.read_runs.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int,
                                 ctypes.c_int]
    kernel.read_runs.restype = ctypes.c_long
    return kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--buffer-mb", type=int, default=1024)
    ap.add_argument("--run-bytes", type=int, nargs="+", default=[6144])
    ap.add_argument("--prefetch", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    buf = np.ones(args.buffer_mb << 20, dtype=np.uint8)  # written: every page backed
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        kernel = build(folder)
        patterns = [("stream", 1 << 20, False)] + [(f"runs of {b}", b, True) for b in args.run_bytes]
        rows, results = [], []
        for name, run, scattered in patterns:
            n = buf.size // run
            offs = np.arange(n, dtype=np.int64) * run
            if scattered:
                rng.shuffle(offs)
            for pf in (args.prefetch if scattered else [0]):
                for threads in args.threads:
                    kernel.read_runs(buf.ctypes.data, offs.ctypes.data, n, run, pf, threads)  # warm
                    rates = []
                    for _ in range(args.rounds):
                        t0 = time.perf_counter()
                        kernel.read_runs(buf.ctypes.data, offs.ctypes.data, n, run, pf, threads)
                        rates.append(n * run / (time.perf_counter() - t0) / 1e9)
                    med = statistics.median(rates)
                    rows.append({"pattern": name, "prefetch": pf, "threads": threads, "GB/s": round(med, 1),
                                 "range": f"{min(rates):.1f}-{max(rates):.1f}"})
                    results.append({"pattern": name, "run_bytes": run, "prefetch_lines": pf, "threads": threads,
                                    "gb_s_median": med, "gb_s": rates})
        print(table(rows, ["pattern", "prefetch", "threads", "GB/s", "range"]))
        write_json(args.out, {"results": results})


if __name__ == "__main__":
    main()
