"""Speculative decoding (ngram prompt lookup) against plain decoding, side by side.

One engine with --speculative-method ngram; each workload runs twice on it, with speculation
and with `speculative=False` per request (plain decoding on the same weights, KV pool and
kernels), greedy, so both give the same tokens (checked: `same`). Workloads:

- grounded: rewrite a ~300-token code block with one change (the chat template of the model)
- chat: plain chat questions
- random: random token prompts
- oracle: random prompts whose drafts are plain decoding's own next tokens (every draft is
  accepted, as far as the target's tokens stay those of the plain run): the most speculation
  can give on this model and device, whatever the weights (a `dummy:` model on a GPU)

For each (workload, batch) row: decode tok/s after every sequence's first token, plain and
spec, their ratio, the acceptance rate per draft position and the mean accepted length
(tokens emitted per verified draft). Targets on the reference CPU: grounded b1 >= 2x,
chat >= 0.95x, grounded b8 >= 1.3x.

    python benchmarks/speculative.py                         # default model, batch 1 and 8
    python benchmarks/speculative.py --max-tokens 16 --batch 1 --workloads chat   # a quick check
    python benchmarks/speculative.py --device cuda --model dummy:llama-3-8b       # the CUDA path
    python benchmarks/speculative.py --device cuda --model dummy:llama-3.2-1b --workloads oracle --batch 1 8 32

On CUDA a row also gives spec_eager_tok_s: the speculating run again with its verify steps
run eagerly instead of replaying the K+1-row verify graphs (tallow/engine/cuda_graphs.py).

A `dummy:` model has random weights: its replies do not copy the prompt, so acceptance is
that of whatever loops it falls into; it measures the cost of drafting and verifying on
that shape (and the adaptive off-switch), not the gain on input-grounded text.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402

CODE = '''import json
import os
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int

    def total(self) -> float:
        return self.price * self.quantity


def load_items(path: str) -> list[Item]:
    """Read a JSON list of items from path."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        data = json.load(f)
    return [Item(d["name"], float(d["price"]), int(d["quantity"])) for d in data]


def save_items(path: str, items: list[Item]) -> None:
    with open(path, "w") as f:
        json.dump([{"name": i.name, "price": i.price, "quantity": i.quantity} for i in items], f, indent=2)


def cheapest(items: list[Item]) -> Item | None:
    return min(items, key=lambda i: i.price, default=None)


def grand_total(items: list[Item]) -> float:
    total = 0.0
    for item in items:
        total += item.total()
    return total


def main() -> None:
    items = load_items("items.json")
    print("items:", len(items))
    print("cheapest:", cheapest(items))
    print("total:", grand_total(items))
    save_items("items_copy.json", items)


if __name__ == "__main__":
    main()
'''

CHANGES = [
    "rename the function grand_total to sum_totals",
    "rename the class Item to Product",
    "rename load_items to read_items",
    "make cheapest return the most expensive item instead, and rename it to priciest",
    "rename save_items to write_items",
    "change the indent in save_items from 2 to 4",
    "rename the field quantity to count",
    "rename main to run",
]

CHAT = [
    "What are three tips for staying healthy?",
    "Write a short poem about the sea.",
    "Explain what a black hole is to a child.",
    "Give me a recipe for pancakes.",
    "What is the difference between a list and a tuple in Python?",
    "Tell me a short story about a brave mouse.",
    "Why is the sky blue?",
    "Suggest a name for a bakery and explain why.",
]


def prompts_for(core, workload: str, batch: int, seed: int = 0) -> list[list[int]]:
    from tallow.chat_template import ChatTemplate

    tok = core.tokenizer
    if workload in ("random", "oracle"):
        rng = random.Random(seed)
        return [[rng.randrange(3, core.model_config.vocab_size) for _ in range(64)] for _ in range(batch)]
    template = ChatTemplate.for_tokenizer(tok)
    out = []
    for i in range(batch):
        if workload == "grounded":
            text = (f"Here is some code:\n\n```python\n{CODE}```\n\nRewrite the whole code with one change: "
                    f"{CHANGES[i % len(CHANGES)]}. Output only the code.")
        else:
            text = CHAT[i % len(CHAT)]
        prompt = template.render_prompt([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(tok.encode(prompt.text, literal_spans=prompt.literal_spans))
    return out


class OracleDrafts:
    """A proposer whose drafts are a reference run's next tokens (outputs of prompts of one length)."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]]):
        self.n = len(prompts[0])
        self.refs = {tuple(p): p + o for p, o in zip(prompts, outputs)}

    def propose(self, index, token_ids: list[int], k: int) -> list[int]:
        ref = self.refs.get(tuple(token_ids[:self.n]))
        m = len(token_ids)
        if ref is None or ref[m - 1] != token_ids[-1]:
            return []
        return ref[m:m + k]


def run(core, prompts, max_tokens: int, speculative: bool) -> tuple[float, list[list[int]], int]:
    """(decode tok/s after every sequence's first token, outputs, output tokens)."""
    from tallow.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, speculative=speculative)
    seqs = [core.make_sequences(p, params)[0] for p in prompts]
    for s in seqs:
        core.add(s)
    t_first = None
    after_first = 0
    while core.has_work():
        outs = core.step()
        if t_first is None:
            if all(s.num_output_tokens >= 1 for s in seqs):
                t_first = time.perf_counter()
        else:
            after_first += sum(len(o.token_ids) for _, o in outs)
    elapsed = time.perf_counter() - t_first if t_first is not None else 0.0
    return (after_first / elapsed if elapsed > 0 else 0.0), [s.output_ids for s in seqs], \
        sum(len(s.output_ids) for s in seqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto (the engine's choice)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--workloads", nargs="+", default=["grounded", "chat", "random"],
                    choices=["grounded", "chat", "random", "oracle"])
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--k", type=int, default=None, help="--num-speculative-tokens (default: the engine's, by device)")
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--speculative-model", default=None,
                    help="draft with this model (--speculative-method draft) instead of ngram")
    ap.add_argument("--row-cost", type=float, default=None,
                    help="--speculative-row-cost (default: the engine's, 0.7 on the CPU)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per row (the best is kept)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    from benchmarks.offline_throughput import make_core

    core = make_core(model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                     speculative_method="draft" if args.speculative_model else "ngram",
                     speculative_model=args.speculative_model, num_speculative_tokens=args.k,
                     ngram_max=args.ngram_max, ngram_min=args.ngram_min, speculative_row_cost=args.row_cost)
    spec = core.speculator
    rows = []
    for workload in args.workloads:
        for batch in args.batch:
            prompts = prompts_for(core, workload, batch)
            run(core, prompts[:1], 4, False)  # warm-up (both paths: on CUDA the first verify steps compile)
            run(core, prompts[:1], 8, True)
            plain_tps = spec_tps = 0.0
            before = spec.stats()
            for _ in range(args.repeat):
                tps, plain_out, n_plain = run(core, prompts, args.max_tokens, False)
                plain_tps = max(plain_tps, tps)
            mid = spec.stats()
            assert mid["num_drafts"] == before["num_drafts"], "a speculative=False request speculated"
            proposer = spec.proposer
            saved = proposer.propose, getattr(proposer, "may_propose", None)
            if workload == "oracle":
                proposer.propose = OracleDrafts(prompts, plain_out).propose
                proposer.may_propose = lambda index, token_ids, k, exact=True: True
            steps0, overlapped0, verified0 = core.num_steps, core.num_overlapped_steps, core.num_verified_steps
            for _ in range(args.repeat):
                tps, spec_out, n_spec = run(core, prompts, args.max_tokens, True)
                spec_tps = max(spec_tps, tps)
            # How the speculating runs' steps went: asynchronously (launched while the step
            # before ran), verified (with drafts), or neither (synchronous without drafts).
            steps = core.num_steps - steps0
            async_share = (core.num_overlapped_steps - overlapped0) / steps if steps else 0.0
            verified_share = (core.num_verified_steps - verified0) / steps if steps else 0.0
            after = spec.stats()
            drafts = after["num_drafts"] - mid["num_drafts"]
            proposed = after["num_draft_tokens"] - mid["num_draft_tokens"]
            accepted = after["num_accepted_tokens"] - mid["num_accepted_tokens"]
            per_pos = [(a - b) / drafts if drafts else 0.0
                       for a, b in zip(after["accepted_per_position"], mid["accepted_per_position"])]
            eager_tps = None
            verify_graphs = getattr(core.runner, "verify_graphs", None)
            if verify_graphs is not None:  # the same run with eager verify steps
                core.runner.verify_graphs = None
                eager_tps = 0.0
                try:
                    for _ in range(args.repeat):
                        eager_tps = max(eager_tps, run(core, prompts, args.max_tokens, True)[0])
                finally:
                    core.runner.verify_graphs = verify_graphs
            proposer.propose = saved[0]
            if saved[1] is not None:
                proposer.may_propose = saved[1]
            rows.append({
                "workload": workload, "batch": batch, "out_tokens": n_spec,
                "plain_tok_s": round(plain_tps, 1), "spec_tok_s": round(spec_tps, 1),
                "speedup": round(spec_tps / plain_tps, 3) if plain_tps else None,
                "spec_eager_tok_s": None if eager_tps is None else round(eager_tps, 1),
                "same": plain_out == spec_out, "drafts": drafts,
                "acceptance": round(accepted / proposed, 3) if proposed else 0.0,
                "mean_accepted_len": round(1 + accepted / drafts, 2) if drafts else 0.0,
                "accept_per_pos": " ".join(f"{x:.2f}" for x in per_pos),
                "async_steps": round(async_share, 2), "verified_steps": round(verified_share, 2),
            })
            print(f"{workload} b{batch}: plain {plain_tps:.1f} tok/s, spec {spec_tps:.1f} tok/s", file=sys.stderr)
    cols = ["workload", "batch", "out_tokens", "plain_tok_s", "spec_tok_s", "speedup", "spec_eager_tok_s", "same", "drafts",
            "acceptance", "mean_accepted_len", "accept_per_pos", "async_steps", "verified_steps"]
    print(table(rows, cols))
    write_json(args.json, {"model": args.model, "device": str(core.device), "k": spec.k, "ngram_max": args.ngram_max, "ngram_min": args.ngram_min,
                           "row_cost": spec.row_cost,
                           "max_tokens": args.max_tokens, "rows": rows})


if __name__ == "__main__":
    main()
