"""Serving load: stream chat completions at a given concurrency against a running server.

Reports time to first token (TTFT), inter-token latency (ITL), per-request latency and
throughput (requests/s, output tokens/s), as a table (median, p90, p99) and JSON.

    tallow serve &   # or any OpenAI-compatible server
    python benchmarks/serve_load.py --url http://127.0.0.1:8080 --concurrency 1 4 16 --requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402

TOPICS = ["the sea", "a city at night", "bread", "mountains", "a library", "rain", "trains", "gardens"]


FILLER = "Please keep in mind that the reader is curious and patient. "


async def one_request(client: httpx.AsyncClient, model: str, index: int, max_tokens: int,
                      filler: int = 0) -> dict:
    """Stream one greedy chat completion; the arrival time of each content chunk."""
    text = FILLER * filler + f"Write about {TOPICS[index % len(TOPICS)]}. (request {index})"
    body = {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    arrivals, usage = [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c["delta"].get("content") for c in chunk["choices"]):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    return {"ttft": arrivals[0] - t0 if arrivals else None,
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "latency": end - t0, "start": t0, "end": end,
            "output_tokens": usage["completion_tokens"] if usage else len(arrivals),
            "prompt_tokens": usage["prompt_tokens"] if usage else None}


async def run_level(url: str, model: str, concurrency: int, num_requests: int, max_tokens: int,
                    filler: int = 0) -> dict:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def gated(i: int) -> dict:
            async with gate:
                return await one_request(client, model, i, max_tokens, filler)

        results = await asyncio.gather(*(gated(i) for i in range(num_requests)))
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    output_tokens = sum(r["output_tokens"] for r in results)
    itl = [x for r in results for x in r["itl"]]
    return {"concurrency": concurrency, "requests": num_requests, "wall_s": wall,
            "prompt_tokens_median": statistics.median(r["prompt_tokens"] or 0 for r in results),
            "stream_decode_tok_s": 1.0 / statistics.median(itl) if itl else None,
            "request_throughput": num_requests / wall, "output_throughput": output_tokens / wall,
            "ttft_ms": percentiles([r["ttft"] * 1000 for r in results if r["ttft"] is not None]),
            "itl_ms": percentiles([x * 1000 for x in itl]),
            "latency_s": percentiles([r["latency"] for r in results])}


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"median": None, "p90": None, "p99": None}
    if len(values) == 1:
        return {"median": values[0], "p90": values[0], "p99": values[0]}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"median": statistics.median(values), "p90": cuts[89], "p99": cuts[98]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default=None, help="model id (default: the server's first)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=None, help="per level (default: 4 x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--filler", type=int, default=0,
                    help="repeat a 12-token filler sentence this many times in each prompt")
    ap.add_argument("--json", default="benchmarks/results/serve_load.json")
    args = ap.parse_args()

    model = args.model or httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
    levels = [asyncio.run(run_level(args.url, model, c, args.requests or 4 * c, args.max_tokens,
                                        args.filler))
              for c in args.concurrency]
    rows = [{"conc": lv["concurrency"], "reqs": lv["requests"], "prompt": lv["prompt_tokens_median"],
             "req/s": lv["request_throughput"], "stream tok/s": lv["stream_decode_tok_s"],
             "out tok/s": lv["output_throughput"],
             **{f"ttft {k} ms": lv["ttft_ms"][k] for k in ("median", "p90", "p99")},
             **{f"itl {k} ms": lv["itl_ms"][k] for k in ("median", "p90", "p99")}} for lv in levels]
    print(table(rows, list(rows[0])))
    write_json(args.json, {"benchmark": "serve_load", "url": args.url, "model": model,
                           "max_tokens": args.max_tokens, "levels": levels})


if __name__ == "__main__":
    main()
