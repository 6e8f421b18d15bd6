"""Poisoned requests: numeric edge values that used to pass validation and then raised inside the
engine step, failing every request of the batch with a 500 (seed >= 2**64, top_k >= 2**63, top_p
that is 0 as a float32, repetition_penalty 1e-300 with logprobs, JSON NaN / Infinity literals).

Each is sent into a running batch of three ordinary greedy requests on the real default model: the
poisoned one answers a 400 naming its field (or, where the value is valid, completes), and the
others finish with 200 and the text they give alone. A row whose logits are not finite (forced
here) fails alone, on the CPU engine's synchronous and asynchronous steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import httpx
import pytest
import torch

from tallow.config import EngineConfig
from tallow.engine.core import EngineCore
from tallow.engine.sampler import Sampler
from tallow.engine.sampling import SamplingParams

ORDINARY = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
MAX_TOKENS = 40


def ordinary_body(prompt: str, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}


async def _stream_text(client: httpx.AsyncClient, prompt: str, started: asyncio.Event) -> tuple[int, str]:
    text = ""
    async with client.stream("POST", "/v1/completions", json=ordinary_body(prompt, True)) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return 500, json.dumps(chunk)
            text += chunk["choices"][0]["text"]
            started.set()
    return 200, text


@pytest.fixture(scope="module")
def alone(real_server) -> dict[str, str]:
    """Each ordinary prompt's greedy text, sent alone."""
    out = {}
    for prompt in ORDINARY:
        r = httpx.post(real_server.base_url + "/v1/completions", json=ordinary_body(prompt, False), timeout=120)
        assert r.status_code == 200, r.text
        out[prompt] = r.json()["choices"][0]["text"]
    return out


# (route, body or raw JSON text, expected status, the field a 400 names)
POISONED = [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "seed": 2**64, "temperature": 1}, 400, "seed"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "seed": -(2**63) - 1, "temperature": 1}, 400, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "seed": 2**64},
     400, "seed"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "top_k": 2**63, "temperature": 1}, 400, "top_k"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "top_p": 1e-46, "temperature": 1}, 400, "top_p"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "repetition_penalty": 1e-300, "logprobs": 1}, 400,
     "repetition_penalty"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "repetition_penalty": 1e-300, "logprobs": 1,
                         "stream": True}, 400, "repetition_penalty"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 4, "repetition_penalty": Infinity}', 400,
     "repetition_penalty"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', 400,
     "temperature"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"5": -Infinity}}',
     400, "logit_bias.5"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "logit_bias": {"1_000": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "logit_bias": {" 7 ": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "logit_bias": {"\u0663": 1}}, 400, "logit_bias"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "top_k": 2**63}, 400,
     "top_k"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "top_p": 1e-46}, 400,
     "top_p"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 4, "top_p": 1e-46}, 400, "top_p"),
    # Valid values at the edges: they complete.
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "top_k": 10**9, "temperature": 1, "seed": 2**63 - 1,
                         "n": 2}, 200, None),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "seed": -(2**63), "temperature": 1}, 200, None),
    ("/v1/completions", {"prompt": "Hi Hi Hi", "max_tokens": 4, "repetition_penalty": 1e-30, "logprobs": 2,
                         "stream": True}, 200, None),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "min_p": 1e-46, "top_p": 1e-30, "temperature": 1e-300},
     200, None),
]


def _check_answer(route, body, status, param, r: httpx.Response, text: str) -> None:
    assert r.status_code == status, (route, body, text)
    if status == 400:
        error = r.json()["error"]
        if route == "/v1/messages":
            assert r.json()["type"] == "error" and param in error["message"], text
        else:
            assert error["param"] == param and error["type"] == "invalid_request_error", text
    elif isinstance(body, dict) and body.get("stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        assert events
        for data in events:  # valid JSON only: no NaN or Infinity
            chunk = json.loads(data, parse_constant=lambda c: pytest.fail(f"{c} in a stream: {data}"))
            assert "error" not in chunk
    else:
        json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in a body: {text}"))


def test_poisoned_requests_in_a_running_batch(real_server, alone):
    """Every poisoned request goes into one running batch of three ordinary streams (sent one
    after another; the valid ones run in the batch); the three finish with their text alone."""
    async def send(client, route, body):
        if isinstance(body, str):
            r = await client.post(route, content=body, headers={"content-type": "application/json"})
        else:
            r = await client.post(route, json=body)
        return r, (await r.aread()).decode()

    async def main():
        async with httpx.AsyncClient(base_url=real_server.base_url, timeout=120) as client:
            started = [asyncio.Event() for _ in ORDINARY]
            others = [asyncio.create_task(_stream_text(client, p, e)) for p, e in zip(ORDINARY, started)]
            # The batch runs: every ordinary request has its first tokens.
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            answers = [await send(client, route, body) for route, body, status, _ in POISONED if status == 400]
            answers += await asyncio.gather(*(send(client, route, body)
                                              for route, body, status, _ in POISONED if status != 400))
            return answers, await asyncio.gather(*others)

    answers, others = asyncio.run(main())
    cases = [c for c in POISONED if c[2] == 400] + [c for c in POISONED if c[2] != 400]
    for (route, body, status, param), (r, text) in zip(cases, answers):
        _check_answer(route, body, status, param, r, text)
    assert [s for s, _ in others] == [200] * len(ORDINARY), others
    assert [t for _, t in others] == [alone[p] for p in ORDINARY]


# ---- a non-finite row fails alone ------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_non_finite_row_fails_alone(default_model, monkeypatch, async_scheduling):
    """The sampler flags a row whose processed logits are NaN (forced here from the 3rd output
    token of one sequence); that sequence ends with "error" and no further token while the
    others, greedy and sampled, give the tokens they give without it."""
    cfg = dataclasses.replace(EngineConfig(model="default", device="cpu"), quantization="none",
                              async_scheduling=async_scheduling)
    core = EngineCore(cfg, loaded=default_model)
    tok = core.tokenizer
    prompts = [tok.encode(p) for p in ORDINARY + ["Water boils at"]]
    params = [SamplingParams(max_tokens=10, temperature=0), SamplingParams(max_tokens=10, temperature=0),
              SamplingParams(max_tokens=10, temperature=0.8, seed=7, top_p=0.9, logprobs=2),
              SamplingParams(max_tokens=10, temperature=0.8, seed=3, top_p=0.5, logprobs=2)]

    def run(poison: bool):
        seqs = [core.make_sequences(ids, p)[0] for ids, p in zip(prompts, params)]
        victim = seqs[3]
        original = Sampler.process_logits

        def process_logits(self, logits, batch, plan=None):
            out = original(self, logits, batch, plan)
            if poison and victim in batch and victim.num_output_tokens >= 2:
                out = out.clone()
                out[batch.index(victim)] = math.nan
            return out

        monkeypatch.setattr(Sampler, "process_logits", process_logits)
        outputs = {s.seq_id: [] for s in seqs}
        finish = {}
        for s in seqs:
            core.add(s)
        while core.has_work():
            for seq, out in core.step():
                outputs[seq.seq_id] += out.token_ids
                if out.logprobs:
                    assert all(math.isfinite(x) for x in out.logprobs)
                if out.finish_reason is not None:
                    finish[seq.seq_id] = out.finish_reason
        return [outputs[s.seq_id] for s in seqs], [finish[s.seq_id] for s in seqs]

    clean_tokens, clean_finish = run(False)
    tokens, finish = run(True)
    assert finish[:3] == clean_finish[:3] and "error" not in finish[:3]
    assert tokens[:3] == clean_tokens[:3]
    assert finish[3] == "error"
    assert tokens[3] == clean_tokens[3][:2]  # the tokens before the poisoned step, then none
    core.scheduler.check_invariants()
    assert core.kv.num_free_blocks == core.runner.num_blocks or core.kv.enable_prefix_caching
