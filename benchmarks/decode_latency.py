"""Decode latency: B sequences with a P-token prompt, N new tokens: prefill ms and decode tok/s.

On CUDA each row also gives the roofline of a decode step (weights read once plus the K/V
contexts over --peak-gbps, or its FLOPs over --peak-tflops) as ceiling_tok_s and its share, and graph_ms: the GPU
time of one replay of the step's CUDA graph alone, so step_ms - graph_ms is the host's
share of a step (scheduling, input staging, sampling, output processing).
--transformers times transformers generate on the same weights in the same run.

    python benchmarks/decode_latency.py --model default --prompt-len 100 --new-tokens 128
    python benchmarks/decode_latency.py --model default --batch 1 8 32 --transformers
    python benchmarks/decode_latency.py --model dummy:llama-3-8b --prompt-len 512 --new-tokens 128 --transformers

--variants runs several weight / KV-cache formats one after the other in the same run (each
engine shut down and its memory freed before the next), as QUANT/KV_DTYPE[/KV_SCALE[/FP8_LARGE_BATCH]]
(the last: weight_only | w8a8 | scaled_mm, fp8 weights' path for 64+ rows: the TTFT column), and adds
each row's speed-up over the first variant's row of the same batch, e.g. bf16 against fp8
weights at batch 1 and an fp8 KV cache at batch 32 on CUDA:

    python benchmarks/decode_latency.py --model dummy:llama-3-8b --batch 1 32 --prompt-len 512 \
        --variants auto/auto fp8/auto fp8/fp8/calibrate
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402
from benchmarks.offline_throughput import decode_roofline_s, make_core  # noqa: E402


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_tallow(core, prompts, new_tokens: int) -> tuple[float, float]:
    """(time to first token of the batch in s, decode tok/s over all sequences after the first token)."""
    from tallow.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    seqs = [core.make_sequences(p, params)[0] for p in prompts]
    t0 = time.perf_counter()
    for s in seqs:
        core.add(s)
    t_first = None
    produced_after_first = 0
    while not all(s.is_finished for s in seqs):
        outs = core.step()
        if t_first is None and all(s.num_output_tokens >= 1 for s in seqs):
            t_first = time.perf_counter()
        elif t_first is not None:
            produced_after_first += sum(len(o.token_ids) for _, o in outs)
    t1 = time.perf_counter()
    return t_first - t0, produced_after_first / (t1 - t_first)


def graph_replay_ms(core, batch: int) -> float | None:
    """GPU time of one replay of the decode graph that serves `batch` sequences."""
    import torch

    graphs = core.runner.graphs
    if graphs is None or batch > graphs.max_batch:
        return None
    bs = graphs.padded_size(batch)
    graph = graphs.graphs[bs][0]
    # The static inputs hold whatever the last step left (token ids of finished sequences may be
    # placeholders): replay on valid ids; the lengths and tables stay those of the last step.
    graphs.d_ids[:bs].zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 50


def run_transformers(source: str, loaded, prompts, new_tokens: int, device, dtype) -> tuple[float, float]:
    """transformers generate on the same weights (GGUF: its own dequantization; dummy: tallow's
    random weights copied in)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model = getattr(run_transformers, "_model", None)
    if model is None:
        if source.endswith(".gguf") or source == "default":
            from tallow.models.loader import resolve_source

            path = resolve_source(source).location
            model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                         dtype=dtype).to(device)
        else:
            from tallow.models.dummy import hf_config_dict

            cfg = AutoConfig.for_model(**hf_config_dict(source.split(":", 1)[1]))
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
            model.load_state_dict(loaded.model.hf_state_dict())
        model.eval()
        run_transformers._model = model
    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        sync(device)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        sync(device)
        total = time.perf_counter() - t0
    return ttft, len(prompts) * (new_tokens - 1) / max(total - ttft, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--kv-cache-scale", default="1.0")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="QUANT/KV_DTYPE[/KV_SCALE] engines timed one after the other (default: the options above)")
    ap.add_argument("--fp8-large-batch", choices=("weight_only", "w8a8", "scaled_mm"), default="weight_only",
                    help="fp8 weights' path for batches of --fp8-w8a8-min-rows (64) rows or more")
    ap.add_argument("--fp8-w8a8-min-rows", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--cuda-graph-max-batch", type=int, default=None,
                    help="capture decode graphs up to this batch (default: the engine's, 256)")
    ap.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                    help="launch step N+1 before step N's tokens are read (auto: on CUDA)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="one process per rank (NCCL on CUDA, gloo on CPU)")
    ap.add_argument("--transformers", action="store_true", help="also time transformers generate in this run")
    ap.add_argument("--peak-gbps", type=float, default=4150.0)
    ap.add_argument("--peak-tflops", type=float, default=740.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    if args.fp8_w8a8_min_rows:
        from tallow.ops.triton_fp8 import Fp8Linear

        Fp8Linear.w8a8_min_rows = args.fp8_w8a8_min_rows
    variants = args.variants or [f"{args.quantization}/{args.kv_cache_dtype}/{args.kv_cache_scale}"]
    rows, load_s = [], {}
    for variant in variants:
        parts = variant.split("/")
        defaults = ["auto", "auto", "1.0", args.fp8_large_batch]
        quant, kv_dtype, kv_scale, large = (parts + defaults[len(parts):])[:4]
        load_s[variant] = run_variant(args, quant, kv_dtype, kv_scale, rows, large)
        first = [r for r in rows if r["engine"] == "tallow" and r["variant"] == rows[0]["variant"]]
        for r in rows:
            base = next((f for f in first if f["batch"] == r["batch"]), None)
            if r["engine"] == "tallow" and base is not None:
                r["vs_first_variant"] = r["decode_tok_s"] / base["decode_tok_s"]
    print()
    cols = list(dict.fromkeys(c for r in rows for c in r))
    print(table(rows, cols))
    write_json(args.out, {"benchmark": "decode_latency", "load_s": load_s, "results": rows})


def run_variant(args, quantization: str, kv_cache_dtype: str, kv_cache_scale: str, rows: list,
                fp8_large_batch: str = "weight_only") -> float:
    """Time one engine (weights in `quantization`, KV cache in kv_cache_dtype) at every batch
    size, appending to rows; shut it down and free its memory. Returns its load seconds."""
    import gc

    import torch

    t0 = time.perf_counter()
    core = make_core(model=args.model, device=args.device, dtype=args.dtype, quantization=quantization,
                     kv_cache_dtype=kv_cache_dtype, kv_cache_scale=kv_cache_scale, fp8_large_batch=fp8_large_batch,
                     enforce_eager=args.enforce_eager,
                     async_scheduling={"on": True, "off": False}.get(args.async_scheduling, "auto"),
                     max_num_seqs=max(256, max(args.batch)),
                     **({} if args.cuda_graph_max_batch is None
                        else {"cuda_graph_max_batch": args.cuda_graph_max_batch}),
                     tensor_parallel_size=args.tensor_parallel_size,
                     max_model_len=args.prompt_len + args.new_tokens + 16, enable_prefix_caching=False)
    if args.enforce_eager:
        core.runner.graphs = None
    load_s = time.perf_counter() - t0
    variant = f"{quantization}/{kv_cache_dtype}/{kv_cache_scale}" + (
        f"/{fp8_large_batch}" if quantization == "fp8" else "")
    rng = random.Random(0)
    vocab = min(core.model_config.vocab_size, 10000)
    for b in args.batch:
        prompts = [[rng.randint(10, vocab - 1) for _ in range(args.prompt_len)] for _ in range(b)]
        run_tallow(core, prompts, 8)  # warm-up
        ttfts, rates = [], []
        for _ in range(args.repeats):
            ttft, rate = run_tallow(core, prompts, args.new_tokens)
            ttfts.append(ttft)
            rates.append(rate)
        row = {"engine": "tallow", "variant": variant, "model": args.model, "device": str(core.device),
               "tp": args.tensor_parallel_size, "quant": core.quantization,
               "kv": str(core.kv_dtype).removeprefix("torch."), "async": core.async_scheduling,
               "batch": b, "prompt": args.prompt_len, "new": args.new_tokens,
               "ttft_ms": 1000 * statistics.median(ttfts), "decode_tok_s": statistics.median(rates),
               "per_seq_tok_s": statistics.median(rates) / b,
               "step_ms": 1000 * b / statistics.median(rates)}
        if core.device.type == "cuda":
            ctx = b * (args.prompt_len + args.new_tokens // 2)
            ceiling_s = decode_roofline_s(core.runner.model, core.model_config, b, ctx,
                                          torch.empty((), dtype=core.kv_dtype).element_size(), args.peak_tflops,
                                          args.peak_gbps)[0]
            row.update(ceiling_tok_s=b / ceiling_s, of_ceiling=row["decode_tok_s"] * ceiling_s / b,
                       graph_ms=graph_replay_ms(core, b))
        rows.append(row)
        print(table([row], list(row)), flush=True)
        if args.transformers:
            ttfts, rates = [], []
            for _ in range(max(1, args.repeats - 1)):
                ttft, rate = run_transformers(args.model, core.loaded, prompts, args.new_tokens, core.device,
                                              core.dtype if core.device.type == "cuda" else torch.float32)
                ttfts.append(ttft)
                rates.append(rate)
            hrow = dict(row, engine="transformers", quant="none", ttft_ms=1000 * statistics.median(ttfts),
                        decode_tok_s=statistics.median(rates), per_seq_tok_s=statistics.median(rates) / b,
                        step_ms=1000 * b / statistics.median(rates), graph_ms=None,
                        tallow_speedup=row["decode_tok_s"] / statistics.median(rates))
            if "of_ceiling" in row:
                hrow["of_ceiling"] = hrow["decode_tok_s"] / row["ceiling_tok_s"]
            rows.append(hrow)
            print(table([hrow], list(hrow)), flush=True)
    core.shutdown()
    run_transformers.__dict__.pop("_model", None)
    del core
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return load_s


if __name__ == "__main__":
    main()
