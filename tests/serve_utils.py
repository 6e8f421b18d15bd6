"""Test helpers for the serving layer: a scripted fake engine that follows the AsyncEngine
contract, and a live uvicorn server in a background thread."""

from __future__ import annotations

import asyncio
import hashlib
import re
import socket
import threading
import time

import numpy as np
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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for piece in self._special_re.split(text):
            ids += [self.SPECIALS[piece]] if piece in self.SPECIALS else list(piece.encode())
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
    """A scripted model behind the AsyncEngine contract.

    Greedy decoding continues SCRIPT from a prompt-dependent character offset (the scripted
    byte gets logit 5, the others small noise), and ends with eos after the script; sampling
    draws from the softmax with a per-sibling numpy generator (seed + sibling index when
    seeded); with `reply`, greedy decoding says exactly that. Honours max_tokens, stop_token_ids, ignore_eos, min_tokens, logit_bias and
    logprobs; simulates a prefix cache over 16-token blocks; emits one token per `interval`.
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
        self.reply = reply  # a fixed greedy reply instead of SCRIPT from a prompt-dependent offset
        self.ready = True
        self.running: set[FakeStream] = set()
        self.waiting: set[FakeStream] = set()
        self.cached_blocks: set[bytes] = set()
        self.submitted: list[tuple[list[int], SamplingParams]] = []

    def submit(self, prompt_ids, params, request_id=None):
        self.submitted.append((list(prompt_ids), params))
        return [FakeStream(self, list(prompt_ids), params, j, request_id or "req") for j in range(params.n)]

    def generate(self, prompt_ids, params, request_id=None):
        return self.submit(prompt_ids, params, request_id)[0]

    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting), "kv_blocks_total": 1024,
                "kv_blocks_free": 1024, "prefix_cache_hit_rate": 0.0, "num_preemptions": 0}

    async def shutdown(self) -> None:
        for stream in list(self.running | self.waiting):
            stream.abort()

    def greedy_text(self, prompt_ids: list[int], num_tokens: int) -> str:
        """What greedy decoding of num_tokens tokens decodes to (eos aside)."""
        return self.script_bytes(prompt_ids)[:num_tokens].decode(errors="replace")

    def script_bytes(self, prompt_ids: list[int]) -> bytes:
        if self.reply is not None:
            return self.reply.encode()
        offset = int(hashlib.sha256(bytes(str(prompt_ids), "ascii")).hexdigest(), 16) % len(SCRIPT)
        return SCRIPT[offset:].encode()

    def cached_prefix(self, prompt_ids: list[int]) -> int:
        cached = 0
        for end in range(self.block_size, len(prompt_ids), self.block_size):
            key = hashlib.sha256(bytes(str(prompt_ids[:end]), "ascii")).digest()
            if key not in self.cached_blocks:
                self.cached_blocks.add(key)
                break
            cached = end
        for end in range(cached + self.block_size, len(prompt_ids), self.block_size):
            self.cached_blocks.add(hashlib.sha256(bytes(str(prompt_ids[:end]), "ascii")).digest())
        return cached


class FakeStream:
    def __init__(self, engine: FakeEngine, prompt_ids, params: SamplingParams, sibling: int, request_id: str):
        self.engine, self.prompt_ids, self.params = engine, prompt_ids, params
        self.request_id = request_id
        seed = None if params.seed is None else params.seed + sibling
        self.rng = np.random.default_rng(seed)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        self.num_cached = 0
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
        self.queue.put_nowait(TokenOutput(ids, logprobs, top, reason, len(self.prompt_ids), self.num_cached))

    async def _run(self) -> None:
        engine, p = self.engine, self.params
        while len(engine.running) >= engine.max_num_seqs:
            await asyncio.sleep(engine.interval)
        engine.waiting.discard(self)
        engine.running.add(self)
        self.num_cached = engine.cached_prefix(self.prompt_ids)
        script = engine.script_bytes(self.prompt_ids)
        limit = min(p.max_tokens or engine.max_model_len, engine.max_model_len - len(self.prompt_ids))
        for k in range(limit):
            await asyncio.sleep(engine.interval)
            logits = np.random.default_rng(k).normal(0.0, 0.5, 258)
            logits[script[k] if k < len(script) else 257] += 5.0
            for token_id, bias in (p.logit_bias or {}).items():
                logits[token_id] += bias
            if k < p.min_tokens or p.ignore_eos:
                logits[257] = -np.inf
            logprobs = logits - np.logaddexp.reduce(logits)
            if p.greedy:
                token = int(np.argmax(logits))
            else:
                probs = np.exp((logprobs / p.temperature) - np.logaddexp.reduce(logprobs / p.temperature))
                token = int(self.rng.choice(258, p=probs / probs.sum()))
            top = None
            if p.logprobs:
                best = np.argsort(-logprobs)[:p.logprobs]
                top = [[(int(t), float(logprobs[t])) for t in best]]
            chosen = [float(logprobs[token])] if p.logprobs is not None else None
            stop = token == 257 and not p.ignore_eos or token in p.stop_token_ids
            if stop or k == limit - 1:
                self._finish([token], chosen, top, "stop" if stop else "length")
                return
            self._put([token], chosen, top, None)


class LiveServer:
    """uvicorn serving build_app(engine, config) on a free port, in a background thread."""

    def __init__(self, engine, config: ServerConfig | None = None):
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
