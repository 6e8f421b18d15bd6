"""EngineCore's host (Python) work per decode step at a large batch, without the model.

    python benchmarks/host_overhead.py                       # 256 sequences, ~600-token contexts
    python benchmarks/host_overhead.py --num-seqs 64 --out benchmarks/results/host_overhead_cpu.json

A tiny random model whose forward is replaced by a stub (fixed random logits, no compute),
so what a step costs is the engine's own work: schedule, the step's inputs (the CUDA-graph
staging that decode steps take on a GPU, emulated on the CPU with a no-op graph, or the
eager path's host_inputs), the sampler (parameter tensors and its ops on a small vocabulary;
with --device cuda its kernels are launched and run on the GPU, as in serving),
the transfer of the results, scheduler.update and the TokenOutputs. Sampling params are
mixed: greedy, temperature 0.6 / top_p 0.95, and a few rows with penalties, logprobs and seeds.

Reports the median ms per steady-state decode step by phase, and a digest of every output
token (the same before and after a change that must not change outputs).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402

PHASES = ["schedule", "prepare", "sample", "to_host", "update", "outputs"]


def tiny_core(num_seqs: int, context: int, vocab: int, seed: int, graphs: bool, device: str = "cpu"):
    """An EngineCore on a 1-layer random model with a stub forward (see the module doc)."""
    import json
    import tempfile

    import torch
    from tokenizers import Tokenizer, models

    from tallow.config import EngineConfig
    from tallow.engine.core import EngineCore
    from tallow.engine.cuda_graphs import DecodeGraphs
    from tallow.models.config import ModelConfig
    from tallow.models.dummy import init_random_
    from tallow.models.llama import LlamaForCausalLM
    from tallow.models.loader import LoadedModel, TokenizerSource

    cfg = ModelConfig.from_hf_dict(dict(
        model_type="llama", vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2))
    dev = torch.device(device)
    model = LlamaForCausalLM.empty(cfg, device=dev, dtype=torch.float32)
    init_random_(model, seed)
    model.eval().requires_grad_(False)
    folder = tempfile.mkdtemp()
    Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>")).save(f"{folder}/tokenizer.json")
    with open(f"{folder}/tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<eos>"}, f)
    loaded = LoadedModel(cfg, model, TokenizerSource("hf", folder), {}, "tiny")
    block_size = 16
    num_blocks = num_seqs * ((context + 1024) // block_size + 2)
    config = EngineConfig(model="tiny", device=device, dtype="float32", quantization="none", seed=seed,
                          max_num_seqs=num_seqs, max_num_batched_tokens=4096, max_model_len=4096,
                          block_size=block_size, num_kv_blocks=num_blocks, enforce_eager=True,
                          async_scheduling=False)  # the phases of a synchronous step, one by one
    core = EngineCore(config, loaded=loaded)

    gen = torch.Generator().manual_seed(seed)
    table_logits = (torch.randn(4 * num_seqs, vocab, generator=gen) * 3).to(dev)

    class StubModel:
        """forward: zeros [T, hidden]; compute_logits: fixed random rows (no matmuls)."""

        def __call__(self, input_ids, positions, kv_caches, meta):
            return torch.zeros(input_ids.shape[0], cfg.hidden_size, device=dev)

        def compute_logits(self, hidden):
            return table_logits[: hidden.shape[0]]

    stub = StubModel()
    core.runner.model = stub
    if graphs:
        class NoOpGraph:
            def replay(self):
                pass

        g = DecodeGraphs(stub, core.runner.kv_caches, max_batch=num_seqs, max_model_len=config.max_model_len,
                         block_size=block_size, device=dev)
        g.graphs = {bs: (NoOpGraph(), table_logits[:bs]) for bs in g.ladder}
        core.runner.graphs = g
    return core


def timed(phase: str, fn, acc: dict):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[phase] = acc.get(phase, 0.0) + time.perf_counter() - t
    return wrapper


def measure(args, graphs: bool) -> dict:
    import torch

    from tallow.engine.sampling import SamplingParams

    core = tiny_core(args.num_seqs, args.context, args.vocab, args.seed, graphs, args.device)
    rng = random.Random(args.seed)
    params = []
    for i in range(args.num_seqs):
        kind = i % 16
        if kind < 8:
            p = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        elif kind < 14:
            p = SamplingParams(temperature=0.6, top_p=0.95, max_tokens=args.max_tokens, ignore_eos=True,
                               seed=i if kind == 13 else None)
        elif kind == 14:
            p = SamplingParams(temperature=0.6, top_p=0.95, repetition_penalty=1.1, frequency_penalty=0.2,
                               max_tokens=args.max_tokens, ignore_eos=True)
        else:
            p = SamplingParams(temperature=0.0, logprobs=5, presence_penalty=0.3,
                               max_tokens=args.max_tokens, ignore_eos=True)
        params.append(p)
    prompts = [[rng.randint(3, args.vocab - 1) for _ in range(rng.randint(args.context - 50, args.context + 50))]
               for _ in range(args.num_seqs)]
    seqs = [core.make_sequences(pr, p)[0] for pr, p in zip(prompts, params)]
    for s in seqs:
        core.add(s)

    acc: dict[str, float] = {}
    sched, runner = core.scheduler, core.runner
    sched.schedule = timed("schedule", sched.schedule, acc)
    sched.update = timed("update", sched.update, acc)
    runner.logits = timed("logits", runner.logits, acc)
    sampler = runner.sampler
    runner.sampler = timed("sample", sampler, acc)
    runner.sampler.release = sampler.release  # EngineCore calls it once nothing runs
    runner.collect = timed("to_host", runner.collect, acc)
    stub = runner.model
    stub.__call__  # noqa: B018
    model_call, model_logits = type(stub).__call__, type(stub).compute_logits
    type(stub).__call__ = timed("model", model_call, acc)
    type(stub).compute_logits = timed("model", model_logits, acc)
    if runner.graphs is not None:
        for bs, (g, logits) in list(runner.graphs.graphs.items()):
            g.replay = timed("model", g.replay, acc)

    rows = []
    with torch.inference_mode():
        while core.has_work() and len(rows) < args.warmup + args.steps:
            acc.clear()
            t = time.perf_counter()
            outs = core.step()
            total = time.perf_counter() - t
            decode = len(outs) == args.num_seqs and all(len(o.token_ids) == 1 for _, o in outs) \
                and sched.num_waiting == 0 and all(s.num_computed_tokens == s.num_tokens - 1 for s in seqs)
            if not decode:
                continue
            model = acc.get("model", 0.0)
            phase = {
                "schedule": acc["schedule"],
                "prepare": acc["logits"] - model,
                "sample": acc["sample"],
                "to_host": acc["to_host"],
                "update": acc["update"],
            }
            phase["outputs"] = total - model - sum(phase.values())
            phase["total"] = total - model
            rows.append(phase)
    rows = rows[args.warmup:]
    digest = hashlib.sha256(repr([s.token_ids[s.num_prompt_tokens:] for s in seqs]).encode()).hexdigest()[:16]
    med = {k: statistics.median(r[k] for r in rows) * 1e3 for k in PHASES + ["total"]}
    ctx = sum(s.num_tokens for s in seqs)
    return {"path": "graphs" if graphs else "eager", "steps": len(rows), "context_tokens": ctx,
            "output_digest": digest, **{f"{k}_ms": v for k, v in med.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--context", type=int, default=600, help="mean prompt tokens (+-50)")
    ap.add_argument("--vocab", type=int, default=64, help="small: the sampler's ops cost little on the CPU")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--path", choices=["graphs", "eager", "both"], default="both",
                    help="graphs: the CUDA-graph decode path (emulated), eager: host_inputs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cuda: the sampler's ops are launched, not run, on the host")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    paths = [True, False] if args.path == "both" else [args.path == "graphs"]
    results = [measure(args, g) for g in paths]
    cols = ["path", "steps", "context_tokens"] + [f"{k}_ms" for k in PHASES + ["total"]] + ["output_digest"]
    print(table(results, cols))
    write_json(args.out, {"num_seqs": args.num_seqs, "context": args.context, "vocab": args.vocab, "device": args.device,
                          "results": results})


if __name__ == "__main__":
    main()
