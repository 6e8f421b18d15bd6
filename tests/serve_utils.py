"""Test helpers for the serving layer: a fake engine for pacing and capacity that follows the
AsyncEngine contract, the real engine on the default model or on a replay: script, a live
uvicorn server in a background thread, and waiting on a condition under a deadline."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from tallow.config import ServerConfig
from tallow.engine.core import TokenOutput
from tallow.engine.sampling import SamplingParams
from tallow.models.config import ModelConfig
from tallow.serve.app import build_app

# What the fake model says, from an offset that depends on the prompt: ASCII, accents, CJK, emoji.
SCRIPT = ("Sure! Here is a short answer about naïve café culture in 日本 and 中国 🙂🎉. "
          "The quick brown fox jumps over the lazy dog, then rests. ")


class ByteTokenizer:
    """Token i < 256 is byte i, so every multi-byte character spans several tokens;
    256 and 257 are the special tokens <|im_start|> and <|im_end|> (eos)."""

    SPECIALS = {"<|im_start|>": 256, "<|im_end|>": 257}
    vocab_size = 258
    bos_token, eos_token = "<|im_start|>", "<|im_end|>"
    bos_token_id, eos_token_id, pad_token_id = 256, 257, None
    eos_token_ids = frozenset({257})
    special_token_ids = frozenset({256, 257})
    chat_template = "ChatML"
    add_bos = False
    _special_re = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")

    special_tokens = tuple(SPECIALS)

    def encode(self, text: str, add_special_tokens: bool = False, literal_spans=()) -> list[int]:
        ids, done = [], 0
        for start, end in [*literal_spans, (len(text), len(text))]:  # spans: plain bytes
            for piece in self._special_re.split(text[done:start]):
                ids += [self.SPECIALS[piece]] if piece in self.SPECIALS else list(piece.encode())
            ids += list(text[start:end].encode())
            done = end
        return ids

    def token_to_id(self, token: str) -> int | None:
        return self.SPECIALS.get(token)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < 256:
            return bytes([token_id])
        return next(s for s, i in self.SPECIALS.items() if i == token_id).encode()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return b"".join(b"" if skip_special_tokens and i in self.special_token_ids else self.token_bytes(i)
                        for i in ids).decode(errors="replace")


class ChatMLTemplate:
    def render(self, messages, tools=None, add_generation_prompt=True, **kwargs) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class FakeEngine:
    """Pacing and capacity behind the AsyncEngine contract, for the tests of the serving layer
    itself (admission, backpressure, disconnects, metrics, validation): one token every
    `interval` seconds, at most max_num_seqs sequences running (the rest wait), and what was
    submitted recorded in `submitted`.

    Every sequence says the same thing: the bytes of `reply` (SCRIPT unless given), then eos;
    past the reply (ignore_eos, min_tokens) the reply starts again. It honours max_tokens, the
    model length and stop_token_ids, and reports logprob 0 for its token (with placeholders
    for the other top entries). It has no sampling, no logits and no prefix cache: what a
    model says, sampling and caching are tested on the real engine (the replay: source).
    """

    block_size = 16

    def __init__(self, max_model_len: int = 1024, max_num_seqs: int = 8, interval: float = 0.002,
                 reply: str | None = None):
        self.tokenizer = ByteTokenizer()
        self.chat_template = ChatMLTemplate()
        self.model_config = ModelConfig("llama", 258, 64, 128, 2, 4, 2, 16)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.model_name = "fake-model"
        self.interval = interval
        self.reply = (SCRIPT if reply is None else reply).encode()
        self.ready = True
        self.running: set[FakeStream] = set()
        self.waiting: set[FakeStream] = set()
        self.submitted: list[tuple[list[int], SamplingParams]] = []

    def submit(self, prompt_ids, params, request_id=None):
        self.submitted.append((list(prompt_ids), params))
        return [FakeStream(self, list(prompt_ids), params, request_id or "req") for _ in range(params.n)]

    def generate(self, prompt_ids, params, request_id=None):
        return self.submit(prompt_ids, params, request_id)[0]

    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting), "kv_blocks_total": 1024,
                "kv_blocks_free": 1024, "prefix_cache_hit_rate": 0.0, "num_preemptions": 0}

    async def shutdown(self) -> None:
        for stream in list(self.running | self.waiting):
            stream.abort()


class FakeStream:
    def __init__(self, engine: FakeEngine, prompt_ids, params: SamplingParams, request_id: str):
        self.engine, self.prompt_ids, self.params = engine, prompt_ids, params
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        engine.waiting.add(self)
        self.task = asyncio.get_running_loop().create_task(self._run())

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.done and self.queue.empty():
            raise StopAsyncIteration
        return await self.queue.get()

    def abort(self) -> None:
        if not self.done:
            self.task.cancel()
            self._finish([], None, None, "abort")

    def _finish(self, ids, logprobs, top, reason) -> None:
        self.done = True
        self.engine.running.discard(self)
        self.engine.waiting.discard(self)
        self._put(ids, logprobs, top, reason)

    def _put(self, ids, logprobs, top, reason) -> None:
        self.queue.put_nowait(TokenOutput(ids, logprobs, top, reason, len(self.prompt_ids), 0))

    async def _run(self) -> None:
        engine, p = self.engine, self.params
        while len(engine.running) >= engine.max_num_seqs:
            await asyncio.sleep(engine.interval)
        engine.waiting.discard(self)
        engine.running.add(self)
        reply = engine.reply
        limit = min(p.max_tokens or engine.max_model_len, engine.max_model_len - len(self.prompt_ids))
        for k in range(limit):
            await asyncio.sleep(engine.interval)
            if k < len(reply):
                token = reply[k]
            elif k >= p.min_tokens and not p.ignore_eos:
                token = 257  # eos
            else:
                token = reply[k % len(reply)] if reply else 32
            chosen = top = None
            if p.logprobs is not None:
                chosen = [0.0]
                if p.logprobs:
                    others = [t for t in range(p.logprobs) if t != token][:p.logprobs - 1]
                    top = [[(token, 0.0)] + [(t, -20.0 - i) for i, t in enumerate(others)]]
            stop = token == 257 or token in p.stop_token_ids
            if stop or k == limit - 1:
                self._finish([token], chosen, top, "stop" if stop else "length")
                return
            self._put([token], chosen, top, None)


def engine_idle(engine) -> bool:
    """No sequence running or waiting."""
    stats = engine.stats()
    return stats["running"] == 0 and stats["waiting"] == 0


class LiveServer:
    """uvicorn serving build_app(engine, config) on a free port, in a background thread."""

    def __init__(self, engine, config: ServerConfig | None = None):
        self.engine = engine
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.config = config or ServerConfig(port=port)
        self.config.port = port
        self.app = build_app(engine, self.config)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.base_url = f"http://127.0.0.1:{port}"
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(5)


def start_real_engine():
    """The default model on the real engine; skips the calling test while its parts are still missing.

    Dense weights: the serving tests compare texts across batch shapes (streamed vs whole,
    concurrent vs one at a time, n siblings), which needs batch-invariant greedy decoding.
    """
    import pytest

    from tallow.config import EngineConfig
    from tallow.engine.async_engine import AsyncEngine

    try:
        engine = AsyncEngine.from_config(EngineConfig(model="default", max_num_seqs=16, quantization="none"))
    except ImportError as e:
        pytest.skip(f"the real engine cannot start yet: {e}")
    return engine


AGENT_REPLAY_SCRIPT = Path(__file__).parent / "data" / "replay_agents.json"


def scripted_reply(match: str | None, script: Path = AGENT_REPLAY_SCRIPT) -> str:
    """The reply a replay script gives to a prompt with `match` in it (None: its fallback)."""
    return next(e["reply"] for e in json.loads(script.read_text())["replies"] if e.get("match") == match)


def replay_engine(script, **overrides):
    """The real engine on the replay: test fixture model (tallow/testing/replay.py). script: a path,
    or the script itself (a list of replies or a dict), written to a temporary file."""
    import tempfile

    import tallow.testing  # noqa: F401  (registers the replay: model source)
    from tallow.config import EngineConfig
    from tallow.engine.async_engine import AsyncEngine

    if not isinstance(script, (str, os.PathLike)):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
            json.dump(script, f)
        script = f.name
    return AsyncEngine.from_config(EngineConfig(model=f"replay:{script}", **{"quantization": "none", **overrides}))


@contextmanager
def replay_server(script, **overrides):
    """A LiveServer over replay_engine(script); the engine is shut down when the block ends."""
    engine = replay_engine(script, **overrides)
    with LiveServer(engine) as live:
        yield live
    asyncio.run(engine.shutdown())
