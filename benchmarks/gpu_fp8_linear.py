"""Time tallow's FP8 linear kernels (tallow/ops/triton_fp8.py) on Llama-3-8B's shapes.

For each projection shape (q/k/v fused 6144x4096, o 4096x4096, gate/up fused 28672x4096,
down 4096x14336) and each number of rows M: a random bf16 weight quantized per channel, every
path checked against a float32 matmul with the dequantized weight, then timed (median of
triton.testing.do_bench, L2 flushed between runs):

- bf16 cuBLAS (F.linear on the bf16 weight) and, at M=1, tallow's bf16 Triton GEMV;
- fp8_gemv (M=1; GB/s = weight bytes / time against --peak-gbs);
- fp8_gemv_old (M=1): the stop 30 default (Triton's e4m3 conversions, block_k 2048), and
  fp8_gemv_cvt1024 (the conversions at block_k 1024), for comparison with fp8_gemv;
- weight-only fp8_gemm (bf16 activations, weights widened in registers, bf16 MMA) and
  fp8_gemm_swap (the weight as the MMA's left operand; block_k 128 and 256);
- W8A8: quantize_rows + fp8_gemm (fp8 MMA), and quantize_rows + torch._scaled_mm (cuBLASLt).

--sweep-gemv times fp8_gemv's tile settings at M=1 on every shape (the best is the default to
set in Fp8Linear.gemv_config / fp8_gemv).

    python benchmarks/gpu_fp8_linear.py --out gpu_fp8_linear.json
    python benchmarks/gpu_fp8_linear.py --m 1 --sweep-gemv

Exits 1 when an output is wrong or a kernel fails (the table still prints), 2 without CUDA.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def bench_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def run_shape(name: str, N: int, K: int, ms: list[int], peak_gbs: float, failures: list) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from tallow.ops.triton_fp8 import fp8_gemm, fp8_gemm_swap, fp8_gemv, quantize_per_channel, quantize_rows, scaled_mm
    from tallow.ops.triton_gemv import triton_gemv

    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16()
    q, s = quantize_per_channel(w)
    wd = (q.float() * s[:, None]).bfloat16()
    rows = []
    for M in ms:
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        ref = x.float() @ (q.float() * s[:, None]).T
        paths = {"bf16_cublas": (lambda: F.linear(x, wd), 2e-2)}
        if M == 1:
            paths["bf16_triton_gemv"] = (lambda: triton_gemv(x, wd), 2e-2)
            paths["fp8_gemv"] = (lambda: fp8_gemv(x, q, s), 1e-2)
            # stop 30's default (Triton's e4m3 conversions, block_k 2048), for comparison
            paths["fp8_gemv_old"] = (lambda: fp8_gemv(x, q, s, fastcvt=False, block_k=2048), 1e-2)
            paths["fp8_gemv_cvt1024"] = (lambda: fp8_gemv(x, q, s, fastcvt=False, block_k=1024), 1e-2)
        paths["fp8_weight_only"] = (lambda: fp8_gemm(x, q, s), 2e-2)
        paths["fp8_swap"] = (lambda: fp8_gemm_swap(x, q, s), 2e-2)
        paths["fp8_swap_k256"] = (lambda: fp8_gemm_swap(x, q, s, block_k=256), 2e-2)
        def w8a8(x=x):
            xq, xs = quantize_rows(x)
            return fp8_gemm(xq, q, s, x_scale=xs, out_dtype=torch.bfloat16)

        paths["fp8_w8a8_triton"] = (w8a8, 6e-2)
        paths["fp8_w8a8_scaled_mm"] = (lambda: scaled_mm(x, q, s, torch.bfloat16), 6e-2)
        paths["quantize_rows_only"] = (None, None)
        row = {"shape": name, "N": N, "K": K, "M": M}
        for label, (fn, tol) in paths.items():
            try:
                if fn is None:
                    row["quantize_rows_us"] = 1000 * bench_ms(lambda: quantize_rows(x))
                    continue
                y = fn()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                if err > tol:
                    failures.append(f"{name} M={M} {label}: relative error {err:.2e} > {tol}")
                t = bench_ms(fn)
                row[f"{label}_us"] = 1000 * t
                if label == "fp8_gemv":
                    row["fp8_gemv_gbs"] = N * K / (t * 1e-3) / 1e9
                    row["fp8_gemv_of_peak"] = row["fp8_gemv_gbs"] / peak_gbs
            except Exception as e:  # a kernel that fails to compile or run: reported, the rest go on
                failures.append(f"{name} M={M} {label}: {type(e).__name__}: {e}")
                traceback.print_exc()
        fp8 = [row[k] for k in ("fp8_gemv_us", "fp8_weight_only_us", "fp8_swap_us", "fp8_swap_k256_us",
                                "fp8_w8a8_triton_us", "fp8_w8a8_scaled_mm_us") if k in row]
        if fp8 and "bf16_cublas_us" in row:
            best_bf16 = min(row[k] for k in ("bf16_cublas_us", "bf16_triton_gemv_us") if k in row)
            row["best_fp8_speedup"] = best_bf16 / min(fp8)
        rows.append(row)
        print(table([row], list(row)), flush=True)
    return rows


def sweep_gemv(peak_gbs: float) -> list[dict]:
    import torch

    from tallow.ops.triton_fp8 import fp8_gemv, quantize_per_channel

    rows = []
    for name, (N, K) in SHAPES.items():
        q, s = quantize_per_channel(torch.randn(N, K, device="cuda") * 0.02)
        x = torch.randn(1, K, device="cuda").bfloat16()
        for block_n in (2, 4, 8, 16):
            for block_k in (512, 1024, 2048, 4096):
                for warps in (2, 4, 8):
                    if block_n * block_k // (32 * warps) > 256:  # too many registers a thread
                        continue
                    try:
                        t = bench_ms(lambda: fp8_gemv(x, q, s, block_n=block_n, block_k=block_k, num_warps=warps))
                    except Exception as e:
                        print(f"{name} {block_n}x{block_k}/{warps}: {e}")
                        continue
                    rows.append({"shape": name, "block_n": block_n, "block_k": block_k, "warps": warps,
                                 "us": 1000 * t, "gbs": N * K / (t * 1e-3) / 1e9})
        best = min((r for r in rows if r["shape"] == name), key=lambda r: r["us"])
        print(f"best for {name}: {best}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 8, 16, 32, 64, 128, 512, 2048])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--peak-gbs", type=float, default=4150.0)
    ap.add_argument("--sweep-gemv", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    failures: list[str] = []
    rows = []
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        rows += run_shape(name, N, K, args.m, args.peak_gbs, failures)
    print()
    print(table(rows, list(dict.fromkeys(c for r in rows for c in r))))
    result = {"benchmark": "gpu_fp8_linear", "device": torch.cuda.get_device_name(), "results": rows,
              "failures": failures}
    if args.sweep_gemv:
        result["gemv_sweep"] = sweep_gemv(args.peak_gbs)
    write_json(args.out, result)
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
