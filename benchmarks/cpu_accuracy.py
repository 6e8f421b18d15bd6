"""How far the CPU engine's arithmetic moves a model's outputs from transformers' float32 model of
the same GGUF file: the logits of one long prompt (largest difference, relative to each
position's largest logit; KL per position; argmax agreement), and, with --greedy, the greedy
answers to speculative.py's chat and code-rewrite prompts, saved to compare with another tree's
(--compare). For numerics changes in the kernels (activation rounding, the KV cache's dtype):
run it on each tree (--tree: tallow imported from another checkout, e.g. a worktree of the old
commit; this script and its helpers stay this tree's).

    python benchmarks/cpu_accuracy.py --greedy /tmp/new.json
    python benchmarks/cpu_accuracy.py --tree /tmp/old --greedy /tmp/old.json
    python benchmarks/cpu_accuracy.py --compare /tmp/old.json /tmp/new.json

The model runs as the engine builds it on the CPU (load_engine_model: its quantization, its KV
cache dtype, tallow's attention kernels), the prompt in one forward pass (cpu_linear.text_logits).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402

# (The helpers of cpu_linear.py and speculative.py are imported where used, after --tree: importing
# cpu_linear imports tallow.)


def gguf_path(model: str) -> str:
    from tallow.models.loader import resolve_source

    resolved = resolve_source(model)
    if resolved.kind != "gguf":
        raise SystemExit(f"{model}: a GGUF file is needed (transformers reads the same file)")
    return resolved.location


def engine_logits(model: str, ids: list[int], kv_cache_dtype: str = "auto"):
    """The engine's CPU model's logits for every position of one prompt."""
    import torch

    from benchmarks.cpu_linear import text_logits
    from tallow.attention.cpu_backend import CpuAttentionBackend
    from tallow.config import EngineConfig
    from tallow.engine.runner import set_attention_backend
    from tallow.models.engine_model import load_engine_model

    em = load_engine_model(EngineConfig(model=model, device="cpu", kv_cache_dtype=kv_cache_dtype), torch.device("cpu"))
    set_attention_backend(em.loaded.model, CpuAttentionBackend())
    with torch.inference_mode():
        return text_logits(em.loaded.model, ids, len(ids), em.kv_dtype).float(), em


def greedy_answers(model: str, max_tokens: int, kv_cache_dtype: str = "auto") -> list[list[int]]:
    """Greedy answers to speculative.py's 8 chat and 8 code-rewrite prompts, batched, plain decoding."""
    from benchmarks.offline_throughput import make_core
    from benchmarks.speculative import prompts_for, run

    core = make_core(model=model, device="cpu", max_num_seqs=16, enable_prefix_caching=False,
                     kv_cache_dtype=kv_cache_dtype)
    prompts = prompts_for(core, "chat", 8) + prompts_for(core, "grounded", 8)
    return run(core, prompts, max_tokens, speculative=False)[1]


def compare(old_path: str, new_path: str) -> None:
    old, new = (json.load(open(p))["greedy"] for p in (old_path, new_path))
    rows = []
    for i, (a, b) in enumerate(zip(old, new)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        rows.append({"prompt": i, "old_tokens": len(a), "new_tokens": len(b),
                     "first_difference": "-" if first is None else first})
    print(table(rows, ["prompt", "old_tokens", "new_tokens", "first_difference"]))
    print(f"{sum(r['first_difference'] == '-' for r in rows)} of {len(rows)} answers equal")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default", help="a GGUF file, or 'default'")
    ap.add_argument("--text", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md"))
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--greedy", default=None, metavar="OUT", help="also the greedy answers, written with the JSON here")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--compare", nargs=2, default=None, metavar=("OLD", "NEW"),
                    help="compare the greedy answers of two earlier runs' JSON and exit")
    ap.add_argument("--tree", default=None, help="import tallow from this checkout (default: this one's)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engine's KV cache (auto: float16; float32; int8)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    if args.tree:
        sys.path.insert(0, os.path.abspath(args.tree))
    import tallow

    tree = os.path.dirname(os.path.dirname(os.path.abspath(tallow.__file__)))
    tree_commit = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(args.model)
    folder, name = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ids = tok(open(args.text).read())["input_ids"][: args.tokens]
    ours, em = engine_logits(args.model, ids, args.kv_cache_dtype)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    diff = (ours - ref).abs()
    rel = diff.max(-1).values / ref.abs().max(-1).values
    lr, lp = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
    kl = (lr.exp() * (lr - lp)).sum(-1)
    result = {"file": name, "positions": len(ids), "quantization": em.quantization,
              "kv_dtype": str(em.kv_dtype).removeprefix("torch."), "max_abs": diff.max().item(),
              "max_rel_to_largest": rel.max().item(), "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
              "argmax_agree": (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()}
    print(table([{k: f"{v:.3g}" if isinstance(v, float) else v for k, v in result.items()}], list(result)))
    payload = {"benchmark": "cpu_accuracy", "tallow_tree": tree, "tallow_commit": tree_commit, **result}
    if args.greedy:
        payload["greedy"] = greedy_answers(args.model, args.max_tokens, args.kv_cache_dtype)
        write_json(args.greedy, payload)
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
