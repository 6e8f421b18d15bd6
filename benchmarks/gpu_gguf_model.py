"""GGUF block-quantized models on CUDA: a Llama-3-8B-shaped Q4_K_M model of random blocks made on
the device (no file: the device's 64 MiB carry limit rules one out), served by tallow's engine
with its weights in their blocks (tallow/models/gguf_cuda.py), against the bf16 model.

The model source `gguf_random:<dummy preset>[:<type>]` (registered by this script) builds the
preset's architecture (tallow/models/dummy.py) with random blocks that have valid scales, sized
so the activations stay O(1) (weights of standard deviation about 0.02): without <type> in
llama.cpp's Q4_K_M mix (Q4_K everywhere; attn_v and ffn_down Q6_K on the layers llama.cpp's
use_more_bits picks, the LM head Q6_K), else every projection in <type> (Q8_0, Q4_K, ...).

    python benchmarks/gpu_gguf_model.py kernels --out k.json        # the one-row GEMV per layer shape: GB/s, configs
    python benchmarks/gpu_gguf_model.py compare --rows 1,4,128      # old and new kernels per shape and M, one table
    python benchmarks/gpu_gguf_model.py decode --model gguf_random:llama-3-8b --batch 1 --prompt-len 512
    python benchmarks/gpu_gguf_model.py offline --model gguf_random:llama-3-8b --num-seqs 128

`decode` and `offline` are benchmarks/decode_latency.py and benchmarks/offline_throughput.py
with the source registered (same arguments; run them with --model dummy:llama-3-8b for bf16);
`--tune-gemv` first times a few settings of the one-row GEMV on each of the loaded model's
layer shapes and uses the fastest (printed: candidates for triton_quant.GEMV1_DEFAULTS).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402

# Standard deviation of the weights a random block decodes to, about: d per format so that
# sc * q (K-quants: sc ~ U(0, 63), q ~ U(0, 15); Q6_K: sc ~ U(-128, 127), q - 32 ~ U(-32, 31))
# times d is about 0.02. dmin (Q4_K/Q5_K) centres the weights: dmin * mn ~ d * sc * mean(q).
_SCALE = {"Q4_K": 1e-4, "Q5_K": 5e-5, "Q6_K": 1.5e-5, "Q8_0": 3e-4, "Q4_0": 4e-3, "Q5_0": 2e-3,
          "Q4_1": 4e-3, "Q5_1": 2e-3}
_MIN_FACTOR = {"Q4_K": 7.5, "Q5_K": 15.5, "Q4_1": -7.5, "Q5_1": -15.5}


def random_gguf_blocks(fmt: str, rows: int, cols: int, generator, device):
    """uint8 [rows, row_bytes] GGUF blocks made on `device`: random codes and integer scales,
    positive float16 d (and centring dmin / m) of the size above."""
    import torch

    from tallow.ops.triton_quant_layout import _FP16_FIELDS, BLOCK_SIZES

    elems, nbytes = BLOCK_SIZES[fmt]
    nb = rows * cols // elems
    raw = torch.randint(0, 256, (nb, nbytes), dtype=torch.uint8, device=device, generator=generator)
    d = _SCALE[fmt] * (0.5 + torch.rand(nb, device=device, generator=generator))
    fields = _FP16_FIELDS[fmt]
    raw[:, fields[0]:fields[0] + 2] = d.to(torch.float16).view(torch.uint8).reshape(nb, 2)
    if len(fields) > 1:
        m = d * _MIN_FACTOR[fmt]
        raw[:, fields[1]:fields[1] + 2] = m.to(torch.float16).view(torch.uint8).reshape(nb, 2)
    return raw.reshape(rows, -1)


def q4_k_m_types(layers: int) -> dict[str, str]:
    """llama.cpp's Q4_K_M (llama_tensor_get_type): attn_v and ffn_down in Q6_K on the layers
    use_more_bits picks, Q4_K elsewhere; the LM head Q6_K; the embedding Q4_K."""
    def more_bits(i: int) -> bool:
        return i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2

    types = {"token_embd.weight": "Q4_K", "output.weight": "Q6_K"}
    for i in range(layers):
        for kind in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            types[f"blk.{i}.{kind}.weight"] = "Q4_K"
        for kind in ("attn_v", "ffn_down"):
            types[f"blk.{i}.{kind}.weight"] = "Q6_K" if more_bits(i) else "Q4_K"
    return types


class RandomTensors:
    """tallow.models.gguf_cuda.RawTensors of random blocks for a ModelConfig, made on the device
    as each is asked for (one tensor's bytes at a time); norms are ones (F32)."""

    def __init__(self, config, types: dict[str, str], seed: int = 0):
        self.config, self.types, self.seed = config, types, seed
        c = config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.shapes = {"token_embd.weight": (c.vocab_size, c.hidden_size), "output_norm.weight": (c.hidden_size, 1)}
        if not c.tie_word_embeddings:
            self.shapes["output.weight"] = (c.vocab_size, c.hidden_size)
        for i in range(c.num_hidden_layers):
            b = f"blk.{i}"
            self.shapes.update({
                f"{b}.attn_q.weight": (q, c.hidden_size), f"{b}.attn_k.weight": (kv, c.hidden_size),
                f"{b}.attn_v.weight": (kv, c.hidden_size), f"{b}.attn_output.weight": (c.hidden_size, q),
                f"{b}.ffn_gate.weight": (c.intermediate_size, c.hidden_size),
                f"{b}.ffn_up.weight": (c.intermediate_size, c.hidden_size),
                f"{b}.ffn_down.weight": (c.hidden_size, c.intermediate_size),
                f"{b}.attn_norm.weight": (c.hidden_size, 1), f"{b}.ffn_norm.weight": (c.hidden_size, 1)})

    def has(self, name: str) -> bool:
        return name in self.shapes

    def type_name(self, name: str) -> str:
        return self.types.get(name, "F32")

    def shape(self, name: str) -> tuple[int, int]:
        return self.shapes[name]

    def raw(self, name: str, device):
        import torch

        rows, cols = self.shapes[name]
        t = self.type_name(name)
        if t == "F32":  # norms: ones
            return torch.ones(rows, cols, device=device).view(torch.uint8).reshape(rows, -1)
        g = torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + sum(map(ord, name)) * 131 + len(name))
        return random_gguf_blocks(t, rows, cols, g, device)


def load_random_gguf(argument: str, *, dtype, device):
    """The `gguf_random:` source: `<preset>[:<type>]` (module docstring)."""
    import json
    import tempfile

    import torch
    from tokenizers import Tokenizer, models

    from tallow.models.dummy import dummy_config
    from tallow.models.gguf_cuda import load_blocks
    from tallow.models.loader import LoadedModel, TokenizerSource

    preset, _, fmt = argument.partition(":")
    config = dummy_config(preset)
    device = torch.device(device)
    if fmt:
        src = RandomTensors(config, {})
        types = {n: fmt for n, (r, c) in src.shapes.items() if c > 1}
    else:
        types = q4_k_m_types(config.num_hidden_layers)
    model = load_blocks(config, RandomTensors(config, types), device, dtype).eval().requires_grad_(False)
    folder = tempfile.mkdtemp()  # a two-token tokenizer: the benchmarks feed token ids
    Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>")).save(f"{folder}/tokenizer.json")
    with open(f"{folder}/tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<eos>"}, f)
    return LoadedModel(config, model, TokenizerSource("hf", folder), {}, f"gguf_random:{argument}")


def register() -> None:
    from tallow.models.loader import register_model_source

    register_model_source("gguf_random", load_random_gguf, "random GGUF blocks (benchmarks/gpu_gguf_model.py)")


# --- kernels: the one-row GEMV per Llama-3-8B layer shape -----------------------------------

SHAPES = {  # name -> (N, K, formats)
    "qkv_q4k": (6144, 4096, ["Q4_K"]), "o": (4096, 4096, ["Q4_K", "Q8_0"]),
    "gate_up": (28672, 4096, ["Q4_K", "Q8_0"]), "down": (4096, 14336, ["Q4_K", "Q6_K"]),
    "v": (1024, 4096, ["Q6_K"]), "lm_head": (128256, 4096, ["Q6_K", "Q8_0"]),
}
CONFIGS = [dict(block_n=bn, num_warps=w, num_stages=3, waves=2) for bn in (8, 16, 32) for w in (2, 4, 8)]
CONFIGS += [dict(block_n=16, num_warps=4, num_stages=3, waves=wv) for wv in (1, 4, 8)]
CONFIGS += [dict(block_n=16, num_warps=4, num_stages=s, waves=2) for s in (2, 4)]


def time_graph(fn, reps: int = 20, rounds: int = 5) -> float:
    """Median GPU microseconds of fn() from a CUDA graph of `reps` calls (no launch overhead)."""
    import statistics

    import torch

    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1000 / reps)
    return statistics.median(times)


def kernels(args) -> None:
    import torch

    from tallow.ops import triton_quant as tq
    from tallow.ops.triton_quant_layout import dequantize, repack

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows, best, t_start = [], {}, time.perf_counter()
    shapes = args.shapes.split(",") if args.shapes else list(SHAPES)
    for name in shapes:
        N, K, fmts = SHAPES[name]
        for fmt in fmts:
            if args.formats and fmt not in args.formats.split(","):
                continue
            if time.perf_counter() - t_start > args.budget_s:
                print(f"budget spent: skipping {name} {fmt}", flush=True)
                continue
            w = repack(random_gguf_blocks(fmt, N, K, g, dev), fmt, K)
            x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
            want = (x.float() @ dequantize(w).T)
            got = tq.quant_gemv1(x, w).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            dense = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
            row = {"shape": name, "fmt": fmt, "N": N, "K": K, "MB": w.nbytes() / 1e6, "rel_err": err,
                   "cublas_bf16_us": time_graph(lambda: torch.nn.functional.linear(x, dense)),
                   "old_gemv_us": time_graph(lambda: tq.quant_gemv(x, w))}
            del dense
            row["default_us"] = time_graph(lambda: tq.quant_gemv1(x, w))
            if args.sweep:
                sweep = []
                for cfg in CONFIGS:
                    try:
                        sweep.append((time_graph(lambda: tq.quant_gemv1(x, w, **cfg), reps=10, rounds=3), cfg))
                    except Exception as e:  # noqa: BLE001 (a config that does not compile: skipped)
                        print(f"  {cfg}: {type(e).__name__}", flush=True)
                sweep.sort(key=lambda t: t[0])
                row["best_us"], row["best"] = sweep[0][0], sweep[0][1]
                row["top5"] = [(round(t, 2), c) for t, c in sweep[:5]]
            row["default_GBs"] = w.nbytes() / row["default_us"] / 1e3
            if "best_us" in row:
                row["best_GBs"] = w.nbytes() / row["best_us"] / 1e3
            rows.append(row)
            print({k: v for k, v in row.items() if k != "top5"}, flush=True)
            if "top5" in row:
                print("  top5:", row["top5"], flush=True)
            del w
            torch.cuda.empty_cache()
    cols = [c for c in ("shape", "fmt", "MB", "rel_err", "cublas_bf16_us", "old_gemv_us", "default_us", "default_GBs",
                        "best_us", "best_GBs", "best") if any(c in r for r in rows)]
    print(table(rows, cols))
    write_json(args.out, {"benchmark": "gpu_gguf_kernels", "results": rows})


def _variants(tq, w, M: int) -> dict:
    """name -> fn(x) of the kernels that serve M rows of w, old and new side by side."""
    import torch

    v = {}
    if M == 1:
        if w.fmt in tq._GEMV1_FORMATS:
            v["gemv1_i2f"] = lambda x: tq.quant_gemv1(x, w, fastcvt=False)
            v["gemv1"] = lambda x: tq.quant_gemv1(x, w, fastcvt=True)
    elif M <= 8:
        v["quant_gemv"] = lambda x: tq.quant_gemv(x, w)
    else:
        if w.fmt in tq._GEMV1_FORMATS:
            v["dequant_cublas"] = lambda x: torch.matmul(x, tq.dequantize_weight(w, x.dtype).T)
        v["quant_gemm"] = lambda x: tq.quant_gemm(x, w)
    if M <= tq.GEMV2_MAX_ROWS and w.fmt in tq._GEMV2_FORMATS:
        v["gemv2"] = lambda x: tq.quant_gemv2(x, w)
        v["gemv2_n64"] = lambda x: tq.quant_gemv2(x, w, block_n=64)
        v["gemv2_n16"] = lambda x: tq.quant_gemv2(x, w, block_n=16)
        v["gemv2_n32w8"] = lambda x: tq.quant_gemv2(x, w, block_n=32, num_warps=8)
    if M <= 8 and w.fmt in tq._KQ_GEMM_FORMATS:  # tensor cores for a few rows (a padded 16-row tile)
        v["kq_gemm"] = lambda x: tq.kq_gemm(x, w)
        v["kq_gemm_n128"] = lambda x: tq.kq_gemm(x, w, block_n=128)
    if M >= 9 and w.fmt in tq._KQ_GEMM_FORMATS:
        v["kq_gemm"] = lambda x: tq.kq_gemm(x, w)
        v["kq_gemm_n128w8"] = lambda x: tq.kq_gemm(x, w, block_n=128, num_warps=8)
        v["kq_gemm_m64"] = lambda x: tq.kq_gemm(x, w, block_m=64)  # (3 stages at 128 rows: over 227 KB)
        v["kq_gemm_st1"] = lambda x: tq.kq_gemm(x, w, num_stages=1)
    return v


def compare(args) -> None:
    """Old and new block kernels per layer shape and row count, side by side (one table), each
    output checked against x @ dequantize(w).T first (a variant off by more than 2e-2 of the
    largest output, or failing, is reported and not timed); bf16 cuBLAS on a dense weight of
    the same shape for reference."""
    import torch

    from tallow.ops import triton_quant as tq
    from tallow.ops.triton_quant_layout import dequantize, repack

    dev = torch.device("cpu" if args.smoke else "cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows, failures, t_start = [], [], time.perf_counter()
    shapes = args.shapes.split(",") if args.shapes else list(SHAPES)
    timer = time_graph
    if args.smoke:  # the script's own check on the CPU (TRITON_INTERPRET=1): small shapes, wall time
        shapes = ["smoke"]
        SHAPES["smoke"] = (40, 512, ["Q4_K", "Q6_K"])

        def timer(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
    for name in shapes:
        N, K, fmts = SHAPES[name]
        for fmt in fmts:
            if args.formats and fmt not in args.formats.split(","):
                continue
            w = repack(random_gguf_blocks(fmt, N, K, g, dev), fmt, K)
            wd = dequantize(w)
            dense = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
            for M in (int(m) for m in args.rows.split(",")):
                if time.perf_counter() - t_start > args.budget_s:
                    print(f"budget spent: skipping {name} {fmt} M={M}", flush=True)
                    continue
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                want = x.float() @ wd.T
                row = {"shape": name, "fmt": fmt, "N": N, "K": K, "M": M, "MB": round(w.nbytes() / 1e6, 2),
                       "cublas_bf16": timer(lambda: torch.nn.functional.linear(x, dense))}
                for vname, fn in _variants(tq, w, M).items():
                    try:
                        err = ((fn(x).float() - want).abs().max() / want.abs().max()).item()
                        if not err <= 2e-2:
                            raise AssertionError(f"rel err {err:.3g}")
                        row[vname] = timer(lambda: fn(x))
                    except Exception as e:  # noqa: BLE001 (reported, the others still timed)
                        failures.append(f"{name} {fmt} M={M} {vname}: {type(e).__name__}: {str(e)[:200]}")
                        print("FAIL", failures[-1], flush=True)
                timed = {k: v for k, v in row.items() if k not in ("shape", "fmt", "N", "K", "M", "MB", "cublas_bf16")}
                if timed:
                    best = min(timed, key=timed.get)
                    row["best"], row["best_GBs"] = best, round(w.nbytes() / timed[best] / 1e3, 1)
                rows.append(row)
                print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            del w, wd, dense
            torch.cuda.empty_cache()
    names = ["shape", "fmt", "M", "MB", "cublas_bf16"]
    for r in rows:
        names += [k for k in r if k not in names and k not in ("N", "K", "best", "best_GBs")]
    print(table(rows, names + ["best", "best_GBs"]))
    if failures:
        print("FAILURES:\n" + "\n".join(failures))
    write_json(args.out, {"benchmark": "gpu_gguf_compare", "results": rows, "failures": failures})
    if failures:
        sys.exit(1)


TUNE_CONFIGS = [dict(block_n=bn, num_warps=w, num_stages=3, waves=wv)
                for bn in (8, 16, 32) for w in (4, 8) for wv in (2, 8)]


def tune_gemv1(model, budget_s: float = 60.0) -> dict:
    """Time TUNE_CONFIGS of the one-row GEMV on every distinct (format, N, K) of the model's
    block layers (CUDA graphs of 10 calls) and set the fastest in triton_quant.GEMV1_TUNED;
    returns {shape: (microseconds default, microseconds best, best config)}."""
    import torch

    from tallow.ops import triton_quant as tq

    weights = {}
    for m in model.modules():
        w = getattr(m, "weight", None)
        if w is not None and hasattr(w, "planes") and w.fmt in tq._GEMV1_FORMATS:
            weights.setdefault((w.fmt, w.N, w.K), w)
    out, t0 = {}, time.perf_counter()
    for key, w in weights.items():
        if time.perf_counter() - t0 > budget_s:
            print(f"tune budget spent: {key} keeps the defaults", flush=True)
            continue
        x = torch.randn(1, w.K, device=w.device, dtype=torch.bfloat16)
        base = time_graph(lambda: tq.quant_gemv1(x, w), reps=10, rounds=3)
        timed = []
        for cfg in TUNE_CONFIGS:
            try:
                timed.append((time_graph(lambda: tq.quant_gemv1(x, w, **cfg), reps=10, rounds=3), cfg))
            except Exception as e:  # noqa: BLE001 (a config that does not compile: skipped)
                print(f"  {key} {cfg}: {type(e).__name__}", flush=True)
        best_t, best = min(timed, key=lambda t: t[0])
        if best_t < base:
            tq.GEMV1_TUNED[key] = best
        out["%s %dx%d" % key] = (round(base, 2), round(best_t, 2), best, round(w.nbytes() / best_t / 1e3, 1))
        print(f"tune {key}: default {base:.2f} us, best {best_t:.2f} us {best} "
              f"({w.nbytes() / best_t / 1e3:.0f} GB/s)", flush=True)
    return out


def _tuned_make_core(make_core, budget_s: float):
    """offline_throughput.make_core, then the GEMV tuned on the loaded model (before the timed
    runs; the CUDA graphs captured at load are captured again with the tuned settings)."""
    def wrapped(**config):
        core = make_core(**config)
        tune_gemv1(core.runner.model, budget_s)
        if core.runner.graphs is not None:
            core.runner.capture_graphs(core.runner.graphs.max_batch)
        return core
    return wrapped


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("kernels", "compare", "decode", "offline"):
        print(__doc__)
        sys.exit(2)
    mode = sys.argv.pop(1)
    register()
    tune = "--tune-gemv" in sys.argv
    if tune:
        sys.argv.remove("--tune-gemv")
    if mode == "decode":
        from benchmarks import decode_latency

        if tune:
            decode_latency.make_core = _tuned_make_core(decode_latency.make_core, 60.0)
        decode_latency.main()
    elif mode == "offline":
        from benchmarks import offline_throughput

        if tune:
            offline_throughput.make_core = _tuned_make_core(offline_throughput.make_core, 60.0)
        offline_throughput.main()
    else:
        ap = argparse.ArgumentParser()
        ap.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)}")
        ap.add_argument("--formats", default=None, help="comma-separated: only these formats")
        ap.add_argument("--sweep", action="store_true", help="time every config of CONFIGS too")
        ap.add_argument("--rows", default="1,4,128", help="compare: the row counts M")
        ap.add_argument("--smoke", action="store_true", help="compare on the CPU (TRITON_INTERPRET=1), tiny shapes")
        ap.add_argument("--budget-s", type=float, default=200.0)
        ap.add_argument("--out", default=None)
        (compare if mode == "compare" else kernels)(ap.parse_args())


if __name__ == "__main__":
    main()
