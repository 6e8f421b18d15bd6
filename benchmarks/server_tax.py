"""Server tax: the served single-stream decode rate over the engine's own rate on the same request.

One `tallow serve` subprocess and one in-process EngineCore with the same engine settings.
The same greedy chat request (the prompt rendered through the model's chat template, about
--prompt-tokens tokens, --max-tokens new tokens, ignore_eos) is run alternately: streamed over
HTTP, then straight through EngineCore.step(), --rounds times. Only one of the two runs at a
time (the idle one waits on a queue), so they do not compete for the CPU.

Both rates are measured the same way: tokens after the first one over the time from the first
token to the last. Over HTTP the token count of each chunk comes from
stream_options.continuous_usage_stats (a chunk may carry several tokens). Reported: medians of
each, the ratio of the medians (the issue's target: at least 0.95), and the median of the
per-round ratios (each round's two runs are back to back, so a slow phase of the machine
moves both: the steadier of the two figures on a noisy machine).

    python benchmarks/server_tax.py --model default --rounds 5 --out benchmarks/results/server_tax_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402

FILLER = "Please keep in mind that the reader is curious and patient. "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tallow.cli", "serve", "--model", args.model, "--port", str(port),
           "--log-level", "warning", "--quantization", args.quantization]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start in 300 s")


def served_rate(url: str, messages: list[dict], max_tokens: int) -> tuple[float, int]:
    """(decode tok/s after the first token, prompt tokens) of one streamed request.

    The client shares the machine's cores with the server, so it is kept as light as it can be:
    one socket, the HTTP/1.1 request written by hand, and each SSE event read only for its
    usage numbers (no JSON parse of the whole chunk): httpx's line iterator and json.loads
    cost ~0.15 ms of CPU per token here, which the server's engine threads would pay for."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    host, port = url.removeprefix("http://").split(":")
    first = last = None
    prompt_tokens = 0
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode())
        buf = b""
        done = False
        while not done:
            data = sock.recv(65536)
            if not data:
                break
            now = time.perf_counter()
            buf += data
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if b"[DONE]" in event:
                    done = True
                at = event.find(b'"completion_tokens":')
                if at < 0:
                    continue
                count = int(event[at + 20: event.index(b",", at)])
                if not count:
                    continue
                at = event.find(b'"prompt_tokens":')
                prompt_tokens = int(event[at + 16: event.index(b",", at)])
                if first is None:
                    first = (now, count)
                last = (now, count)
    assert last is not None and last[1] == max_tokens, f"expected {max_tokens} tokens, got {last}"
    return (last[1] - first[1]) / (last[0] - first[0]), prompt_tokens


def engine_rate(core, prompt_ids: list[int], max_tokens: int) -> float:
    from tallow.engine.sampling import SamplingParams

    seq = core.make_sequences(prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                         ignore_eos=True))[0]
    core.add(seq)
    times = []
    while not seq.is_finished:
        for _, out in core.step():
            times += [time.perf_counter()] * len(out.token_ids)
    assert len(times) == max_tokens
    return (len(times) - 1) / (times[-1] - times[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--prompt-tokens", type=int, default=100, help="about this many, chat template included")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from tallow.chat_template import ChatTemplate
    from tallow.config import EngineConfig
    from tallow.engine.core import EngineCore

    core = EngineCore(EngineConfig(model=args.model, quantization=args.quantization))
    tok = core.tokenizer
    template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
    text = "Write about the sea."
    while True:  # grow the user message until the rendered prompt has about --prompt-tokens tokens
        messages = [{"role": "user", "content": text}]
        prompt_ids = tok.encode(template.render(messages, add_generation_prompt=True))
        if len(prompt_ids) >= args.prompt_tokens:
            break
        text = FILLER + text

    port = free_port()
    server = start_server(args, port)
    url = f"http://127.0.0.1:{port}"
    served, engine = [], []
    try:
        served_rate(url, messages, 8)  # warm-up of both paths
        engine_rate(core, prompt_ids, 8)
        for _ in range(args.rounds):
            rate, served_prompt = served_rate(url, messages, args.max_tokens)
            served.append(rate)
            engine.append(engine_rate(core, prompt_ids, args.max_tokens))
    finally:
        server.terminate()
        server.wait(60)
    assert served_prompt == len(prompt_ids), (served_prompt, len(prompt_ids))

    row = {"model": core.model_name, "quant": core.quantization, "prompt": len(prompt_ids),
           "new": args.max_tokens, "rounds": args.rounds, "engine tok/s": statistics.median(engine),
           "served tok/s": statistics.median(served),
           "tax ratio": statistics.median(served) / statistics.median(engine),
           "paired ratio": statistics.median(s / e for s, e in zip(served, engine))}
    print(table([row], list(row)))
    write_json(args.out, {"benchmark": "server_tax", "result": row, "engine_tok_s": engine,
                          "served_tok_s": served})


if __name__ == "__main__":
    main()
