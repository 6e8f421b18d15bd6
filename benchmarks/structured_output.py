"""Structured output on the default model, in one run:

1. compile time of 10 typical JSON schemas (benchmarks/grammar_backends.py's), cold (the cache
   emptied) and cached (what a request pays when the schema was seen: cache hit + matcher copy);
2. decode tok/s at each batch size without a grammar and with a JSON schema (a long array of
   strings, so no row completes before --new-tokens; jump-forward off, so both rows sample every
   token and the ratio is the mask's cost);
3. jump-forward off, on with forced tokens always as one chunk, and on with the engine's default
   (on CUDA: one forced token per step while more than 4 sequences run, so decode graphs replay)
   for a schema with long fixed keys: the time until every request has its complete JSON (finish
   "stop"), tokens, filled tokens and engine steps.

Targets: cached compile < 1 ms, cold < 100 ms; constrained decode at batch 32 >= 0.9x
unconstrained; jump-forward faster than without.

    python benchmarks/structured_output.py                       # defaults: batch 1 and 32
    python benchmarks/structured_output.py --batch 1 32 --new-tokens 128 --out benchmarks/results/structured_output.json
    python benchmarks/structured_output.py --batch 1 2 --new-tokens 8 --repeat 1   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402
from benchmarks.grammar_backends import TYPICAL_SCHEMAS, canonical, time_compiles  # noqa: E402

LONG_ARRAY = {"type": "object", "properties": {"words": {"type": "array", "minItems": 1000,
                                                          "items": {"type": "string", "maxLength": 12}}},
              "required": ["words"]}
LONG_KEYS = {"type": "object", "additionalProperties": False, "properties": {
    "customer_account_identification_number": {"type": "integer", "minimum": 0, "maximum": 99},
    "preferred_shipping_method_for_delivery": {"enum": ["standard", "express"]},
    "subscribed_to_marketing_newsletter_emails": {"type": "boolean"},
    "billing_address_is_same_as_shipping_address": {"type": "boolean"},
    "customer_support_priority_classification": {"enum": ["low", "normal", "high"]}},
    "required": ["customer_account_identification_number", "preferred_shipping_method_for_delivery",
                 "subscribed_to_marketing_newsletter_emails", "billing_address_is_same_as_shipping_address",
                 "customer_support_priority_classification"]}
PROMPT = "Write the customer's record as JSON. Customer 17 wants express delivery."


def compile_times(tokenizer, vocab: int, repeat: int) -> dict:
    from tallow.engine.grammar import GrammarBackend

    backend = GrammarBackend(tokenizer, vocab)
    cold, cached = time_compiles(backend, repeat)
    backend.shutdown()
    return {"schemas": len(TYPICAL_SCHEMAS), "cold_median_ms": 1e3 * statistics.median(cold),
            "cold_max_ms": 1e3 * max(cold), "cached_median_ms": 1e3 * statistics.median(cached),
            "cached_max_ms": 1e3 * max(cached)}


def generate(core, prompts, params) -> tuple[float, int, int, list]:
    """Run to completion: (seconds after every sequence had its first token, output tokens after
    the first ones, filled tokens, sequences)."""
    seqs = [core.make_sequences(p, params)[0] for p in prompts]
    for s in seqs:
        core.add(s)
    while core.has_work() and not all(s.num_output_tokens or s.is_finished for s in seqs):
        core.step()
    start_tokens = sum(s.num_output_tokens for s in seqs)
    t0 = time.perf_counter()
    while core.has_work():
        core.step()
    if core.device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    fill = sum(s.grammar.fill for s in seqs if s.grammar is not None)
    return elapsed, sum(s.num_output_tokens for s in seqs) - start_tokens, fill, seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each case (the best is kept)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from tallow.config import EngineConfig
    from tallow.engine.core import EngineCore
    from tallow.engine.grammar import GrammarSpec
    from tallow.engine.sampling import SamplingParams

    core = EngineCore(EngineConfig(model=args.model, device=args.device, max_num_seqs=max(64, max(args.batch))))
    tok = core.tokenizer
    compile_row = compile_times(tok, core.model_config.vocab_size, args.repeat)
    print("compile:", json.dumps(compile_row))

    prompt = tok.encode(PROMPT)
    long_array = GrammarSpec("json_schema", canonical(LONG_ARRAY))
    rows = []
    core.jump_forward = False
    for grammar in (None, long_array):  # warm-up: kernels, allocator, the grammar's compile
        generate(core, [prompt] * max(args.batch), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                                  grammar=grammar))
    for batch in args.batch:
        prompts = [prompt + tok.encode(" " + str(i)) for i in range(batch)]
        row = {"batch": batch}
        for name, grammar in (("free", None), ("schema", long_array)):
            params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True, grammar=grammar)
            best = None
            for _ in range(args.repeat):
                elapsed, tokens, _, _ = generate(core, prompts, params)
                rate = tokens / elapsed if elapsed > 0 else 0.0
                best = rate if best is None else max(best, rate)
            row[f"{name}_tok_s"] = best
        row["ratio"] = row["schema_tok_s"] / row["free_tok_s"] if row["free_tok_s"] else None
        rows.append(row)
    print(table(rows, list(rows[0])))

    long_keys = GrammarSpec("json_schema", canonical(LONG_KEYS))
    jf_rows = []
    # Jump-forward off; on with forced tokens always computed as one chunk (an eager step on
    # CUDA); on with the engine's default (config.jump_forward_chunk_max_seqs: one token per
    # step in decode-graph steps while many sequences run).
    default_cap = core.scheduler.forced_chunk_max_seqs
    modes = [("off", False, default_cap), ("chunks", True, None)]
    if default_cap is not None:
        modes.append((f"auto(>{default_cap}: 1/step)", True, default_cap))
    for batch in args.batch:
        prompts = [prompt + tok.encode(" " + str(i)) for i in range(batch)]
        for mode, jump, cap in modes:
            core.jump_forward = jump
            core.scheduler.forced_chunk_max_seqs = cap
            params = SamplingParams(temperature=0.0, max_tokens=400, grammar=long_keys)
            best = None
            for _ in range(args.repeat):
                steps0 = core.num_steps
                t0 = time.perf_counter()
                _, tokens, fill, seqs = generate(core, prompts, params)
                elapsed = time.perf_counter() - t0
                assert all(s.finish_reason == "stop" for s in seqs), [s.finish_reason for s in seqs]
                if best is None or elapsed < best[0]:
                    best = (elapsed, sum(s.num_output_tokens for s in seqs), fill, core.num_steps - steps0)
            jf_rows.append({"batch": batch, "jump_forward": mode, "seconds": best[0],
                            "tokens": best[1], "filled": best[2], "steps": best[3]})
    core.jump_forward = True
    core.scheduler.forced_chunk_max_seqs = default_cap
    print(table(jf_rows, list(jf_rows[0])))
    if args.out:
        write_json(args.out, {"benchmark": "structured_output", "model": core.model_name, "device": str(core.device),
                              "new_tokens": args.new_tokens, "compile": compile_row, "decode": rows,
                              "jump_forward": jf_rows})


if __name__ == "__main__":
    main()
