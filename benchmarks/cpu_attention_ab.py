"""A/B the CPU paged attention kernel (tl_paged_attention) of two source trees on a prefill chunk.

Builds tallow/ops/cpu of each tree (the variant named) into a temporary folder, loads both into
this process and times one layer's attention for a prompt chunk of --chunk tokens that ends at
--context tokens (the default model's heads: 9 query heads, 3 KV heads of 64; a float16 or
float32 paged cache of 16-token blocks in shuffled order), alternating old and new call by call.
Prints the median and [min, max] seconds per call, the rate in GFLOP/s (4 * D flops per query
head and context key: q.k and p.v, the causal half only) and whether the two outputs are
bit-identical.

    python benchmarks/cpu_attention_ab.py --old /work/wt/base --new . --context 4096 7500

--new-dtype gives the new side a cache of another dtype (the same tree twice compares two cache
formats, e.g. `--old . --new . --dtype float16 --new-dtype int8`; the outputs then differ by the
int8 rounding). An int8 cache holds random codes and per-32 scales (cpu_backend's layout).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import tree_kernels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--variant", default="avx2")
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 7500])
    ap.add_argument("--chunk", type=int, default=2048, help="query tokens of each sequence (a prefill chunk; 1: decode)")
    ap.add_argument("--seqs", type=int, default=1, help="sequences in the batch, each with its own blocks")
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("H", "KV", "D"))
    ap.add_argument("--window", type=int, default=0)
    ap.add_argument("--dtype", choices=["float16", "float32", "int8"], default="float16")
    ap.add_argument("--new-dtype", choices=["float16", "float32", "int8"], default=None,
                    help="the new side's cache dtype (default: --dtype)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=1,
                    help="layers with caches of their own, run in turn per timed call (a decode step's KV "
                         "traffic, not one layer's from cache); times are per layer")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    H, KV, D = args.heads
    bs = 16
    with tempfile.TemporaryDirectory() as tmp:
        libs = {tag: tree_kernels(tree, args.variant, tmp, tag, ["tl_paged_attention"])
                for tag, tree in (("old", args.old), ("new", args.new))}
        print(f"variant {args.variant}, threads {args.threads}, heads {H}/{KV}x{D}, {args.dtype} cache")
        for ctx in args.context:
            T = min(args.chunk, ctx)
            g = torch.Generator().manual_seed(ctx)
            S = args.seqs
            per_seq = (ctx + bs - 1) // bs
            nblocks = per_seq * S
            dtypes = {"old": args.dtype, "new": args.new_dtype or args.dtype}

            def cache(name: str) -> torch.Tensor:
                if name != "int8":
                    return torch.randn(nblocks + 1, bs, KV, D, generator=g).to(getattr(torch, name))
                codes = torch.randint(-127, 128, (nblocks + 1, bs, KV, D), generator=g, dtype=torch.int8)
                scales = (torch.rand(nblocks + 1, bs, KV, D // 32, generator=g) * 0.02 + 0.005).float()
                return torch.cat((codes, scales.view(torch.int8)), -1).contiguous()

            made = {d: [(cache(d), cache(d)) for _ in range(args.layers)] for d in set(dtypes.values())}
            caches = {tag: made[dtypes[tag]] for tag in libs}  # one dtype: both sides read the same caches
            formats = {"float32": 0, "float16": 1, "int8": 2}
            table = (torch.randperm(nblocks, generator=g).to(torch.int32) + 1).view(S, per_seq).contiguous()
            q = torch.randn(S * T, H, D, generator=g)
            qsl = torch.arange(0, S * T + 1, T, dtype=torch.int32)
            sl = torch.full((S,), ctx, dtype=torch.int32)
            outs = {k: torch.empty(S * T, H, D) for k in libs}
            flops = 4.0 * D * H * S * sum(ctx - T + 1 + t for t in range(T))
            times = {k: [] for k in libs}
            for r in range(args.rounds):
                for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    t0 = time.perf_counter()
                    for kc, vc in caches[name]:
                        rc = libs[name].tl_paged_attention(q.data_ptr(), H * D, outs[name].data_ptr(), H * D,
                                                           kc.data_ptr(), vc.data_ptr(), qsl.data_ptr(),
                                                           sl.data_ptr(), table.data_ptr(), table.stride(0), S, H,
                                                           KV, D, bs, D ** -0.5, formats[dtypes[name]],
                                                           args.window, args.threads)
                        assert rc == 0
                    times[name].append((time.perf_counter() - t0) / args.layers)
            same = torch.equal(outs["old"], outs["new"])
            diff = (outs["old"] - outs["new"]).abs().max().item()
            line = [f"{S} x context {ctx}, chunk {T}" + (f", {args.layers} layers" if args.layers > 1 else "") + ":"]
            for name in libs:
                m = statistics.median(times[name])
                line.append(f"{name} {m * 1e3:.3g} ms [{min(times[name]) * 1e3:.3g}, {max(times[name]) * 1e3:.3g}]"
                            f" {flops / m / 1e9:.1f} GFLOP/s;")
            line.append(f"new/old time {statistics.median(times['new']) / statistics.median(times['old']):.3f};"
                        f" bit-identical {same} (max diff {diff:.2e})")
            print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
