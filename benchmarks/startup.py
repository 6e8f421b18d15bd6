"""Start-up time: `LLM(model)` ready, measured in fresh processes.

Each round starts a new Python process that imports tallow and builds `LLM(model)`, and
reports two times: the constructor alone (the issue's "ready" figure: weights read, quantized,
KV cache allocated, tokenizer loaded) and the whole process from its start (imports included).
The first round may convert and cache the GGUF's weights; it is reported apart (warm-disk
figures are the medians of the other rounds).

    python benchmarks/startup.py --model default --rounds 5 --out benchmarks/results/startup_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from tallow.llm import LLM
t1 = time.perf_counter()
llm = LLM(sys.argv[1], quantization=sys.argv[2])
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "ready_s": t2 - t1, "process_s": t2 - t0}))
"""


def one_round(model: str, quantization: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, model, quantization], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--rounds", type=int, default=5, help="rounds after the first")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    first = one_round(args.model, args.quantization)
    rounds = [one_round(args.model, args.quantization) for _ in range(args.rounds)]
    row = {"model": args.model, "quant": args.quantization, "rounds": args.rounds,
           "first ready s": first["ready_s"],
           "ready s (median)": statistics.median(r["ready_s"] for r in rounds),
           "ready s (max)": max(r["ready_s"] for r in rounds),
           "import s (median)": statistics.median(r["import_s"] for r in rounds),
           "process s (median)": statistics.median(r["process_s"] for r in rounds)}
    print(table([row], list(row)))
    write_json(args.out, {"benchmark": "startup", "result": row, "first": first, "rounds": rounds})


if __name__ == "__main__":
    main()
