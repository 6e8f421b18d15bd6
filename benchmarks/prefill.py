"""Prefill: time to first token of one P-token prompt (one chunk), against the compute ceiling.

    python benchmarks/prefill.py --model dummy:llama-3-8b --prompt-len 512 2048 4096

ideal_ms is 2 * params * P / --peak-tflops (the issue's yardstick; the causal attention's
4 * layers * heads * head_dim * P^2 / 2 FLOPs are shown apart as attn_gflop). TTFT is a whole
engine step: input staging, the forward, the LM head on the last token, sampling and the
step's host sync. Prefix caching is off, so every repeat computes the whole prompt.
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
from benchmarks.offline_throughput import make_core  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the engine's chunk of prompt tokens per step (default: the longest prompt, one chunk; "
                         "the server's default is 2048)")
    ap.add_argument("--peak-tflops", type=float, default=740.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from tallow.engine.sampling import SamplingParams

    longest = max(args.prompt_len)
    core = make_core(model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                     max_num_seqs=8, max_num_batched_tokens=args.max_num_batched_tokens or longest,
                     max_model_len=longest + 16, enable_prefix_caching=False)
    cfg = core.model_config
    params = sum(p.numel() for p in {id(p): p for p in core.runner.model.parameters()}.values())
    rng = random.Random(0)
    vocab = min(cfg.vocab_size, 10000)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rows = []
    for n in args.prompt_len:
        times = []
        for i in range(args.repeats + 1):  # the first is a warm-up
            seq = core.make_sequences([rng.randint(10, vocab - 1) for _ in range(n)], sp)[0]
            core.add(seq)
            t0 = time.perf_counter()
            while not seq.is_finished:
                core.step()
            if i:
                times.append(time.perf_counter() - t0)
        ttft = statistics.median(times)
        ideal = 2 * params * n / (args.peak_tflops * 1e12)
        attn = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * n * n
        rows.append({"model": args.model, "device": str(core.device), "prompt": n, "ttft_ms": 1000 * ttft,
                     "ideal_ms": 1000 * ideal, "ttft_over_ideal": ttft / ideal,
                     "tflops": (2 * params * n + attn) / ttft / 1e12, "attn_gflop": attn / 1e9,
                     "params_b": params / 1e9})
        print(table(rows[-1:], list(rows[-1])), flush=True)
    print()
    print(table(rows, list(rows[0])))
    write_json(args.out, {"benchmark": "prefill", "results": rows})


if __name__ == "__main__":
    main()
