"""Offline throughput, the nano-vllm test: N sequences with random input and output lengths.

    python benchmarks/offline_throughput.py --model default --num-seqs 32
    python benchmarks/offline_throughput.py --model dummy:qwen3-0.6b --num-seqs 256

Drives EngineCore directly and times every step (each ends in the step's one host sync),
so besides output tok/s it reports the decode step at the peak batch against its roofline
(peak_step_ms: the whole step, host work included; peak_graph_ms: its CUDA graph's GPU time):
max(FLOPs / --peak-tflops, bytes moved / --peak-gbps), where the bytes are the weights read
once plus every sequence's K/V context, and the FLOPs 2 per weight per token plus attention.
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


def make_core(**config):
    """EngineCore(EngineConfig(**config)). A dummy model whose tokenizer (the default model's)
    is not installed gets a two-token stand-in: the benchmarks feed token ids."""
    import json
    import tempfile

    from tallow.config import EngineConfig
    from tallow.engine.core import EngineCore
    from tallow.models.engine_model import resolve_device, resolve_dtype
    from tallow.models.loader import TokenizerSource, load_model

    config = EngineConfig(**config)
    if not config.model.startswith("dummy:") or config.tensor_parallel_size > 1:
        return EngineCore(config)  # tensor parallel: each rank loads its shard (a dummy needs the default wheel)
    device = resolve_device(config.device)
    loaded = load_model(config.model, dtype=resolve_dtype(config.dtype, device), device=device, seed=config.seed)
    if loaded.tokenizer_source.path is None:
        from tokenizers import Tokenizer, models

        folder = tempfile.mkdtemp()
        Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>")).save(f"{folder}/tokenizer.json")
        with open(f"{folder}/tokenizer_config.json", "w") as f:
            json.dump({"eos_token": "<eos>"}, f)
        loaded.tokenizer_source = TokenizerSource("hf", folder)
    return EngineCore(config, loaded=loaded)


class TimedGraph:
    """A CUDA graph whose replays are bracketed by events: the GPU time of the graph alone
    (the input copies before it and the host's work are outside). Events come from a pool
    made beforehand, so timing adds only two records to a step."""

    def __init__(self, graph, events: list):
        self.graph = graph
        self.pool = events
        self.timed = []

    def replay(self) -> None:
        if not self.pool:
            self.graph.replay()
            return
        start, end = self.pool.pop(), self.pool.pop()
        start.record()
        self.graph.replay()
        end.record()
        self.timed.append((start, end))

    def median_ms(self) -> float | None:
        return statistics.median(s.elapsed_time(e) for s, e in self.timed) if self.timed else None


def weight_bytes_and_params(model) -> tuple[int, int]:
    """(bytes a decode step reads, parameters that do 2 FLOPs per token): every weight once,
    except an untied embedding table, of which a step reads only its tokens' rows. Block-
    quantized layers (TritonQuantLinear: a QuantWeight, GGUF on CUDA) count their planes' bytes;
    a block-quantized embedding (no `weight` parameter) is left out like an untied one."""
    import torch

    params = {id(p): p for p in model.parameters()}
    embed = getattr(model.model.embed_tokens, "weight", None)
    if isinstance(embed, torch.nn.Parameter) and getattr(model.lm_head, "weight", None) is not embed:
        del params[id(embed)]
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    nparams = sum(p.numel() for p in params.values())
    for m in model.modules():
        w = getattr(m, "weight", None)
        if w is not None and hasattr(w, "planes"):
            nbytes += w.nbytes()
            nparams += w.N * w.K
    return nbytes, nparams


def decode_roofline_s(model, cfg, batch: int, context_tokens: int, kv_dtype_bytes: int,
                      peak_tflops: float, peak_gbps: float) -> tuple[float, float, float]:
    """(ceiling seconds, FLOPs, bytes) of one decode step of `batch` sequences whose contexts
    hold context_tokens tokens in all, on one device: with tensor parallelism, rank 0's shard
    (its weights, its KV heads, its attention heads)."""
    wbytes, wparams = weight_bytes_and_params(model)
    shard = model.shard
    kv = cfg.kv_bytes_per_token(kv_dtype_bytes) * context_tokens * shard.num_kv_heads // cfg.num_key_value_heads
    flops = 2 * wparams * batch + 4 * cfg.num_hidden_layers * shard.num_heads * cfg.head_dim * context_tokens
    nbytes = wbytes + kv
    return max(flops / (peak_tflops * 1e12), nbytes / (peak_gbps * 1e9)), flops, nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-input-len", type=int, default=100)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--min-output-len", type=int, default=100)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                    help="launch step N+1 before step N's tokens are read (auto: on CUDA)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="one process per rank (NCCL on CUDA, gloo on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-tflops", type=float, default=740.0)
    ap.add_argument("--peak-gbps", type=float, default=4150.0)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print the N functions with the most host time over the run (cProfile)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from tallow.engine.sampling import SamplingParams

    t0 = time.perf_counter()
    core = make_core(model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                     max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                     max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                     async_scheduling={"on": True, "off": False}.get(args.async_scheduling, "auto"),
                     seed=args.seed,
                     tensor_parallel_size=args.tensor_parallel_size)
    if args.enforce_eager:
        core.runner.graphs = None
    load_s = time.perf_counter() - t0
    rng = random.Random(args.seed)
    vocab = min(core.model_config.vocab_size, 10000)
    prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=rng.randint(args.min_output_len, args.max_output_len))
              for _ in range(args.num_seqs)]

    def run(prompt_params):
        seqs = [core.make_sequences(p, sp)[0] for p, sp in prompt_params]
        for s in seqs:
            core.add(s)
        schedule = core.scheduler.schedule
        steps = []  # (seconds, decode-only, batch, context tokens)

        def recording_schedule():
            out = schedule()
            steps.append((out.is_decode_only, len(out.scheduled), sum(s.start + s.num_new_tokens for s in out.scheduled)))
            return out

        core.scheduler.schedule = recording_schedule
        times = []
        try:
            while core.has_work():
                t = time.perf_counter()
                core.step()
                times.append(time.perf_counter() - t)
        finally:
            del core.scheduler.schedule
        return seqs, [(dt, *s) for dt, s in zip(times, steps)]

    # Warm-up on prompts of the same lengths (other tokens: no prefix-cache hits later), so that
    # Triton has compiled the specialisations that the prefill and mixed steps' shapes select
    # (otherwise the timed run pays seconds of JIT).
    warm = random.Random(args.seed + 1)
    run([([warm.randint(0, vocab - 1) for _ in p], SamplingParams(max_tokens=4, ignore_eos=True))
         for p in prompts[:32]])
    graphs = core.runner.graphs
    if graphs is not None:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(8192)]
        graphs.graphs = {bs: (TimedGraph(g, events), logits) for bs, (g, logits) in graphs.graphs.items()}
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    t0 = time.perf_counter()
    seqs, steps = run(list(zip(prompts, params)))
    dt = time.perf_counter() - t0
    if profile is not None:
        import pstats

        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    n_out = sum(s.num_output_tokens for s in seqs)
    n_in = sum(len(p) for p in prompts)
    decode = [s for s in steps if s[1]]
    peak = max(s[2] for s in decode)
    at_peak = [s for s in decode if s[2] == peak]
    step_s = statistics.median(s[0] for s in at_peak)
    ctx = statistics.median(s[3] for s in at_peak)
    kv_bytes = torch.empty((), dtype=core.dtype).element_size()
    if core.quantization == "none":
        ceiling_s, flops, nbytes = decode_roofline_s(core.runner.model, core.model_config, peak, int(ctx), kv_bytes,
                                                     args.peak_tflops, args.peak_gbps)
    else:  # quantized CPU weights: no roofline (the ceilings are the GPU's)
        ceiling_s = flops = nbytes = float("nan")
    row = {
        "model": args.model, "device": str(core.device), "tp": args.tensor_parallel_size,
        "graphs": core.runner.graphs is not None, "async": core.async_scheduling,
        "seqs": args.num_seqs, "input_tokens": n_in, "output_tokens": n_out, "seconds": dt,
        "output_tok_s": n_out / dt, "total_tok_s": (n_in + n_out) / dt, "steps": len(steps),
        "decode_steps": len(decode), "decode_s": sum(s[0] for s in decode),
        "peak_batch": peak, "peak_ctx_tokens": ctx, "peak_step_ms": 1000 * step_s,
        "roofline_ms": 1000 * ceiling_s, "of_roofline": ceiling_s / step_s,
        "peak_graph_ms": graphs.graphs[graphs.padded_size(peak)][0].median_ms() if graphs else None,
        "peak_step_gflop": flops / 1e9, "peak_step_gb": nbytes / 1e9,
        "preemptions": core.scheduler.num_preemptions_total, "load_s": load_s,
    }
    if row["peak_graph_ms"]:
        row["graph_of_roofline"] = row["roofline_ms"] / row["peak_graph_ms"]
    print(table([row], list(row)))
    write_json(args.out, {"benchmark": "offline_throughput", "results": [row]})
    core.shutdown()


if __name__ == "__main__":
    main()
