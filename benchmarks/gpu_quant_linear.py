"""Time tallow's Triton GGUF quant kernels (tallow/ops/triton_quant.py) on Llama-3-8B's shapes.

For each format and shape: random valid GGUF blocks made on the device (no files), repacked into
planes; the kernels are first checked against a float32 matmul with the weight dequantized in
torch (itself checked against gguf.quants.dequantize on a few rows); then timed (median of
triton.testing.do_bench, L2 flushed between runs) next to bf16 cuBLAS
(torch.nn.functional.linear on the dequantized bf16 weight):

- GEMV at M=1 and M=8 (decode): achieved GB/s = bytes of the quantized planes / time, against
  the H200's ~4,150 GB/s (--peak-gbs);
- GEMM at M=512 (prefill): TFLOP/s, and the time against cuBLAS.

    python benchmarks/gpu_quant_linear.py --out gpu_quant_linear.json
    python benchmarks/gpu_quant_linear.py --formats Q4_K,Q6_K --sweep --out sweep.json

Exits 1 when an output is wrong or a kernel fails (the table still prints), 2 without CUDA.
--budget-s stops starting new formats past that many seconds (default 200). Without gguf
installed the check of the torch dequantize against gguf's is skipped (said in the output).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import write_json  # noqa: E402

# name -> (out_features N, in_features K); Llama-3-8B.
SHAPES = {
    "q_o": (4096, 4096),
    "k_v": (1024, 4096),
    "gate_up": (14336, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
# The bulk of a Q4_K_M file first (Q4_K, Q6_K), then Q8_0 and the rest.
ORDER = ["Q4_K", "Q6_K", "Q8_0", "Q5_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
GEMV_ROWS = (1, 8)
GEMM_ROWS = 512
GEMV_TOL, GEMM_TOL = 1e-2, 2e-2  # max |error| / max |reference|, bf16 activations and outputs
DEVICE = "cuda"


def log(msg: str) -> None:
    print(msg, flush=True)


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def check_layout(w, raw: torch.Tensor, fmt: str) -> float | None:
    """The torch dequantize of the planes against gguf's own on the first rows (CPU); None
    where gguf is not installed (tests/test_triton_quant.py checks the same on the CPU)."""
    try:
        import gguf
    except ImportError:
        return None
    from tallow.ops.triton_quant_layout import dequantize, repack

    rows = raw[:8].cpu()
    want = torch.from_numpy(gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType[fmt]))
    got = dequantize(repack(raw[:8], fmt, w.K)).cpu()
    return (got - want).abs().max().item()


def run_shape(fmt: str, name: str, N: int, K: int, args, failures: list) -> dict:
    from tallow.ops.triton_quant import quant_gemm, quant_gemv
    from tallow.ops.triton_quant_layout import dequantize, random_blocks, repack

    row = {"format": fmt, "shape": name, "N": N, "K": K}
    raw = random_blocks(fmt, N, K, device=DEVICE)
    w = repack(raw, fmt, K)
    row["weight_bytes"] = w.nbytes()
    row["file_bytes"] = raw.numel()
    err = check_layout(w, raw, fmt)
    row["layout_vs_gguf"] = err
    del raw
    if err is not None and err != 0.0:
        failures.append(f"{fmt} {name}: torch dequantize differs from gguf's by {err}")
    w_f32 = dequantize(w)
    w_bf16 = w_f32.to(torch.bfloat16)
    x_all = torch.randn(GEMM_ROWS, K, device=DEVICE, dtype=torch.bfloat16)
    ref_all = x_all.float() @ w_f32.T
    del w_f32
    torch.cuda.empty_cache()

    def check(label, y, ref, tol):
        e = rel_err(y, ref)
        row[f"{label}_rel_err"] = e
        if not (e <= tol):
            failures.append(f"{fmt} {name} {label}: max error {e:.3g} of the largest output > {tol}")

    for M in GEMV_ROWS:
        x = x_all[:M]
        check(f"gemv{M}", quant_gemv(x, w), ref_all[:M], GEMV_TOL)
        t = bench_ms(lambda: quant_gemv(x, w))
        tc = bench_ms(lambda: F.linear(x, w_bf16))
        row[f"gemv{M}_us"] = t * 1e3
        row[f"gemv{M}_gbs"] = w.nbytes() / (t * 1e-3) / 1e9
        row[f"cublas{M}_us"] = tc * 1e3
    # The GEMM at M=8 too (one 16-row tile): is it a better decode path than the GEMV at 8?
    x = x_all[:8]
    check("gemm8", quant_gemm(x, w, block_m=16), ref_all[:8], GEMM_TOL)
    row["gemm8_us"] = bench_ms(lambda: quant_gemm(x, w, block_m=16)) * 1e3
    check(f"gemm{GEMM_ROWS}", quant_gemm(x_all, w), ref_all, GEMM_TOL)
    t = bench_ms(lambda: quant_gemm(x_all, w))
    tc = bench_ms(lambda: F.linear(x_all, w_bf16))
    row[f"gemm{GEMM_ROWS}_us"] = t * 1e3
    row[f"gemm{GEMM_ROWS}_tflops"] = 2 * GEMM_ROWS * N * K / (t * 1e-3) / 1e12
    row[f"cublas{GEMM_ROWS}_us"] = tc * 1e3
    if args.sweep:
        row["sweep"] = sweep(w, x_all)
    del w, w_bf16, x_all, ref_all
    torch.cuda.empty_cache()
    return row


def sweep(w, x_all) -> dict:
    """Time a few kernel configurations (for tuning the defaults): GEMV at M=1, GEMM at M=512."""
    from tallow.ops.triton_quant import quant_gemm, quant_gemv

    out = {"gemv1": {}, "gemm": {}}
    x = x_all[:1]
    for block_n in (8, 16, 32, 64):
        for warps in (2, 4, 8):
            key = f"bn{block_n}_w{warps}"
            try:
                out["gemv1"][key] = bench_ms(lambda: quant_gemv(x, w, block_n=block_n, num_warps=warps)) * 1e3
            except Exception as e:  # a configuration that does not compile or fit
                out["gemv1"][key] = repr(e)[:200]
    for bm, bn, warps, stages in ((128, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 8, 2),
                                  (64, 64, 4, 4), (128, 32, 4, 3)):
        key = f"bm{bm}_bn{bn}_w{warps}_s{stages}"
        try:
            out["gemm"][key] = bench_ms(lambda: quant_gemm(x_all, w, block_m=bm, block_n=bn, num_warps=warps,
                                                           num_stages=stages)) * 1e3
        except Exception as e:
            out["gemm"][key] = repr(e)[:200]
    best1 = min((v, k) for k, v in out["gemv1"].items() if isinstance(v, float))
    bestg = min((v, k) for k, v in out["gemm"].items() if isinstance(v, float))
    log(f"    sweep: best GEMV M=1 {best1[1]} {best1[0]:.1f} us; best GEMM {bestg[1]} {bestg[0]:.1f} us")
    return out


def table(rows: list[dict], peak: float) -> str:
    head = (f"{'format':6} {'shape':8} {'N x K':>13} {'MB':>7} | {'gemv1 us':>9} {'GB/s':>6} {'%peak':>5} "
            f"{'cuBLAS1':>8} | {'gemv8 us':>9} {'GB/s':>6} {'gemm8':>8} {'cuBLAS8':>8} | {'gemm512':>9} {'TFLOP/s':>7} "
            f"{'cuBLAS':>8} {'x':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['format']:6} {r['shape']:8} {r['N']:>6}x{r['K']:<6} ERROR {r['error']}")
            continue
        g = GEMM_ROWS
        lines.append(
            f"{r['format']:6} {r['shape']:8} {r['N']:>6}x{r['K']:<6} {r['weight_bytes'] / 1e6:7.1f} | "
            f"{r['gemv1_us']:9.1f} {r['gemv1_gbs']:6.0f} {100 * r['gemv1_gbs'] / peak:5.0f} {r['cublas1_us']:8.1f} | "
            f"{r['gemv8_us']:9.1f} {r['gemv8_gbs']:6.0f} {r['gemm8_us']:8.1f} {r['cublas8_us']:8.1f} | "
            f"{r[f'gemm{g}_us']:9.1f} {r[f'gemm{g}_tflops']:7.0f} {r[f'cublas{g}_us']:8.1f} "
            f"{r[f'gemm{g}_us'] / r[f'cublas{g}_us']:5.2f}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default=",".join(ORDER), help="comma-separated GGUF formats, in order")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shape names: " + ", ".join(SHAPES))
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--peak-gbs", type=float, default=4150.0, help="the GPU's memory bandwidth, GB/s")
    p.add_argument("--budget-s", type=float, default=200.0, help="start no new format after this many seconds")
    p.add_argument("--sweep", action="store_true", help="also time a few kernel configurations per shape")
    args = p.parse_args()
    if not torch.cuda.is_available():
        log("gpu_quant_linear: CUDA is not available (this benchmark runs on an NVIDIA GPU)")
        return 2
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    from tallow.ops.triton_quant_layout import FORMATS

    bad = [f for f in formats if f not in FORMATS] + [s for s in shapes if s not in SHAPES]
    if bad:
        log(f"gpu_quant_linear: unknown format or shape: {', '.join(bad)}")
        return 2
    torch.manual_seed(0)
    try:
        import gguf  # noqa: F401
    except ImportError:
        log("gguf is not installed: the planes' torch dequantize is not re-checked against gguf's here")
    log(f"gpu_quant_linear on {torch.cuda.get_device_name(0)}: formats {formats}, shapes {shapes}")
    start = time.perf_counter()
    rows, failures, skipped = [], [], []
    for fmt in formats:
        if time.perf_counter() - start > args.budget_s:
            skipped.append(fmt)
            continue
        for name in shapes:
            N, K = SHAPES[name]
            t0 = time.perf_counter()
            try:
                row = run_shape(fmt, name, N, K, args, failures)
                log(f"  {fmt} {name} {N}x{K}: gemv1 {row['gemv1_us']:.1f} us ({row['gemv1_gbs']:.0f} GB/s) "
                    f"cuBLAS {row['cublas1_us']:.1f}; gemv8 {row['gemv8_us']:.1f}; gemm{GEMM_ROWS} "
                    f"{row[f'gemm{GEMM_ROWS}_us']:.1f} us vs cuBLAS {row[f'cublas{GEMM_ROWS}_us']:.1f} "
                    f"[{time.perf_counter() - t0:.1f} s, {time.perf_counter() - start:.0f} s total]")
            except Exception as e:
                traceback.print_exc()
                row = {"format": fmt, "shape": name, "N": N, "K": K, "error": f"{type(e).__name__}: {e}"[:300]}
                failures.append(f"{fmt} {name}: {row['error']}")
                log(f"  {fmt} {name}: FAILED {row['error']}")
                torch.cuda.empty_cache()
            rows.append(row)
    log("")
    log(table(rows, args.peak_gbs))
    if skipped:
        log(f"\nnot run (past --budget-s {args.budget_s:.0f}): {', '.join(skipped)}")
    write_json(args.out, {"benchmark": "gpu_quant_linear", "peak_gbs": args.peak_gbs, "rows": rows,
                          "failures": failures, "skipped_formats": skipped})
    if args.out:
        log(f"wrote {args.out}")
    if failures:
        log(f"\n{len(failures)} FAILURE(S):")
        for f in failures:
            log(f"  {f}")
        return 1
    log(f"\nall outputs correct ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
