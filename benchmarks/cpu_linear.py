"""Time the CPU Linear kernels on SmolLM2-135M's shapes.

Each candidate computes y = x @ W.T for float32 x and returns float32, casting
activations where its kernel needs another dtype (the cast is part of the time).
Candidates run interleaved, round by round, so a burst of load from other
processes on a shared machine hits all of them alike; the table quotes medians.

    python benchmarks/cpu_linear.py --out cpu_linear.json
    python benchmarks/cpu_linear.py --decode --out cpu_decode.json   # the whole default model

--decode loads SmolLM2-135M-Instruct once per scheme of tallow.models.quant and reports the
quantization time, the logits' distance from the float32 model on a text, and the time of
one forward step (model + LM head, paged KV cache at --context tokens) at each batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# name -> (out_features, in_features, uses per token) for SmolLM2-135M (30 layers, fused qkv / gate_up).
SHAPES = {
    "qkv": (960, 576, 30),
    "o": (576, 576, 30),
    "gate_up": (3072, 576, 30),
    "down": (576, 1536, 30),
    "lm_head": (49152, 576, 1),
}
GROUP = 32
BLOCK_SIZE = 16

Kernel = Callable[[torch.Tensor], torch.Tensor]


def _fp32(w: torch.Tensor) -> tuple[Kernel, int]:
    return (lambda x: F.linear(x, w)), w.numel() * 4


def _bf16(w: torch.Tensor) -> tuple[Kernel, int]:
    wb = w.bfloat16()
    return (lambda x: F.linear(x.bfloat16(), wb).float()), wb.numel() * 2


def _int8(act_dtype: torch.dtype) -> Callable[[torch.Tensor], tuple[Kernel, int]]:
    def build(w: torch.Tensor) -> tuple[Kernel, int]:
        scales = w.abs().amax(1).clamp_min(1e-12) / 127
        q = torch.round(w / scales[:, None]).to(torch.int8)
        s = scales.to(act_dtype)
        kernel = lambda x: torch._weight_int8pack_mm(x.to(act_dtype), q, s).float()  # noqa: E731
        return kernel, q.numel() + s.numel() * s.element_size()

    return build


def _int4(act_dtype: torch.dtype) -> Callable[[torch.Tensor], tuple[Kernel, int]]:
    def build(w: torch.Tensor) -> tuple[Kernel, int]:
        n, k = w.shape
        g = w.reshape(n, k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(act_dtype)
        kernel = lambda x: torch._weight_int4pack_mm_for_cpu(x.to(act_dtype), packed, GROUP, sz).float()  # noqa: E731
        return kernel, packed.numel() + sz.numel() * sz.element_size()

    return build


def _fbgemm_int8_dynamic(w: torch.Tensor) -> tuple[Kernel, int]:
    """Per-channel int8 weights, activations quantized per tensor at run time (deprecated torch.ao ops)."""
    scales = w.abs().amax(1).clamp_min(1e-12) / 127
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(w, scales.double(), torch.zeros(len(w), dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    return (lambda x: torch.ops.quantized.linear_dynamic(x, packed)), w.numel() + scales.numel() * 4


def _fbgemm_fp16(w: torch.Tensor) -> tuple[Kernel, int]:
    packed = torch.ops.quantized.linear_prepack_fp16(w, None)
    return (lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed)), w.numel() * 2


def _kleidiai_int4(w: torch.Tensor) -> tuple[Kernel, int]:
    """torch's KleidiAI 4-bit path; off ARM it falls back to a reference implementation."""
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    scale = (g.abs().amax(-1) / 7).clamp_min(1e-12)
    q = (torch.round(g / scale[..., None]).clamp(-8, 7) + 8).to(torch.uint8).reshape(n, k)
    q = (q[:, 1::2] << 4 | q[:, 0::2]).contiguous()
    packed = torch.ops.aten._dyn_quant_pack_4bit_weight(q, scale, None, GROUP, k, n)
    return (lambda x: torch.ops.aten._dyn_quant_matmul_4bit(x, packed, GROUP, k, n)), n * k // 2 + scale.numel() * 4


# Candidates whose kernels have no vectorised path on x86 (10x or more slower than fp32
# at M=1 here) are timed at M=1 only, to show it without spending minutes on them.
CANDIDATES: dict[str, tuple[Callable[[torch.Tensor], tuple[Kernel, int]], bool]] = {
    "fp32": (_fp32, False),
    "bf16": (_bf16, False),
    "fp16-fbgemm": (_fbgemm_fp16, False),
    "int8-bf16": (_int8(torch.bfloat16), False),
    "int4-bf16": (_int4(torch.bfloat16), False),
    "int8-dyn-fbgemm": (_fbgemm_int8_dynamic, False),
    "int8-fp32": (_int8(torch.float32), True),
    "int4-fp32": (_int4(torch.float32), True),
    "int4-kleidiai": (_kleidiai_int4, True),
}


def _tallow(cls_name: str, variant: str) -> Callable[[torch.Tensor], tuple[Kernel, int]]:
    """tallow's own Q4Linear / Q8Linear on the kernels of one instruction set (avx512, avx2)."""
    def build(w: torch.Tensor) -> tuple[Kernel, int]:
        from tallow.models import quant
        from tallow.ops import cpu_native

        saved = cpu_native._lib, cpu_native._tried
        cpu_native._lib, cpu_native._tried = cpu_native.load(variant), True  # the layer takes this build's kernels
        try:
            layer = getattr(quant, cls_name)(w)
        finally:
            cpu_native._lib, cpu_native._tried = saved
        nbytes = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.d, layer.m) if t is not None)
        return layer, nbytes
    return build


def _add_tallow_candidates() -> None:
    from tallow.ops import cpu_native

    for variant in cpu_native.supported_variants():
        CANDIDATES[f"tallow-q4-{variant}"] = (_tallow("Q4Linear", variant), False)
        CANDIDATES[f"tallow-q8-{variant}"] = (_tallow("Q8Linear", variant), False)


_add_tallow_candidates()


def _calls_per_sample(kernel: Kernel, x: torch.Tensor, target_s: float) -> int:
    """How many calls fill target_s (counted, not extrapolated from one call that may stall)."""
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < target_s:
        kernel(x)
        calls += 1
    return calls


def bench_shape(
    n: int, k: int, m: int, names: list[str], rounds: int, sample_s: float
) -> dict[str, dict[str, float]]:
    """Median and best microseconds per call of each candidate, sampled in interleaved rounds.

    On a shared machine the best sample is the closer estimate of the kernel's own speed;
    the median shows what it gets under the load of the moment.
    """
    w = torch.randn(n, k) * k**-0.5
    x = torch.randn(m, k)
    kernels = {}
    for name in names:
        kernel, nbytes = CANDIDATES[name][0](w)
        for _ in range(3):
            kernel(x)
        kernels[name] = (kernel, nbytes, _calls_per_sample(kernel, x, sample_s))
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name, (kernel, _, calls) in kernels.items():
            start = time.perf_counter()
            for _ in range(calls):
                kernel(x)
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {
        name: {"us": statistics.median(samples[name]), "best_us": min(samples[name]), "weight_bytes": kernels[name][1]}
        for name in names
    }


TEXT = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
        "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
        "from 1887 to 1889. Locally nicknamed 'La dame de fer', it was constructed as the centrepiece "
        "of the 1889 World's Fair, and to crown the centennial anniversary of the French Revolution.")


def attention_metadata(batch: int, start: int, count: int, block_size: int = BLOCK_SIZE):
    """batch sequences, each computing tokens start..start+count-1 now, sequence b in blocks
    b * n .. b * n + n - 1 of the cache."""
    from tallow.attention.metadata import AttentionMetadata

    context = start + count
    blocks_per_seq = -(-context // block_size)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    pos = torch.arange(start, context)
    slots = (tables[:, pos // block_size].long() * block_size + pos % block_size).flatten()
    return AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(0, batch * count + 1, count, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32), block_tables=tables,
        max_query_len=count, max_seq_len=context, query_lens_cpu=[count] * batch, seq_lens_cpu=[context] * batch,
        block_size=block_size)


def kv_caches(config, num_blocks: int, fill: bool, dtype: torch.dtype = torch.float32
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from tallow.attention.cpu_backend import cache_head_width

    shape = (num_blocks, BLOCK_SIZE, config.num_key_value_heads, cache_head_width(config.head_dim, dtype))
    if dtype == torch.int8:  # codes and their rows' scales: zeros, or noise filled by writing rows
        assert not fill, "an int8 cache is filled through tl_kv_write"
        return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(config.num_hidden_layers)]
    make = torch.randn if fill else torch.zeros
    return [(make(shape, dtype=dtype), make(shape, dtype=dtype)) for _ in range(config.num_hidden_layers)]


def decode_step_inputs(config, batch: int, context: int):
    """One decode step of batch sequences with context tokens each (the caches hold noise)."""
    meta = attention_metadata(batch, context - 1, 1)
    ids = torch.randint(100, 10000, (batch,), generator=torch.Generator().manual_seed(batch))
    return ids, torch.full((batch,), context - 1), kv_caches(config, meta.block_tables.numel(), True), meta


def text_logits(model, ids: list[int], step: int, kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits at every position of ids, computed step tokens per forward pass (1: decode steps,
    the packed kernels; len(ids): one prefill, the dense path), the KV cache in kv_dtype."""
    caches = kv_caches(model.config, -(-len(ids) // BLOCK_SIZE), False, kv_dtype)
    out = []
    for start in range(0, len(ids), step):
        chunk = ids[start:start + step]
        hidden = model(torch.tensor(chunk), torch.arange(start, start + len(chunk)), caches,
                       attention_metadata(1, start, len(chunk)))
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


def bench_decode(args) -> list[dict]:
    from tallow.config import EngineConfig
    from tallow.models.engine_model import load_tokenizer
    from tallow.models.loader import load_model
    from tallow.models.quant import quantize_model_

    models, rows = {}, []
    for scheme in args.schemes:
        loaded = load_model("default", dtype=torch.float32, device="cpu", cache_dir=EngineConfig().cache_dir)
        for p in loaded.model.parameters():  # fault in the memory-mapped weights: time quantization alone
            p.sum()
        start = time.perf_counter()
        quantize_model_(loaded.model, scheme)
        models[scheme] = loaded.model
        rows.append({"scheme": scheme, "quantize_s": time.perf_counter() - start})
    ids = load_tokenizer(loaded.tokenizer_source).encode(TEXT)
    with torch.inference_mode():
        for step, path in ((1, "decode"), (len(ids), "prefill")):
            if "none" not in models:
                break
            ref = text_logits(models["none"], ids, step).log_softmax(-1)
            for row in rows:
                logp = text_logits(models[row["scheme"]], ids, step).log_softmax(-1)
                row[f"{path}_kl_vs_fp32"] = (ref.exp() * (ref - logp)).sum(-1).mean().item()
                row[f"{path}_top1_agree"] = (ref.argmax(-1) == logp.argmax(-1)).float().mean().item()
        for batch in args.batch:
            inputs = decode_step_inputs(models[args.schemes[0]].config, batch, args.context)
            samples = {scheme: [] for scheme in models}
            for _ in range(args.rounds):
                for scheme, model in models.items():
                    start = time.perf_counter()
                    model.compute_logits(model(*inputs))
                    samples[scheme].append(time.perf_counter() - start)
            for row in rows:
                ms = 1e3 * statistics.median(samples[row["scheme"]])
                best = 1e3 * min(samples[row["scheme"]])
                row[f"b{batch}_step_ms"], row[f"b{batch}_best_ms"] = ms, best
                row[f"b{batch}_tok_s"], row[f"b{batch}_best_tok_s"] = batch * 1e3 / ms, batch * 1e3 / best
    for row in rows:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 128], help="rows (tokens) per call")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--sample-ms", type=float, default=20.0, help="time per sample (calls are repeated to fill it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--decode", action="store_true", help="time decode steps of the default model instead")
    ap.add_argument("--schemes", nargs="+", default=["none", "int4", "int8", "bf16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="--decode: sequences per step")
    ap.add_argument("--context", type=int, default=128, help="--decode: tokens in each sequence's context")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.decode:
        rows = bench_decode(args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": {"torch": torch.__version__, "threads": args.threads}, "rows": rows}, f, indent=1)
        return

    rows = []
    for m in args.m:
        names = [c for c in args.candidates if m == 1 or not CANDIDATES[c][1]]
        per_token = {name: [0.0, 0.0] for name in names}
        for shape in args.shapes:
            n, k, uses = SHAPES[shape]
            results = bench_shape(n, k, m, names, args.rounds, args.sample_ms / 1e3)
            base = results["fp32"]["us"] if "fp32" in results else float("nan")
            for name, r in results.items():
                per_token[name][0] += uses * r["us"]
                per_token[name][1] += uses * r["best_us"]
                rows.append({
                    "m": m, "shape": shape, "n": n, "k": k, "candidate": name, "us": r["us"], "best_us": r["best_us"],
                    "weight_bytes": r["weight_bytes"], "gb_s": r["weight_bytes"] / r["us"] / 1e3,
                    "speedup_vs_fp32": base / r["us"],
                })
                print(f"M={m:<4} {shape:<8} {n:>5}x{k:<5} {name:<16} {r['us']:>10.1f} us (best {r['best_us']:>9.1f}) "
                      f"{rows[-1]['gb_s']:>7.2f} GB/s  x{rows[-1]['speedup_vs_fp32']:.2f}", flush=True)
        if set(args.shapes) == set(SHAPES):
            print(f"M={m}: all Linear layers of one forward step (30 layers + LM head), median (best):")
            for name, (us, best) in sorted(per_token.items(), key=lambda kv: kv[1]):
                print(f"    {name:<16} {us / 1e3:8.2f} ms ({best / 1e3:7.2f})  -> "
                      f"{m * 1e6 / us:8.1f} tok/s ({m * 1e6 / best:7.1f}) if Linear were all")
                rows.append({"m": m, "shape": "step", "candidate": name, "us": us, "best_us": best})
    if args.out:
        meta = {
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": args.threads, "machine": platform.processor() or platform.machine(),
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
