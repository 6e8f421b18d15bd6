"""Grammar backends compared on the default model's tokenizer (49152 tokens): llguidance (what
tallow uses) and xgrammar (measured only where importable: it is not a dependency of tallow).

For 10 typical JSON schemas: compile time cold (nothing cached) and cached (tallow's cache for
llguidance, xgrammar's own compiler cache), and the per-step time to fill the token bitmasks of
a batch of 32 matchers (32 different schemas), each then advanced by a random allowed token.

    python benchmarks/grammar_backends.py                     # llguidance only
    PYTHONPATH=/tmp/xgr python benchmarks/grammar_backends.py # with xgrammar installed there:
        pip install --target /tmp/xgr --no-deps xgrammar==0.2.8 'apache-tvm-ffi>=0.1.11'
        (its other dependencies, torch and transformers, come from tallow's environment)
    python benchmarks/grammar_backends.py --steps 5 --repeat 1   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.common import table, write_json  # noqa: E402

# Ten schemas of the kinds clients send (pydantic models, tool arguments, extraction records).
TYPICAL_SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
     "required": ["city"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 80},
                                      "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["title", "tags", "score"]},
    {"type": "object", "properties": {"answer": {"type": "boolean"}, "confidence": {"type": "number"}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {
        "customer": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string",
                     "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"}}, "required": ["id", "email"]},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}}, "required": ["sku", "quantity"]}},
        "total": {"type": "number"}}, "required": ["customer", "items", "total"]},
    {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "object", "properties": {
        "explanation": {"type": "string"}, "output": {"type": "string"}}, "required": ["explanation", "output"]}},
        "final_answer": {"type": "string"}}, "required": ["steps", "final_answer"]},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                      "entities": {"type": "array", "items": {"type": "object", "properties": {
                                          "text": {"type": "string"}, "label": {"enum": ["PER", "ORG", "LOC"]}},
                                          "required": ["text", "label"]}}},
     "required": ["sentiment", "entities"]},
    {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1,
                                                                          "maximum": 100},
                                      "filters": {"type": "object", "additionalProperties": {"type": "string"}}},
     "required": ["query"]},
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"},
                                      "amount": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                                      "currency": {"type": "string", "pattern": "^[A-Z]{3}$"}},
     "required": ["date", "amount", "currency"]},
    {"$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer"},
                                                         "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                        "required": ["value"]}}, "$ref": "#/$defs/node"},
]


def canonical(schema: dict) -> str:
    return json.dumps(schema, separators=(",", ":"))  # key order kept: it is the output's


def ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs)


def time_compiles(backend, repeat: int) -> tuple[list[float], list[float]]:
    """tallow's GrammarBackend on TYPICAL_SCHEMAS, each `repeat` times in order: seconds to compile
    and copy a matcher with the cache emptied (cold), then again with it warm (cached)."""
    from tallow.engine.grammar import GrammarSpec

    cold, cached = [], []
    for schema in TYPICAL_SCHEMAS:
        spec = GrammarSpec("json_schema", canonical(schema))
        for _ in range(repeat):
            backend.clear_cache()
            t0 = time.perf_counter()
            backend.compile(spec).result().deep_copy()
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            backend.compile(spec).result().deep_copy()
            cached.append(time.perf_counter() - t0)
    return cold, cached


def bench_llguidance(tokenizer, vocab: int, batch: int, steps: int, repeat: int, rng) -> dict:
    import llguidance as llg
    from llguidance.numpy import fill_next_token_bitmask_par

    from tallow.engine.grammar import JSON_OPTIONS, GrammarBackend

    t0 = time.perf_counter()
    backend = GrammarBackend(tokenizer, vocab)
    tokenizer_s = time.perf_counter() - t0
    cold, cached = time_compiles(backend, repeat)
    templates = [llg.LLMatcher(backend.ll_tokenizer, llg.LLMatcher.grammar_from_json_schema(
        canonical(s), defaults=JSON_OPTIONS)) for s in TYPICAL_SCHEMAS]
    matchers = [templates[i % len(templates)].deep_copy() for i in range(batch)]
    masks = np.empty((batch, backend.words), dtype=np.int32)
    executor = llg.LLExecutor()
    fill = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], masks)
        fill.append(time.perf_counter() - t0)
        for i, m in enumerate(matchers):
            token = random_allowed(masks[i], vocab, rng)
            m.consume_token(token)
            if m.is_stopped() or m.is_error():
                matchers[i] = templates[i % len(templates)].deep_copy()
    return {"backend": "llguidance", "tokenizer_s": tokenizer_s, "cold_by_schema_ms": per_schema(cold, repeat),
            "compile_cold_ms": ms(cold),
            "compile_cold_max_ms": 1e3 * max(cold), "compile_cached_ms": ms(cached),
            f"mask_b{batch}_ms": ms(fill)}


def bench_xgrammar(tokenizer, vocab: int, batch: int, steps: int, repeat: int, rng) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    t0 = time.perf_counter()
    table_ = tokenizer.token_bytes_table()
    encoded = [table_[i] if i < len(table_) else b"" for i in range(vocab)]
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=sorted(tokenizer.eos_token_ids))
    tokenizer_s = time.perf_counter() - t0
    options = dict(any_whitespace=False, separators=(", ", ": "))
    cold, cached = [], []
    compiler = xgr.GrammarCompiler(info, cache_enabled=True)
    for schema in TYPICAL_SCHEMAS:
        text = canonical(schema)
        for _ in range(repeat):
            fresh = xgr.GrammarCompiler(info, cache_enabled=False)
            t0 = time.perf_counter()
            xgr.GrammarMatcher(fresh.compile_json_schema(text, **options))
            cold.append(time.perf_counter() - t0)
            compiler.compile_json_schema(text, **options)
            t0 = time.perf_counter()
            xgr.GrammarMatcher(compiler.compile_json_schema(text, **options))
            cached.append(time.perf_counter() - t0)
    compiled = [compiler.compile_json_schema(canonical(s), **options) for s in TYPICAL_SCHEMAS]
    matchers = [xgr.GrammarMatcher(compiled[i % len(compiled)]) for i in range(batch)]
    masks = np.empty(xgr.get_bitmask_shape(batch, vocab), dtype=np.int32)
    import torch

    masks_t = torch.from_numpy(masks)
    batched = xgr.BatchGrammarMatcher()
    fill = []
    for _ in range(steps):
        t0 = time.perf_counter()
        batched.batch_fill_next_token_bitmask(matchers, masks_t)
        fill.append(time.perf_counter() - t0)
        for i, m in enumerate(matchers):
            m.accept_token(random_allowed(masks[i], vocab, rng))
            if m.is_terminated():
                matchers[i] = xgr.GrammarMatcher(compiled[i % len(compiled)])
    return {"backend": "xgrammar", "tokenizer_s": tokenizer_s, "cold_by_schema_ms": per_schema(cold, repeat),
            "compile_cold_ms": ms(cold),
            "compile_cold_max_ms": 1e3 * max(cold), "compile_cached_ms": ms(cached),
            f"mask_b{batch}_ms": ms(fill)}


def per_schema(times: list[float], repeat: int) -> list[float]:
    """The median cold compile of each schema, in TYPICAL_SCHEMAS' order (ms)."""
    return [round(ms(times[i: i + repeat]), 2) for i in range(0, len(times), repeat)]


def random_allowed(words: np.ndarray, vocab: int, rng) -> int:
    allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab])
    return int(rng.choice(allowed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=50, help="mask steps timed")
    ap.add_argument("--repeat", type=int, default=3, help="compiles of each schema")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    from tallow.models.loader import default_model_path
    from tallow.tokenizer import Tokenizer, read_gguf_tokenizer_metadata

    tokenizer = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(default_model_path()))
    vocab = 49152
    rows = [bench_llguidance(tokenizer, vocab, args.batch, args.steps, args.repeat, np.random.default_rng(0))]
    xgr = bench_xgrammar(tokenizer, vocab, args.batch, args.steps, args.repeat, np.random.default_rng(0))
    if xgr is None:
        print("xgrammar is not importable: measured llguidance only (see the docstring to add it)")
    else:
        rows.append(xgr)
    print(table(rows, [c for c in rows[0] if c != "cold_by_schema_ms"]))
    for row in rows:
        print(f"{row['backend']} cold compile by schema (ms):", row["cold_by_schema_ms"])
    if args.out:
        write_json(args.out, {"benchmark": "grammar_backends", "vocab": vocab, "batch": args.batch, "results": rows})


if __name__ == "__main__":
    main()
