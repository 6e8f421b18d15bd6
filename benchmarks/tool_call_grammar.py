"""The tool-call grammars (ToolParser.call_grammar) on the default model's tokenizer: for each
tool-call format and a number of tools, the time to build the grammar's text, to compile it
(llguidance's matcher, cold: what a request with new tools pays once, off the engine thread), and
to fill one token mask per step along a call (what each constrained row costs the step).

    python benchmarks/tool_call_grammar.py                 # 1, 8 and 32 tools, forced and auto+strict
    python benchmarks/tool_call_grammar.py --tools 1 --repeat 1   # a quick check
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import llguidance  # noqa: E402

from benchmarks.common import table, write_json  # noqa: E402
from tallow.models.loader import default_model_path  # noqa: E402
from tallow.output.tool_parsers import TOOL_PARSERS  # noqa: E402
from tallow.output.tool_parsers.grammar import grammar_tools  # noqa: E402
from tallow.tokenizer import Tokenizer, read_gguf_tokenizer_metadata  # noqa: E402

PARAMS = {"type": "object", "properties": {
    "query": {"type": "string", "maxLength": 80}, "limit": {"type": "integer", "minimum": 1, "maximum": 50},
    "sort": {"enum": ["asc", "desc"]}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "exact": {"type": "boolean"}}, "required": ["query"], "additionalProperties": False}
# What each format writes for the first tool, to walk the masks along.
CALLS = {
    "hermes": '<tool_call>\n{"name": "tool_0", "arguments": {"query": "tallow candles", "limit": 5}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=tool_0>\n<parameter=query>\ntallow candles\n</parameter>\n"
                   "<parameter=limit>\n5\n</parameter>\n</function>\n</tool_call>",
    "llama3_json": '{"name": "tool_0", "parameters": {"query": "tallow candles", "limit": 5}}',
    "mistral": '[TOOL_CALLS][{"name": "tool_0", "arguments": {"query": "tallow candles", "limit": 5}}]',
    "pythonic": '[tool_0(query="tallow candles", limit=5)]',
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tools", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()

    tok = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(default_model_path()))
    ll = llguidance.LLTokenizer(tok.backend.to_str(), eos_token=tok.eos_token_id)
    rows = []
    for name, call in CALLS.items():
        ids = tok.encode(call)
        for n in args.tools:
            tools = [{"type": "function", "function": {"name": f"tool_{k}", "parameters": PARAMS, "strict": True}}
                     for k in range(n)]
            for mode in ("forced", "auto+strict"):
                build, compile_ms, mask_ms = [], [], []
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    lark = TOOL_PARSERS[name]().call_grammar(grammar_tools(tools, constrain_all=mode == "forced"),
                                                             required=mode == "forced")
                    t1 = time.perf_counter()
                    m = llguidance.LLMatcher(ll, llguidance.grammar_from("lark", lark), log_level=0)
                    t2 = time.perf_counter()
                    assert not m.is_error(), m.get_error()
                    steps = []
                    for token in ids:
                        s = time.perf_counter()
                        m.compute_bitmask()
                        steps.append(time.perf_counter() - s)
                        assert m.consume_token(token), m.get_error()
                    build.append(t1 - t0)
                    compile_ms.append(t2 - t1)
                    mask_ms.append(statistics.mean(steps))
                rows.append({"format": name, "tools": n, "mode": mode, "grammar_bytes": len(lark),
                             "build_ms": 1e3 * min(build), "compile_ms": 1e3 * min(compile_ms),
                             "mask_ms_per_step": 1e3 * min(mask_ms)})
    print(table(rows, list(rows[0])))
    write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
