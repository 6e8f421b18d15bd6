"""Offline throughput, the nano-vllm test: N sequences with random input and output lengths.

    python benchmarks/offline_throughput.py --model default --num-seqs 32
    python benchmarks/offline_throughput.py --model dummy:qwen3-0.6b --num-seqs 256 --max-input-len 1024 --max-output-len 1024
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--min-input-len", type=int, default=100)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--min-output-len", type=int, default=100)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from tallow import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, enforce_eager=args.enforce_eager)
    load_s = time.perf_counter() - t0
    rng = random.Random(args.seed)
    vocab = min(llm.engine.model_config.vocab_size, 10000)
    prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=rng.randint(args.min_output_len, args.max_output_len))
              for _ in range(args.num_seqs)]
    # warm-up
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4))
    core = llm.engine
    steps0 = core.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    row = {
        "model": args.model, "device": str(core.device), "quant": core.quantization, "seqs": args.num_seqs,
        "input_tokens": n_in, "output_tokens": n_out, "seconds": dt,
        "output_tok_s": n_out / dt, "total_tok_s": (n_in + n_out) / dt, "steps": core.num_steps - steps0,
        "preemptions": core.scheduler.num_preemptions_total, "load_s": load_s,
    }
    print(table([row], list(row)))
    write_json(args.out, {"benchmark": "offline_throughput", "results": [row]})


if __name__ == "__main__":
    main()
