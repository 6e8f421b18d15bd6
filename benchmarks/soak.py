"""Soak: many clients against `tallow serve` for a bounded time, then check that nothing leaked.

Starts `tallow serve` on loopback (nothing else is reachable from here), runs --clients
concurrent clients until --duration has passed, each looping over a mix of requests:
streamed and whole chat and completions, stop strings, n=2, logprobs; 10% of the streamed
ones disconnect after a random number of chunks, 5% of all bodies are malformed. At the end,
with the server idle, it checks:

- no unexpected status (200 for good bodies, 400 for malformed ones) and every completed
  response well formed (JSON shape, one finish per choice, [DONE], usage adds up);
- the KV pool is back to its free block count from the start;
- the server's RSS, less the KV cache's resident part, grew by less than --max-rss-growth
  from after the warm-up to the end (on the CPU the KV pool's pages are mapped as its blocks
  are first used, so the pool's share of RSS grows up to its budget by design: /stats gives
  kv_blocks_touched and kv_block_bytes);
- /metrics equals what the clients counted: finished choices by reason, aborted requests,
  refused requests, prompt tokens (exactly), generated tokens (exactly for completed
  requests; disconnected ones may have produced a few tokens more than they received).

With --attacks, the same load runs in phases of --duration each: first without attackers (the
baseline), then beside each attack named:

- slowloris: --slowloris-sockets sockets each sending a request's headers one byte a second; the
  server must close each within --http-read-timeout (plus a few seconds), and they reconnect;
- big-body: --big-body-clients clients sending, in turn, a 30 MB body with its Content-Length, a
  30 MB chunked body, and an allowed body just under the bound (/stats' limits) of real text that
  is tokenized and found too long for the context: each must answer 400; the server's RSS (less
  the KV pool's resident part) after the phase must be within --max-big-body-rss-mb of before.

and checks, per attack phase, that the normal clients' p99 time to first token (streamed
requests) is within --max-ttft-ratio of the baseline's, besides the checks above.

    python benchmarks/soak.py --duration 300 --clients 64 --out results/soak.json
    python benchmarks/soak.py --duration 120 --clients 32 --attacks slowloris,big-body --out results/soak_attacks.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402

TOPICS = ["the sea", "bread", "mountains", "a library", "rain", "trains", "gardens", "the moon", "bees", "maps"]
STOPS = [".", " the", "\n", ","]
MALFORMED = [
    b'{"messages": [{"role": "user", "content": "hi"}',
    b'{"messages": "hi"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
    b'{"messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "n": 0}',
    b'{"prompt": "hi", "max_tokens": -1}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}',
    b'[1, 2, 3]',
]


@dataclass
class Tally:
    """What the clients saw, to compare with the server's /metrics."""

    statuses: Counter = field(default_factory=Counter)
    unexpected: list = field(default_factory=list)  # (what, status or problem)
    finish_reasons: Counter = field(default_factory=Counter)
    completed: int = 0
    disconnected: int = 0
    malformed_sent: int = 0
    prompt_tokens: int = 0  # completed requests (usage) + disconnected ones (known token-id prompts)
    completion_tokens: int = 0  # completed requests (usage)
    received_by_disconnected: int = 0  # tokens the disconnected clients received before leaving
    max_tokens_of_disconnected: int = 0
    latencies: list = field(default_factory=list)
    phase: str = "baseline"
    ttfts: dict = field(default_factory=dict)  # phase -> seconds to the first chunk of streamed requests
    attackers_refused: int = 0  # attackers' requests answered 400 (counted in the server's refusals)


@dataclass
class AttackTally:
    """What the attackers saw, per attack."""

    sockets_opened: int = 0
    closed_by_server: int = 0
    closed_late: int = 0  # a slowloris socket the server kept past the read timeout (plus slack)
    still_open_at_end: int = 0
    answered_408: int = 0
    connect_failures: int = 0
    statuses: Counter = field(default_factory=Counter)
    unexpected: list = field(default_factory=list)
    rss_before_mb: float | None = None
    rss_after_mb: float | None = None


def loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_choices(choices: list[dict], expected: int, problems: list[str]) -> None:
    if sorted(c["index"] for c in choices) != list(range(expected)):
        problems.append(f"choice indexes {[c['index'] for c in choices]} for {expected} choices")
    for c in choices:
        if c.get("finish_reason") not in ("stop", "length"):
            problems.append(f"finish_reason {c.get('finish_reason')!r}")


def check_usage(usage: dict | None, problems: list[str]) -> None:
    if not usage or usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        problems.append(f"usage {usage}")


async def whole(client: httpx.AsyncClient, path: str, body: dict, n: int, tally: Tally) -> None:
    r = await client.post(path, json=body)
    tally.statuses[r.status_code] += 1
    if r.status_code != 200:
        tally.unexpected.append((path, r.status_code))
        return
    data, problems = r.json(), []
    check_choices(data["choices"], n, problems)
    for c in data["choices"]:
        text = c["message"]["content"] if "message" in c else c["text"]
        if not isinstance(text, str):
            problems.append("no text")
        if body.get("logprobs") and c.get("logprobs") is None:
            problems.append("logprobs missing")
    check_usage(data.get("usage"), problems)
    if problems:
        tally.unexpected.append((path, problems))
        return
    tally.completed += 1
    tally.finish_reasons.update(c["finish_reason"] for c in data["choices"])
    tally.prompt_tokens += data["usage"]["prompt_tokens"]
    tally.completion_tokens += data["usage"]["completion_tokens"]


async def streamed(client: httpx.AsyncClient, path: str, body: dict, n: int, tally: Tally,
                   leave_after: int | None, prompt_len: int) -> None:
    """Stream one request; with leave_after, disconnect after that many chunks."""
    finishes, usage, done, chunks, problems = {}, None, False, 0, []
    sent = time.monotonic()
    async with client.stream("POST", path, json=body) as r:
        tally.statuses[r.status_code] += 1
        if r.status_code != 200:
            tally.unexpected.append((path, r.status_code))
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if chunks == 0:
                tally.ttfts.setdefault(tally.phase, []).append(time.monotonic() - sent)
            if "error" in chunk:
                problems.append(chunk["error"])
            for c in chunk.get("choices", []):
                if c.get("finish_reason"):
                    if c["index"] in finishes:
                        problems.append(f"choice {c['index']} finished twice")
                    finishes[c["index"]] = c["finish_reason"]
            usage = chunk.get("usage") or usage
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                tally.disconnected += 1
                tally.prompt_tokens += prompt_len
                tally.received_by_disconnected += chunks
                tally.max_tokens_of_disconnected += body["max_tokens"]
                return  # leaving the block closes the connection mid-stream
    check_choices([{"index": i, "finish_reason": f} for i, f in finishes.items()], n, problems)
    check_usage(usage, problems)
    if not done:
        problems.append("no [DONE]")
    if problems:
        tally.unexpected.append((path, problems))
        return
    tally.completed += 1
    tally.finish_reasons.update(finishes.values())
    tally.prompt_tokens += usage["prompt_tokens"]
    tally.completion_tokens += usage["completion_tokens"]


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally, max_tokens: int) -> None:
    if rng.random() < 0.05:
        tally.malformed_sent += 1
        path = rng.choice(["/v1/chat/completions", "/v1/completions"])
        r = await client.post(path, content=rng.choice(MALFORMED), headers={"content-type": "application/json"})
        tally.statuses[r.status_code] += 1
        if r.status_code != 400:
            tally.unexpected.append(("malformed", r.status_code))
        return
    stream = rng.random() < 0.5
    if stream and rng.random() < 0.10:
        # Disconnects: a token-id prompt (its length is known) that cannot end before the client leaves.
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(4, 40))]
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        await streamed(client, "/v1/completions", body, 1, tally, rng.randrange(1, max_tokens // 2), len(prompt))
        return
    n = 2 if rng.random() < 0.2 else 1
    body = {"max_tokens": rng.randrange(max_tokens // 4, max_tokens + 1), "n": n,
            "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randrange(1 << 30)}
    if rng.random() < 0.3:
        body["stop"] = rng.sample(STOPS, rng.randrange(1, 3))
    topic = rng.choice(TOPICS)
    if rng.random() < 0.6:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"Write two sentences about {topic}."}]
        if rng.random() < 0.2:
            body.update(logprobs=True, top_logprobs=2)
    else:
        path = "/v1/completions"
        body["prompt"] = f"A short story about {topic}:"
        if rng.random() < 0.2:
            body["logprobs"] = 2
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
        await streamed(client, path, body, n, tally, None, 0)
    else:
        await whole(client, path, body, n, tally)


async def client_loop(url: str, seed: int, deadline: float, tally: Tally, max_tokens: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            await one_request(client, rng, tally, max_tokens)
            tally.latencies.append(time.monotonic() - t0)


def scrape(url: str) -> dict:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_idle(url: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(url + "/stats").json()
        if (stats["engine"]["running"] == stats["engine"]["waiting"] == 0 and stats["requests"]["in_flight"] == 0) \
                or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = loopback_port()
    cmd = [sys.executable, "-m", "tallow.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", args.model, "--log-level", "warning", "--http-read-timeout", str(args.http_read_timeout)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(args.server_log, "w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not start; see {args.server_log}")


async def soak(url: str, args, tally: Tally, server: psutil.Process) -> dict:
    start = time.monotonic()
    phases = ["baseline", *args.attacks]
    attacks: dict[str, AttackTally] = {}
    run: dict = {}
    for k, phase in enumerate(phases):
        tally.phase = "warmup" if k == 0 else phase  # TTFTs of the warm-up are kept apart
        deadline = time.monotonic() + args.duration
        attack = attacks[phase] = AttackTally() if phase != "baseline" else None
        if phase == "big-body":
            await asyncio.to_thread(wait_idle, url)
            attack.rss_before_mb = (server.memory_info().rss - await asyncio.to_thread(kv_resident, url)) / 2**20
        tasks = [asyncio.create_task(client_loop(url, args.seed + 1000 * k + i, deadline, tally, args.max_tokens))
                 for i in range(args.clients)]
        if phase == "slowloris":
            tasks += [asyncio.create_task(slowloris(url, deadline, args, attack)) for _ in range(args.slowloris_sockets)]
        elif phase == "big-body":
            limits = (await asyncio.to_thread(httpx.get, url + "/stats")).json()["limits"]
            tasks += [asyncio.create_task(big_bodies(url, deadline, limits, attack, tally))
                      for _ in range(args.big_body_clients)]
        if k == 0:
            await asyncio.sleep(min(args.warmup, args.duration / 5))
            run["rss_after_warmup"] = server.memory_info().rss
            run["kv_after_warmup"] = await asyncio.to_thread(kv_resident, url)
            tally.phase = phase
        await asyncio.gather(*tasks)
        if phase == "big-body":
            await asyncio.to_thread(wait_idle, url)
            await asyncio.sleep(2.0)  # the heap trim after the last big request runs in a thread
            attack.rss_after_mb = (server.memory_info().rss - await asyncio.to_thread(kv_resident, url)) / 2**20
    return {**run, "wall_s": time.monotonic() - start, "attacks": attacks}


SLOWLORIS_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"


async def slowloris(url: str, deadline: float, args, attack: AttackTally) -> None:
    """One attacker: a socket sending a request's headers one byte a second, until the server
    closes it (then a new one) or the phase ends."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    limit = args.http_read_timeout + args.slowloris_slack
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            attack.connect_failures += 1
            await asyncio.sleep(1.0)
            continue
        opened = time.monotonic()
        attack.sockets_opened += 1
        received, closed, sent = b"", False, 0
        header = SLOWLORIS_HEAD + b"X-Slow: " + b"a" * 100_000
        try:
            while time.monotonic() < deadline:
                writer.write(header[sent:sent + 1])
                sent += 1
                try:
                    chunk = await asyncio.wait_for(reader.read(65536), 1.0)
                except asyncio.TimeoutError:
                    continue
                if not chunk:
                    closed = True
                    break
                received += chunk
        except (ConnectionError, OSError):
            closed = True
        finally:
            writer.close()
        if closed:
            attack.closed_by_server += 1
            attack.answered_408 += received.startswith(b"HTTP/1.1 408")
            if received and not received.startswith(b"HTTP/1.1 408"):
                attack.unexpected.append(("slowloris answer", received[:80].decode(errors="replace")))
            if time.monotonic() - opened > limit:
                attack.closed_late += 1
        else:
            attack.still_open_at_end += 1
            if time.monotonic() - opened > limit:
                attack.closed_late += 1


BIG_WORDS = "the quick brown fox jumps over the lazy dog while seven bakers sing of rivers "


async def big_bodies(url: str, deadline: float, limits: dict, attack: AttackTally, tally: Tally) -> None:
    """One attacker: 30 MB bodies (declared, then chunked) and an allowed body of text that is too
    long for the context, in turn; every one must answer 400."""
    bound = limits["body_bytes"]["/v1/chat/completions"]
    huge = b'{"messages": [{"role": "user", "content": "' + b"x" * (30 * 2**20) + b'"}]}'
    allowed_text = BIG_WORDS * ((bound - 64 * 1024) // len(BIG_WORDS))
    allowed = json.dumps({"messages": [{"role": "user", "content": allowed_text}], "max_tokens": 4}).encode()
    assert len(allowed) < bound

    def chunked():
        for i in range(0, len(huge), 1 << 20):
            yield huge[i:i + (1 << 20)]

    headers = {"content-type": "application/json"}
    kinds = ["declared", "chunked", "allowed"]
    k = 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        while time.monotonic() < deadline:
            kind = kinds[k % len(kinds)]
            k += 1
            content = {"declared": huge, "allowed": allowed}.get(kind)
            try:
                if kind == "chunked":
                    r = await client.post("/v1/chat/completions", content=_aiter(chunked()), headers=headers)
                else:
                    r = await client.post("/v1/chat/completions", content=content, headers=headers)
            except httpx.TransportError as e:
                attack.unexpected.append((kind, repr(e)))
                continue
            attack.statuses[f"{kind} {r.status_code}"] += 1
            if r.status_code == 400:
                tally.attackers_refused += 1
            else:
                attack.unexpected.append((kind, r.status_code))


async def _aiter(chunks):
    for chunk in chunks:
        yield chunk


def kv_resident(url: str) -> int:
    """Bytes of the KV pool the server has touched (resident on the CPU)."""
    engine = httpx.get(url + "/stats").json()["engine"]
    return engine["kv_blocks_touched"] * engine["kv_block_bytes"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (at most 3600)")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (at most 256)")
    p.add_argument("--model", default="default")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warmup", type=float, default=30.0, help="seconds before the RSS baseline is taken")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-log", default="soak_server.log")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--attacks", default="", help="comma-separated attack phases after a baseline phase: "
                                                 "slowloris, big-body (each runs --duration)")
    p.add_argument("--slowloris-sockets", type=int, default=200)
    p.add_argument("--slowloris-slack", type=float, default=5.0,
                   help="seconds past --http-read-timeout a slow socket may stay open")
    p.add_argument("--http-read-timeout", type=float, default=30.0, help="passed to tallow serve")
    p.add_argument("--big-body-clients", type=int, default=1)
    p.add_argument("--max-ttft-ratio", type=float, default=2.0,
                   help="normal clients' p99 TTFT under attack, at most this times the baseline's")
    p.add_argument("--max-big-body-rss-mb", type=float, default=300.0)
    args = p.parse_args()
    args.attacks = [a for a in args.attacks.split(",") if a]
    if not 0 < args.duration <= 3600 or not 0 < args.clients <= 256:
        p.error("--duration must be in (0, 3600] and --clients in (0, 256]")
    if any(a not in ("slowloris", "big-body") for a in args.attacks):
        p.error("--attacks takes slowloris and big-body")

    proc, url = start_server(args)
    try:
        server = psutil.Process(proc.pid)
        free_at_start = httpx.get(url + "/stats").json()["engine"]["kv_blocks_free"]
        before = scrape(url)
        tally = Tally()
        run = asyncio.run(soak(url, args, tally, server))
        stats = wait_idle(url)
        after = scrape(url)
        rss_end = server.memory_info().rss
        kv_end = kv_resident(url)
    finally:
        proc.terminate()
        proc.wait(60)

    def moved(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    generated = moved("vllm:generation_tokens_total")
    extra_generated = generated - tally.completion_tokens
    checks = {
        "no unexpected statuses or responses": not tally.unexpected,
        "KV pool back to its start": stats["engine"]["kv_blocks_free"] == free_at_start,
        "RSS growth under the limit": rss_end - kv_end
        <= (run["rss_after_warmup"] - run["kv_after_warmup"]) * (1 + args.max_rss_growth),
        "finished choices by reason": all(moved("vllm:request_success_total", finished_reason=r) == k
                                          for r, k in tally.finish_reasons.items())
        and sum(v for (name, _), v in after.items() if name == "vllm:request_success_total")
        - sum(v for (name, _), v in before.items() if name == "vllm:request_success_total")
        == sum(tally.finish_reasons.values()),
        "aborted requests": moved("tallow:requests_aborted_total") == tally.disconnected,
        "refused (malformed) requests": moved("tallow:requests_rejected_total", reason="invalid")
        == tally.malformed_sent + tally.attackers_refused,
        "prompt tokens": moved("vllm:prompt_tokens_total") == tally.prompt_tokens,
        "generated tokens": tally.received_by_disconnected <= extra_generated <= tally.max_tokens_of_disconnected,
    }
    def p99(values: list) -> float | None:
        return sorted(values)[int(0.99 * (len(values) - 1))] if values else None

    ttft_p99 = {phase: p99(values) for phase, values in tally.ttfts.items()}
    baseline = ttft_p99.get("baseline")
    for phase, attack in run["attacks"].items():
        if attack is None:
            continue
        checks[f"{phase}: normal p99 TTFT within {args.max_ttft_ratio}x of the baseline"] = (
            baseline is not None and ttft_p99.get(phase) is not None
            and ttft_p99[phase] <= args.max_ttft_ratio * baseline)
        checks[f"{phase}: attackers saw only what they should"] = not attack.unexpected
        if phase == "slowloris":
            checks["slowloris: every slow socket closed within the read timeout"] = (
                attack.closed_late == 0 and attack.closed_by_server > 0)
        if phase == "big-body":
            checks[f"big-body: RSS back within {args.max_big_body_rss_mb:g} MB"] = (
                attack.rss_after_mb - attack.rss_before_mb <= args.max_big_body_rss_mb)
    requests = sum(tally.statuses.values())
    results = {
        "duration_s": args.duration, "clients": args.clients, "wall_s": run["wall_s"], "requests": requests,
        "statuses": dict(tally.statuses), "completed": tally.completed, "disconnected": tally.disconnected,
        "malformed_sent": tally.malformed_sent, "finish_reasons": dict(tally.finish_reasons),
        "prompt_tokens": tally.prompt_tokens, "completion_tokens": tally.completion_tokens,
        "generated_tokens_metric": generated, "generated_by_disconnected": extra_generated,
        "kv_blocks_free_start": free_at_start, "kv_blocks_free_end": stats["engine"]["kv_blocks_free"],
        "rss_after_warmup_mb": run["rss_after_warmup"] / 2**20, "rss_end_mb": rss_end / 2**20,
        "kv_resident_after_warmup_mb": run["kv_after_warmup"] / 2**20, "kv_resident_end_mb": kv_end / 2**20,
        "rss_growth": rss_end / run["rss_after_warmup"] - 1,
        "rss_growth_without_kv": (rss_end - kv_end) / (run["rss_after_warmup"] - run["kv_after_warmup"]) - 1,
        "request_latency_p50_s": sorted(tally.latencies)[len(tally.latencies) // 2] if tally.latencies else None,
        "output_tokens_per_s": generated / run["wall_s"], "unexpected": tally.unexpected[:20],
        "ttft_p99_s": ttft_p99, "ttft_p50_s": {phase: sorted(v)[len(v) // 2] for phase, v in tally.ttfts.items() if v},
        "attacks": {phase: {**attack.__dict__, "statuses": dict(attack.statuses), "unexpected": attack.unexpected[:20]}
                    for phase, attack in run["attacks"].items() if attack is not None},
        "checks": checks,
    }
    print(table([{"check": k, "ok": "yes" if v else "NO"} for k, v in checks.items()], ["check", "ok"]))
    print(table([{k: results[k] for k in ("requests", "completed", "disconnected", "malformed_sent",
                                         "completion_tokens", "output_tokens_per_s", "rss_growth",
                                         "rss_growth_without_kv")}],
                ["requests", "completed", "disconnected", "malformed_sent", "completion_tokens",
                 "output_tokens_per_s", "rss_growth", "rss_growth_without_kv"]))
    print(write_json(args.out, results))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
