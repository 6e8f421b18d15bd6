"""Shared by the grammar tests (tool calls, closed schemas, custom tools): the default model's
tokenizer and its llguidance form as module fixtures (import them into a test module), a
matcher, and a random walk through what a grammar allows, with llguidance as the reference."""

from __future__ import annotations

import random

import numpy as np
import pytest

llguidance = pytest.importorskip("llguidance")

from tallow.models.loader import default_model_path  # noqa: E402
from tallow.tokenizer import Tokenizer, read_gguf_tokenizer_metadata  # noqa: E402


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(default_model_path()))


@pytest.fixture(scope="module")
def lltok(tok):
    return llguidance.LLTokenizer(tok.backend.to_str(), eos_token=tok.eos_token_id)


def matcher(lltok, kind: str, text: str):
    m = llguidance.LLMatcher(lltok, llguidance.grammar_from(kind, text), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def random_walk(lltok, tok, kind: str, grammar: str, rng: random.Random, *, max_steps: int = 300,
                eos_p: float = 0.35, short: int = 8) -> str | None:
    """A text the grammar allows: a random allowed token at each step (one of the `short` shortest
    half the time, so strings and numbers end), ending where the grammar lets it (eos with
    probability eos_p) or must; None when the walk does not end in max_steps."""
    m = matcher(lltok, kind, grammar)
    eos = tok.eos_token_id
    ids: list[int] = []
    for _ in range(max_steps):
        if m.is_stopped():
            break
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:lltok.vocab_size]).tolist()
        if eos in allowed and (rng.random() < eos_p or allowed == [eos]):
            break
        allowed = [i for i in allowed if i != eos]
        token = rng.choice(allowed if rng.random() < 0.5 else sorted(allowed, key=lambda i: len(tok.token_bytes(i)))[:short])
        assert m.consume_token(token), m.get_error()
        ids.append(token)
    else:
        return None
    assert m.is_accepting()
    return tok.decode(ids, skip_special_tokens=False)
