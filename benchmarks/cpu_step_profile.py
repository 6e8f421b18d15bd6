"""Per-op profile of CPU decode steps: where one step of the default model spends its time.

For each batch size, B sequences with a P-token prompt are prefilled, then S decode steps
of the engine (scheduling, batch preparation, forward, LM head, sampling) run under
torch.profiler. The table lists the top ops by self CPU time per step, with their calls
per step; op counts are exact and do not depend on the machine's load, so they are the
steadier measure of per-op overhead on a shared machine.

    python benchmarks/cpu_step_profile.py --batch 1 32
    python benchmarks/cpu_step_profile.py --model default --batch 1 --steps 32 --top 30
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402


def profile_steps(core, batch: int, prompt_len: int, steps: int, rng: random.Random):
    """Prefill `batch` sequences, then profile `steps` decode steps: (profiler, wall s per step)."""
    from torch.profiler import ProfilerActivity, profile

    from tallow.engine.sampling import SamplingParams

    vocab = min(core.model_config.vocab_size, 10000)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    seqs = [core.make_sequences([rng.randint(10, vocab - 1) for _ in range(prompt_len)], params)[0]
            for _ in range(batch)]
    for s in seqs:
        core.add(s)
    while not all(s.num_output_tokens >= 4 for s in seqs):  # prefill, then a few warm decode steps
        core.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
        wall = (time.perf_counter() - t0) / steps
    while not all(s.is_finished for s in seqs):
        core.step()
    return prof, wall


def op_rows(prof, steps: int, top: int) -> tuple[list[dict], int]:
    """The top ops by self CPU time, per step; and the number of aten ops per step."""
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total_calls = sum(e.count for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [{"op": e.key, "calls": e.count / steps, "self_ms": e.self_cpu_time_total / 1000 / steps,
             "total_ms": e.cpu_time_total / 1000 / steps} for e in events[:top]]
    return rows, total_calls // steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from tallow.config import EngineConfig
    from tallow.engine.core import EngineCore

    core = EngineCore(EngineConfig(model=args.model, device="cpu", quantization=args.quantization,
                                   max_num_seqs=max(args.batch), enable_prefix_caching=False,
                                   max_model_len=args.prompt_len + args.steps + 32))
    rng = random.Random(0)
    results = []
    for b in args.batch:
        prof, wall = profile_steps(core, b, args.prompt_len, args.steps, rng)
        rows, ops = op_rows(prof, args.steps, args.top)
        self_ms = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1000 / args.steps
        print(f"\nbatch {b}: {1000 * wall:.2f} ms/step under the profiler ({b / wall:.1f} tok/s), "
              f"{ops} aten ops/step, {self_ms:.2f} ms self time/step, threads {torch.get_num_threads()}")
        print(table(rows, ["op", "calls", "self_ms", "total_ms"]))
        results.append({"batch": b, "step_ms": 1000 * wall, "aten_ops_per_step": ops, "top": rows})
    write_json(args.out, {"benchmark": "cpu_step_profile", "quant": core.quantization, "results": results})


if __name__ == "__main__":
    main()
