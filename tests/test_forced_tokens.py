"""The reasoning budget's forced tokens (engine/forced_tokens.py): on Sequences directly, and
through the engine on the replay model with synchronous and asynchronous steps (a budgeted
sequence makes the asynchronous loop step synchronously, as penalties do)."""

from __future__ import annotations

import json

import pytest
import torch

import tallow.testing  # noqa: F401  (registers the replay: source)
from tallow.config import EngineConfig
from tallow.engine.core import EngineCore
from tallow.engine.forced_tokens import apply_forced_tokens, forced_reasoning_token
from tallow.engine.request import Sequence
from tallow.engine.sampling import SamplingParams

START, END = (5, 6), (7, 8, 9)


def seq(output: list[int], budget: int | None = 4, open_in_prompt: bool = False) -> Sequence:
    params = SamplingParams(max_tokens=100, reasoning_budget=budget, reasoning_start_ids=START,
                            reasoning_end_ids=END, reasoning_open=open_in_prompt)
    s = Sequence([1, 2, 3], params)
    s.token_ids += output
    return s


def test_forced_tokens_on_sequences():
    assert forced_reasoning_token(seq([5, 6, 20])) is None  # under the budget
    assert forced_reasoning_token(seq([5, 6, 20, 21], budget=None)) is None  # no budget
    assert forced_reasoning_token(seq([20, 21, 22, 23])) is None  # never opened: an answer
    assert forced_reasoning_token(seq([5, 6, 7, 8, 9, 30])) is None  # closed by the model in time
    s = seq([20, 21, 22, 23], open_in_prompt=True)  # the prompt opened it
    forced = []
    while (t := forced_reasoning_token(s)) is not None:
        forced.append(t)
        s.token_ids.append(t)
    assert forced == list(END)
    s.token_ids.append(40)
    assert forced_reasoning_token(s) is None  # the answer runs free
    s = seq([5, 6, 20, 7])  # the model began the end tag itself: completed, not repeated
    assert forced_reasoning_token(s) == 8
    rows = torch.tensor([11, 12, 13])
    out = apply_forced_tokens(rows, [seq([5, 6, 20, 21]), seq([5, 6]), seq([5, 6, 20, 21])], [0, 2])
    assert out.tolist() == [7, 12, 7] and rows.tolist() == [11, 12, 13]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_budget_through_the_engine(tmp_path, async_scheduling):
    script = tmp_path / "script.json"
    thought = "<think>\n" + "hmm " * 30 + "\n</think>\n\n"
    script.write_text(json.dumps([{"match": "</think>", "reply": "Done."}, {"reply": thought + "Answer."}]))
    core = EngineCore(EngineConfig(model=f"replay:{script}", device="cpu", quantization="none",
                                   async_scheduling=async_scheduling))
    tok = core.tokenizer
    prompt = tok.encode("Question?")
    end = tuple(tok.encode("</think>"))
    results = []
    for budget in (None, 10):
        params = SamplingParams(max_tokens=200, temperature=0.0, reasoning_budget=budget,
                                reasoning_start_ids=tuple(tok.encode("<think>")), reasoning_end_ids=end)
        [s] = core.make_sequences(prompt, params)
        core.add(s)
        ids = []
        while core.has_work():
            for _, out in core.step():
                ids += out.token_ids
        results.append(tok.decode(ids))
    assert results[0] == thought + "Answer."
    assert results[1].startswith("<think>\nhmm") and results[1].endswith("</think>Done.")
    assert len(tok.encode(results[1].split("</think>")[0])) <= 10
