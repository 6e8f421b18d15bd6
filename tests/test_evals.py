"""lm-eval against a live tallow server (tier `evals`: `make test-evals` installs lm-eval).

A local multiple-choice task (tests/data/evals/tallow_mc.yaml over tallow_mc.jsonl: nothing is
downloaded) runs through lm-eval's `local-completions` model, whose loglikelihood requests are
/v1/completions with echo, logprobs 1 and max_tokens 1. Each choice's logprob sum must equal
transformers' float32 logprobs on the same weights: within 1e-3 with --quantization none, and
within QUANTIZED_ABS + QUANTIZED_REL * |sum| with the default CPU weight format (Q4
projections, Q8 LM head). The
tokenizer comes from tallow itself (/tokenizer_info, /tokenize, /detokenize: lm-eval's "remote"
backend) or from the model's local folder (the "huggingface" backend), never from a hub;
requests go as token ids and as text (tokenized_requests both ways).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pytest
import torch

from model_utils import tiny_text_model

pytestmark = pytest.mark.evals

DATA = Path(__file__).parent / "data" / "evals"
FLOAT_TOL = 1e-3
# The default CPU format (Q4 projections with 12-bit activation blocks, a Q8 LM head with 16-bit ones, float16 KV cache)
# against transformers' float32 on the float weights it was quantized from. The random 2-layer
# model has large weights and peaked logits (sums of tens of nats over 3-10 tokens), a hard
# case for 4 bits: the largest difference measured was 2.93 nats, 9.3% of that choice's sum. The
# bound, per choice: QUANTIZED_ABS + QUANTIZED_REL * |sum|.
QUANTIZED_ABS = 0.25
QUANTIZED_REL = 0.12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("lm_eval", reason="make test-evals installs lm-eval")
    path = tmp_path_factory.mktemp("tiny_eval_model")
    return str(path), tiny_text_model(path)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> str:
    """The committed task with its data file's absolute path."""
    folder = tmp_path_factory.mktemp("tasks")
    text = (DATA / "tallow_mc.yaml").read_text()
    text = text.replace("test: tallow_mc.jsonl", f"test: {DATA / 'tallow_mc.jsonl'}")
    (folder / "tallow_mc.yaml").write_text(text)
    return str(folder)


def live_server(path: str, quantization: str):
    from serve_utils import LiveServer

    from tallow.config import EngineConfig
    from tallow.engine.async_engine import AsyncEngine

    config = dataclasses.replace(EngineConfig(model=path, device="cpu", quantization=quantization, block_size=4,
                                              max_num_batched_tokens=32))
    engine = AsyncEngine.from_config(config)
    with LiveServer(engine) as live:
        yield live
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def float_server(tiny):
    yield from live_server(tiny[0], "none")


@pytest.fixture(scope="module")
def quantized_server(tiny):
    yield from live_server(tiny[0], "auto")


def run_lm_eval(server, task_dir: str, **model_args) -> list[dict]:
    """lm-eval's samples of the task, each with its (context, continuation) requests and responses."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    batch_size = model_args.pop("batch_size", 1)
    args = {"model": "tiny", "base_url": f"{server.base_url}/v1/completions", "max_retries": 1,
            "num_concurrent": 1, **model_args}
    results = simple_evaluate(model="local-completions", model_args=args, tasks=["tallow_mc"],
                              task_manager=TaskManager(include_path=task_dir), log_samples=True,
                              batch_size=batch_size)
    return results["samples"]["tallow_mc"]


def reference_sum(hf, context: str, continuation: str) -> float:
    """transformers' float32 logprob of the continuation's tokens after the context (the byte-level
    tokenizer: a token per byte, so lm-eval's context/continuation split is the bytes')."""
    ctx, cont = list(context.encode()), list(continuation.encode())
    ids = ctx + cont
    with torch.no_grad():
        logprobs = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return sum(logprobs[len(ctx) + i - 1, t].item() for i, t in enumerate(cont))


def check(samples: list[dict], hf, tol: float, rel: float = 0.0) -> tuple[float, float]:
    """Every choice's loglikelihood within tol + rel * |reference|; the largest absolute and
    relative differences."""
    assert len(samples) == len((DATA / "tallow_mc.jsonl").read_text().splitlines())
    worst = worst_rel = 0.0
    for sample in samples:
        assert len(sample["arguments"]) == len(sample["doc"]["choices"])
        for (context, continuation), resps in zip(sample["arguments"], sample["resps"]):
            (loglikelihood, _greedy), = resps
            expected = reference_sum(hf, context, continuation)
            worst = max(worst, abs(loglikelihood - expected))
            worst_rel = max(worst_rel, abs(loglikelihood - expected) / abs(expected))
            assert abs(loglikelihood - expected) <= tol + rel * abs(expected), (context, continuation,
                                                                                 loglikelihood, expected)
    return worst, worst_rel


@pytest.mark.parametrize("model_args", [
    {"tokenizer_backend": "remote", "tokenized_requests": True},
    {"tokenizer_backend": "remote", "tokenized_requests": False, "batch_size": 2},
    {"tokenizer_backend": "huggingface", "tokenized_requests": True, "batch_size": 3},
], ids=["remote-tokens", "remote-text-batched", "local-tokenizer-tokens"])
def test_lm_eval_loglikelihoods_match_transformers(float_server, tiny, task_dir, model_args):
    path, hf = tiny
    if model_args["tokenizer_backend"] == "huggingface":
        model_args = {**model_args, "tokenizer": path}
    check(run_lm_eval(float_server, task_dir, **model_args), hf, FLOAT_TOL)


def test_lm_eval_auto_detects_tallow_tokenizer(float_server, tiny, task_dir):
    """local-completions' default tokenizer_backend "auto" probes /tokenizer_info and /tokenize."""
    check(run_lm_eval(float_server, task_dir), tiny[1], FLOAT_TOL)


def test_lm_eval_quantized_weights_within_bound(quantized_server, tiny, task_dir):
    worst, worst_rel = check(run_lm_eval(quantized_server, task_dir, tokenizer_backend="remote"), tiny[1],
                             QUANTIZED_ABS, QUANTIZED_REL)
    print(f"quantized: largest difference {worst:.4f} nats, {worst_rel:.2%} of the sum")
    assert worst > FLOAT_TOL  # the quantized weights are in use
