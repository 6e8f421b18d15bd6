"""tallow against llama.cpp's llama-server on the same GGUF files, in one run, alternating.

For each file and round (the order of the two servers alternates from round to round), each
server is started fresh on the file and measured:

- ready: seconds from spawning the server to its first successful one-token completion (warm
  disk: the file is read once before the first round). tallow's figure is also given less the
  bare `import torch` time of this Python (the issue counts ready after `import torch`);
- decode: served output tok/s at each concurrency (greedy /v1/completions streams, the same
  prompts for both, ignore_eos, max_tokens each), and the per-stream decode rate (1 / median
  inter-token latency);
- peak RSS: the server process's VmHWM after its load and every level (tallow serve's process;
  llama-server's), read from /proc.

llama.cpp is built from the source inside the llama-cpp-python sdist (CPU only, cache the build
outside the repository):

    pip download llama-cpp-python --no-deps --no-binary :all: -d /tmp/llamacpp && cd /tmp/llamacpp
    tar xzf llama_cpp_python-*.tar.gz && cd llama_cpp_python-*/vendor/llama.cpp
    nice -n 19 cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \\
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
    nice -n 19 cmake --build build --target llama-server llama-quantize -j2

(add -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 to CMAKE_C_FLAGS / CMAKE_CXX_FLAGS on Xeons whose
AMX faults). Then, on a quiet machine:

    python benchmarks/vs_llamacpp.py --llama-server /tmp/llamacpp/.../build/bin/llama-server \\
        --gguf default --gguf /path/gemma-3-270m-q4_k_m.gguf --streams 1 32 --rounds 2 \\
        --out benchmarks/results/vs_llamacpp.json

`--gguf default` is the default model's file. Both servers get the same threads (--threads,
default all cores), a context of 32,768 tokens shared by 32 slots for llama-server
(`-np 32 -c 32768 --cont-batching`), and tallow its defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402
from benchmarks.serve_load import _Dechunk, percentiles  # noqa: E402

TOPICS = ["the sea", "a city at night", "bread", "mountains", "a library", "rain", "trains", "gardens"]


def default_gguf() -> str:
    from tallow.models.loader import default_model_path

    return default_model_path()


def torch_import_s() -> float:
    """A fresh process's `import torch` time (the part of tallow's start-up not counted)."""
    out = subprocess.run([sys.executable, "-c", "import time; t = time.perf_counter(); import torch; "
                          "print(time.perf_counter() - t)"], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def peak_rss_bytes(pid: int) -> int | None:
    """VmHWM of a process (its peak resident set), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def completion(port: int, index: int, max_tokens: int, model: str) -> dict:
    """One greedy streamed /v1/completions request; each content chunk's arrival time."""
    text = f"Here is a short essay about {TOPICS[index % len(TOPICS)]} (number {index}).\n\n"
    body = json.dumps({"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    t0 = time.perf_counter()
    arrivals = []
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {head!r} {await reader.read()!r}")
        chunked = _Dechunk() if b"chunked" in head.lower() else None
        events = b""
        while True:
            data = await reader.read(65536)
            if not data:
                break
            now = time.perf_counter()
            events += chunked.feed(data) if chunked else data
            *complete, events = events.split(b"\n\n")
            for event in complete:
                at = event.find(b'"text":"')
                if at >= 0 and event[at + 8: at + 9] != b'"':
                    arrivals.append(now)
    finally:
        writer.close()
    end = time.perf_counter()
    return {"ttft": arrivals[0] - t0 if arrivals else None, "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "start": t0, "end": end, "tokens": len(arrivals)}


async def level(port: int, streams: int, requests: int, max_tokens: int, model: str) -> dict:
    gate = asyncio.Semaphore(streams)

    async def gated(i: int) -> dict:
        async with gate:
            return await completion(port, i, max_tokens, model)

    results = await asyncio.gather(*(gated(i) for i in range(requests)))
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    itl = [x for r in results for x in r["itl"]]
    return {"streams": streams, "requests": requests, "wall_s": wall,
            "output_tok_s": sum(r["tokens"] for r in results) / wall,
            "stream_decode_tok_s": 1.0 / statistics.median(itl) if itl else None,
            "ttft_ms": percentiles([r["ttft"] * 1000 for r in results if r["ttft"] is not None]),
            "itl_ms": percentiles([x * 1000 for x in itl])}


def wait_ready(proc: subprocess.Popen, port: int, model: str, timeout: float) -> float:
    """Seconds until a one-token completion succeeds (the server can serve), from now."""
    t0 = time.perf_counter()
    deadline = t0 + timeout
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            r = asyncio.run(completion(port, 0, 1, model))
            if r["tokens"] >= 1:
                return time.perf_counter() - t0
        except (OSError, RuntimeError, asyncio.IncompleteReadError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"the server on port {port} was not ready within {timeout} s")


def server_command(engine: str, path: str, port: int, threads: int, args) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if engine == "llama.cpp":
        return [args.llama_server, "-m", path, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
                "-tb", str(threads), "-np", str(max(args.streams)), "-c", str(args.ctx), "--cont-batching",
                "--no-webui", "--log-disable"], env
    env["OMP_NUM_THREADS"] = str(threads)
    return [sys.executable, "-m", "tallow.cli", "serve", "--model", path, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", "m", "--log-level", "warning", *args.tallow_args], env


def measure(engine: str, path: str, args, torch_s: float) -> dict:
    port = args.port + (engine == "llama.cpp")
    cmd, env = server_command(engine, path, port, args.threads, args)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_ready(proc, port, "m", args.ready_timeout - (time.perf_counter() - t0))
        ready = time.perf_counter() - t0
        rss_loaded = peak_rss_bytes(proc.pid)
        levels = [asyncio.run(level(port, n, args.requests_per_stream * n, args.max_tokens, "m"))
                  for n in args.streams]
        rss = peak_rss_bytes(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = {"engine": engine, "ready_s": ready, "peak_rss_loaded_mb": (rss_loaded or 0) / 2**20,
           "peak_rss_mb": (rss or 0) / 2**20, "levels": levels}
    if engine == "tallow":
        out["ready_after_torch_s"] = ready - torch_s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", action="append", required=True, help="a GGUF file, or 'default' (repeatable)")
    ap.add_argument("--llama-server", default=None, help="the llama-server binary")
    ap.add_argument("--engines", nargs="+", default=["tallow", "llama.cpp"], choices=["tallow", "llama.cpp"],
                    help="which servers to run (one alone: a smoke test, not a race)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--requests-per-stream", type=int, default=2, help="requests per level = this x streams")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="each server per file; the order alternates")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--ctx", type=int, default=32768, help="llama-server's -c (shared by its -np slots)")
    ap.add_argument("--port", type=int, default=8191, help="tallow's; llama-server's is the next")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--tallow-args", nargs=argparse.REMAINDER, default=[],
                    help="extra `tallow serve` options (last on the command line)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if "llama.cpp" in args.engines and not args.llama_server:
        ap.error("--llama-server is required to run llama.cpp")

    files = [default_gguf() if g == "default" else os.path.abspath(g) for g in args.gguf]
    for path in files:  # warm disk: read each file once
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
    torch_s = torch_import_s()
    runs, rows = [], []
    for path in files:
        for r in range(args.rounds):
            order = args.engines if r % 2 == 0 else args.engines[::-1]
            for engine in order:
                res = measure(engine, path, args, torch_s)
                res.update(file=os.path.basename(path), file_mb=os.path.getsize(path) / 2**20, round=r)
                runs.append(res)
                row = {"file": res["file"], "round": r, "engine": engine, "ready s": res["ready_s"],
                       "peak RSS MB": res["peak_rss_mb"]}
                for lv in res["levels"]:
                    row[f"{lv['streams']} streams tok/s"] = lv["output_tok_s"]
                    row[f"{lv['streams']} per-stream tok/s"] = lv["stream_decode_tok_s"]
                rows.append(row)
                print(table([row], list(row)), flush=True)
    print(table(rows, list(rows[0])))
    print(write_json(args.out, {"benchmark": "vs_llamacpp", "torch_import_s": torch_s, "files": files,
                                "streams": args.streams, "max_tokens": args.max_tokens, "threads": args.threads,
                                "runs": runs}))


if __name__ == "__main__":
    main()
