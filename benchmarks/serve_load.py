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


def _int_after(event: bytes, key: bytes) -> int | None:
    at = event.find(key)
    if at < 0:
        return None
    at += len(key)
    end = at
    while end < len(event) and event[end:end + 1].isdigit():
        end += 1
    return int(event[at:end]) if end > at else None


class _Dechunk:
    """HTTP/1.1 chunked transfer decoding, fed bytes as they arrive."""

    def __init__(self) -> None:
        self.raw = b""
        self.need = None  # bytes left of the current chunk's data (+2 for its CRLF)

    def feed(self, data: bytes) -> bytes:
        self.raw += data
        out = []
        while True:
            if self.need is None:
                line_end = self.raw.find(b"\r\n")
                if line_end < 0:
                    break
                self.need = int(self.raw[:line_end].split(b";")[0], 16) + 2
                self.raw = self.raw[line_end + 2:]
            if len(self.raw) < self.need:
                break
            out.append(self.raw[: self.need - 2])
            self.raw = self.raw[self.need:]
            self.need = None
        return b"".join(out)


async def one_request(url: str, model: str, index: int, max_tokens: int, filler: int = 0) -> dict:
    """Stream one greedy chat completion; the arrival time of each content chunk.

    The client runs on the machine it measures, so it is kept light: one connection, the
    request written by hand, and each SSE event read only for whether it carries content and
    for its usage numbers (httpx's line iterator and a JSON parse per event cost ~0.15 ms of
    CPU per token, which at 32 streams took ~5 ms of each ~45 ms decode step from the server)."""
    text = FILLER * filler + f"Write about {TOPICS[index % len(TOPICS)]}. (request {index})"
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}],
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    t0 = time.perf_counter()
    arrivals, completion, prompt = [], None, None
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode() +
                     b"\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " +
                     str(len(body)).encode() + b"\r\n\r\n" + body)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {head!r} {await reader.read()!r}")
        chunked, events = _Dechunk(), b""
        while True:
            data = await reader.read(65536)
            if not data:
                break
            now = time.perf_counter()
            events += chunked.feed(data)
            *complete, events = events.split(b"\n\n")
            for event in complete:
                at = event.find(b'"content":"')
                if at >= 0 and event[at + 11: at + 12] != b'"':
                    arrivals.append(now)
                if b'"usage":{' in event:
                    completion = _int_after(event, b'"completion_tokens":')
                    prompt = _int_after(event, b'"prompt_tokens":')
    finally:
        writer.close()
    end = time.perf_counter()
    return {"ttft": arrivals[0] - t0 if arrivals else None,
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "latency": end - t0, "start": t0, "end": end,
            "output_tokens": completion if completion is not None else len(arrivals),
            "prompt_tokens": prompt}


async def run_level(url: str, model: str, concurrency: int, num_requests: int, max_tokens: int,
                    filler: int = 0) -> dict:
    gate = asyncio.Semaphore(concurrency)

    async def gated(i: int) -> dict:
        async with gate:
            return await one_request(url, model, i, max_tokens, filler)

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
