"""The CPU's int16 multiply-add ceiling, and the engine's many-sequence decode as a share of it,
measured alternately in one run (the real-models issue's target: 32-sequence decode of the
default model at >= 60% of this machine's measured int16 ceiling).

The ceiling: a C loop of 12 independent chains of the widest int16 multiply-add the CPU has
(`vpdpwssd` on 512 bits where it lists avx512_vnni: 32 products an instruction; on 256 bits
where it lists avx_vnni: 16; else AVX2's `vpmaddwd` + `vpaddd`: 16), compiled here with the
system's C compiler and run on every thread at once (OpenMP), as BENCHMARKS.md's Zen 4 section
measured it. The decode: `--batch`
sequences of `--prompt-len` random tokens, `--new-tokens` greedy tokens each, through the
engine (decode_latency.py's loop); its multiply-adds a token are the model's linear layers
(LM head included) plus attention's q.k and p.v at the run's mean context.

    python benchmarks/cpu_ceiling.py --rounds 3
    python benchmarks/cpu_ceiling.py --ceiling-only
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402

_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
// n iterations of 12 independent int16 multiply-add chains on each of `threads` threads (in
// registers: the loop over them unrolled); returns a checksum, so the loop is not dropped.
long chains(long n, int threads) {
    long total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
#if defined(__AVX512VNNI__)
        __m512i acc[12], a = _mm512_set1_epi16(3 + omp_get_thread_num()), b = _mm512_set1_epi16(5);
        for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_epi32(i);
        for (long k = 0; k < n; k++)
#pragma GCC unroll 12
            for (int i = 0; i < 12; i++) acc[i] = _mm512_dpwssd_epi32(acc[i], a, b);
        for (int i = 0; i < 12; i++) total += _mm512_reduce_add_epi32(acc[i]);
#else
        __m256i acc[12], a = _mm256_set1_epi16(3 + omp_get_thread_num()), b = _mm256_set1_epi16(5);
        for (int i = 0; i < 12; i++) acc[i] = _mm256_set1_epi32(i);
        for (long k = 0; k < n; k++)
#pragma GCC unroll 12
#if defined(__AVXVNNI__)
            for (int i = 0; i < 12; i++) acc[i] = _mm256_dpwssd_avx_epi32(acc[i], a, b);
#else
            for (int i = 0; i < 12; i++) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(a, b));
#endif
        for (int i = 0; i < 12; i++) total += _mm256_extract_epi32(acc[i], 0);
#endif
    }
    return total;
}
#if defined(__AVX512VNNI__)
int madds(void) { return 32; }
const char *instruction(void) { return "vpdpwssd (512 bits)"; }
#elif defined(__AVXVNNI__)
int madds(void) { return 16; }
const char *instruction(void) { return "vpdpwssd (AVX-VNNI, 256 bits)"; }
#else
int madds(void) { return 16; }
const char *instruction(void) { return "vpmaddwd + vpaddd (256 bits)"; }
#endif
"""


def build_ceiling_kernel(folder: str) -> ctypes.CDLL:
    """The chains loop, compiled for the widest int16 multiply-add this CPU lists."""
    from tallow.ops import cpu_build, cpu_native

    cc = cpu_build.compiler()
    if cc is None:
        raise SystemExit(f"cpu_ceiling.py compiles its loop: {cpu_build.cannot_build()}")
    flags = cpu_native.cpu_flags()
    isa = (["-mavx512f", "-mavx512bw", "-mavx512vnni"] if {"avx512f", "avx512_vnni"} <= flags
           else ["-mavx2", "-mavxvnni"] if "avx_vnni" in flags else ["-mavx2"])
    src, lib = os.path.join(folder, "ceiling.c"), os.path.join(folder, "ceiling.so")
    with open(src, "w") as f:
        f.write(_SOURCE)
    subprocess.run([cc, "-O2", "-fopenmp", "-fPIC", "-shared", *isa, src, "-o", lib], check=True)
    kernel = ctypes.CDLL(lib)
    kernel.chains.argtypes, kernel.chains.restype = [ctypes.c_long, ctypes.c_int], ctypes.c_long
    kernel.instruction.restype = ctypes.c_char_p
    return kernel


def ceiling_gmacs(kernel: ctypes.CDLL, threads: int, seconds: float = 0.5) -> float:
    """Multiply-adds per second (G) of the chains loop on `threads` threads, over ~`seconds`."""
    n = 1 << 16
    kernel.chains(n, threads)  # warm: threads started, clocks up
    while True:
        t0 = time.perf_counter()
        kernel.chains(n, threads)
        dt = time.perf_counter() - t0
        if dt >= seconds / 4:
            break
        n *= 4
    reps = max(1, round(seconds / dt))
    t0 = time.perf_counter()
    for _ in range(reps):
        kernel.chains(n, threads)
    dt = (time.perf_counter() - t0) / reps
    return n * 12 * kernel.madds() * threads / dt / 1e9


def decode_macs_per_token(cfg, context: float) -> float:
    """Multiply-adds of one decode token: every linear layer (LM head included) and attention's
    q.k and p.v over `context` keys."""
    q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer = (cfg.hidden_size * (q_dim + 2 * kv_dim) + q_dim * cfg.hidden_size
             + 3 * cfg.hidden_size * cfg.intermediate_size)
    attention = 2 * cfg.num_attention_heads * cfg.head_dim * context
    return cfg.num_hidden_layers * (layer + attention) + cfg.hidden_size * cfg.vocab_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="ceiling / decode pairs, alternated")
    ap.add_argument("--ceiling-only", action="store_true")
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"],
                    help="one engine per KV cache dtype (auto, int8, ...), each timed in every round, alternated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from benchmarks.decode_latency import run_tallow
    from benchmarks.offline_throughput import make_core

    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        kernel = build_ceiling_kernel(tmp)
        cores = {}
        if not args.ceiling_only:
            for kv in args.kv_cache_dtypes:
                cores[kv] = make_core(model=args.model, device="cpu", max_num_seqs=args.batch,
                                      enable_prefix_caching=False, max_model_len=args.prompt_len + args.new_tokens + 16,
                                      kv_cache_dtype=kv)
            core = next(iter(cores.values()))
            rng = random.Random(0)
            vocab = min(core.model_config.vocab_size, 10000)
            prompts = [[rng.randint(10, vocab - 1) for _ in range(args.prompt_len)] for _ in range(args.batch)]
            for c in cores.values():
                run_tallow(c, prompts, 8)  # warm-up: the KV pool's pages touched once
            macs = decode_macs_per_token(core.model_config, args.prompt_len + args.new_tokens / 2)
        rows = []
        for r in range(args.rounds):
            row = {"round": r + 1, "ceiling_gmacs": ceiling_gmacs(kernel, threads)}
            for kv in (list(cores) if r % 2 == 0 else list(cores)[::-1]):
                _, rate = run_tallow(cores[kv], prompts, args.new_tokens)
                tag = "" if len(cores) == 1 else f"_{kv}"
                row.update({f"decode_tok_s{tag}": rate, f"decode_gmacs{tag}": rate * macs / 1e9,
                            f"of_ceiling{tag}": rate * macs / 1e9 / row["ceiling_gmacs"]})
            rows.append(row)
            print(table([row], list(row)), flush=True)
    summary = {"ceiling_gmacs_median": statistics.median(r["ceiling_gmacs"] for r in rows)}
    for kv in cores:
        tag = "" if len(cores) == 1 else f"_{kv}"
        summary.update({f"decode_tok_s_median{tag}": statistics.median(r[f"decode_tok_s{tag}"] for r in rows),
                        f"of_ceiling_median{tag}": statistics.median(r[f"of_ceiling{tag}"] for r in rows)})
    if cores:
        summary.update(macs_per_token=macs, tok_s_at_60_percent=0.6 * summary["ceiling_gmacs_median"] * 1e9 / macs)
    print(f"\n{kernel.instruction().decode()} on {threads} threads; " +
          ", ".join(f"{k} {v:.4g}" for k, v in summary.items()))
    write_json(args.out, {"benchmark": "cpu_ceiling", "instruction": kernel.instruction().decode(),
                          "threads": threads, "batch": args.batch, "prompt_len": args.prompt_len,
                          "kv_cache_dtypes": args.kv_cache_dtypes,
                          "new_tokens": args.new_tokens, "rounds": rows, "summary": summary})


if __name__ == "__main__":
    main()
