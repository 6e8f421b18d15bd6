"""CPU cost of streaming tool-call arguments: a ~24 KB file written through each parser's markup,
fed to the ToolCallRouter 4 characters at a time (about one token each), deltas taken after every
push as the sink does. Prints seconds per parser and microseconds per push.

    PYTHONPATH=. python benchmarks/tool_call_streaming.py [--repeat N] [--lines N]

Compare against a checkout without streaming (its router has no partial(); the script runs there
too) on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import time

from tallow.output.detokenizer import Detokenizer
from tallow.output.tool_parsers import TOOL_PARSERS
from tallow.output.tool_parsers.router import ToolCallRouter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lines", type=int, default=400)
    opts = ap.parse_args()
    file = ('def main():\n    print("héllo, \'world\'")  # a \\ backslash, a tab\t\n') * opts.lines
    texts = {
        "hermes": '<tool_call>\n{"name": "w", "arguments": %s}\n</tool_call>' % json.dumps({"content": file}),
        "qwen3_coder": ('<tool_call>\n<function=w>\n<parameter=content>\n' + file
                        + '\n</parameter>\n</function>\n</tool_call>'),
        "pythonic": '[w(content=%r)]' % file,
        "llama3_json": '{"name": "w", "parameters": %s}' % json.dumps({"content": file}),
        "mistral": '[TOOL_CALLS]w[ARGS]%s' % json.dumps({"content": file}),
    }
    for name, text in texts.items():
        pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
        best = float("inf")
        for _ in range(opts.repeat):
            router = ToolCallRouter(Detokenizer([p.encode() for p in pieces], frozenset()), TOOL_PARSERS[name]())
            start = time.perf_counter()
            for i in range(len(pieces)):
                router.push(i)
                router.take_tool_deltas()
            router.flush()
            best = min(best, time.perf_counter() - start)
            assert json.loads(router.tool_calls()[0].arguments)["content"] == file
        print(f"{name:12s} {len(text):7d} chars {len(pieces):6d} pushes  {best:.3f} s  "
              f"{1e6 * best / len(pieces):.1f} us/push")


if __name__ == "__main__":
    main()
