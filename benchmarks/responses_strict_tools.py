"""What holding /v1/responses function tools to their schemas costs: the same Responses request
with one function tool, `strict` left out (strict, OpenAI's default there: a grammar masks every
token) against `strict: false` (no grammar), alternated, against a running server.

    tallow serve default --port 18777 &
    PYTHONPATH=. python benchmarks/responses_strict_tools.py --url http://127.0.0.1:18777 [--rounds 2]

Prints the median seconds per request of each setting in each round; --out writes them as JSON
with the command line, commit and machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import httpx

from benchmarks.common import commit, machine, table, write_json

TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def request_seconds(url: str, strict: bool | None, max_tokens: int) -> tuple[float, int]:
    tool = dict(TOOL) if strict is None else {**TOOL, "strict": strict}
    body = {"model": "m", "input": "Write a long story about a cat.", "tools": [tool],
            "max_output_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/responses", json=body, timeout=300)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["output_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=5, help="requests per setting and round")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    request_seconds(opts.url, False, 8)  # warm
    rows = []
    for k in range(opts.rounds):
        for label, strict in (("strict: false", False), ("strict left out", None)):
            runs = [request_seconds(opts.url, strict, opts.max_tokens) for _ in range(opts.requests)]
            median = statistics.median(s for s, _ in runs)
            rows.append({"round": k + 1, "tools": label, "median_s": round(median, 3),
                         "min_s": round(min(s for s, _ in runs), 3), "max_s": round(max(s for s, _ in runs), 3),
                         "output_tokens": runs[0][1]})
    print(table(rows, ["round", "tools", "median_s", "min_s", "max_s", "output_tokens"]))
    write_json(opts.out, {"command": " ".join(sys.argv), "commit": commit(), "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
