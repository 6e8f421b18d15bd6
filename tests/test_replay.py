"""The replay model source (a test fixture): the real engine gives exactly the scripted replies,
in batches, under any sampling settings, with the prefix cache, chunked prefill and preemption."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tallow.chat_template import ChatTemplate
from tallow.config import EngineConfig
from tallow.engine.core import EngineCore
from tallow.engine.sampling import SamplingParams
from tallow.errors import ModelLoadError
from tallow.output.reasoning import REASONING_PARSERS, make_thinking_splitter
from tallow.output.sink import CompletionSink
from tallow.output.stop import StopMatcher
from tallow.output.tool_parsers import make_tool_router
from tallow.testing.replay import load_replay

SCRIPT = Path(__file__).parent / "data" / "replay_tools.json"
REPLIES = {e.get("match"): e["reply"] for e in json.loads(SCRIPT.read_text())["replies"]}
QUESTIONS = {"weather": "What's the weather in Zürich this week?", "think": "Please think first: what time is it?",
             "hello": "Well, hello there!", None: "Tell me a joke."}


@pytest.fixture(scope="module")
def loaded():
    return load_replay(str(SCRIPT), dtype=torch.float32, device="cpu")


def make_core(loaded, **overrides) -> EngineCore:
    config = EngineConfig(model="replay", device="cpu", quantization="none")
    return EngineCore(dataclasses.replace(config, **overrides), loaded=loaded)


@pytest.fixture(scope="module")
def core(loaded):
    return make_core(loaded)


def chat_prompt(core: EngineCore, *messages: str) -> list[int]:
    tok = core.tokenizer
    template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
    turns = [{"role": "user" if k % 2 == 0 else "assistant", "content": m} for k, m in enumerate(messages)]
    return tok.encode(template.render(turns))


def run(core: EngineCore, prompts: list[list[int]], params: SamplingParams):
    seqs = [s for ids in prompts for s in core.make_sequences(ids, params)]
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    return seqs


def assert_replayed(core: EngineCore, seq, reply: str) -> None:
    assert seq.finish_reason == "stop"
    assert seq.output_ids == core.tokenizer.encode(reply) + [core.tokenizer.eos_token_id]


GREEDY = SamplingParams(max_tokens=200, temperature=0.0)


@pytest.mark.parametrize("key", list(QUESTIONS))
def test_replays_the_scripted_reply(core, key):
    [seq] = run(core, [chat_prompt(core, QUESTIONS[key])], GREEDY)
    assert_replayed(core, seq, REPLIES[key])


def test_a_batch_of_different_prompts_under_sampling(core):
    keys = list(QUESTIONS)
    params = SamplingParams(max_tokens=200, temperature=1.3, top_p=0.9, seed=7, n=2,
                            repetition_penalty=1.3, presence_penalty=1.0, logprobs=2)
    seqs = run(core, [chat_prompt(core, QUESTIONS[k]) for k in keys], params)
    for k, seq in zip([k for k in keys for _ in range(2)], seqs):
        assert_replayed(core, seq, REPLIES[k])


def test_prefix_cache_hits_replay_the_same(loaded):
    core = make_core(loaded, enable_prefix_caching=True)
    prompt = chat_prompt(core, QUESTIONS["weather"])
    [first] = run(core, [prompt], GREEDY)
    hits = core.kv.prefix_hits
    batch = run(core, [prompt, prompt, chat_prompt(core, QUESTIONS["hello"])], GREEDY)
    assert core.kv.prefix_hits > hits
    for seq in (first, *batch[:2]):
        assert_replayed(core, seq, REPLIES["weather"])
    assert_replayed(core, batch[2], REPLIES["hello"])


def test_chunked_prefill_and_preemption(loaded):
    core = make_core(loaded, enable_prefix_caching=False, num_kv_blocks=12, max_num_batched_tokens=32,
                     long_prefill_token_threshold=16)
    keys = list(QUESTIONS) * 2
    seqs = run(core, [chat_prompt(core, QUESTIONS[k]) for k in keys], GREEDY)
    assert core.scheduler.num_preemptions_total > 0
    for k, seq in zip(keys, seqs):
        assert_replayed(core, seq, REPLIES[k])


def test_the_latest_match_in_the_conversation_wins(core):
    prompt = chat_prompt(core, QUESTIONS["hello"], REPLIES["hello"], QUESTIONS["weather"])
    [seq] = run(core, [prompt], GREEDY)
    assert_replayed(core, seq, REPLIES["weather"])


def test_the_engine_stream_through_the_sink(core):
    """Real token boundaries from the engine: the markup becomes a call, the markup inside the
    reasoning stays reasoning."""
    fmt = REASONING_PARSERS["qwen3"]
    results = {}
    for key in ("weather", "think"):
        [seq] = run(core, [chat_prompt(core, QUESTIONS[key])], GREEDY)
        router = make_tool_router(core.tokenizer, "hermes", reasoning=fmt)
        sink = CompletionSink(router, StopMatcher([]), make_thinking_splitter("qwen3", "", True), True)
        for token_id in seq.output_ids:
            sink.push(token_id)
        results[key] = sink.finish()
    weather, think = results["weather"], results["think"]
    assert weather.content == "Let me check the forecast."
    assert [(c.name, json.loads(c.arguments)) for c in weather.tool_calls] == [
        ("get_weather", {"city": "Zürich", "days": 3})]
    assert think.tool_calls == [] and think.content == "It is about noon. 🕛"
    assert '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' in think.reasoning


def test_unmatched_prompt_fails_the_request(tmp_path):
    script = tmp_path / "only_weather.json"
    script.write_text(json.dumps([{"match": "weather", "reply": "Sunny."}]))
    core = make_core(load_replay(str(script), dtype=torch.float32, device="cpu"))
    [seq] = run(core, [core.tokenizer.encode("Tell me a joke.")], GREEDY)
    assert seq.finish_reason == "error"


def test_the_script_can_replace_the_chat_template(tmp_path):
    script = tmp_path / "templated.json"
    template = "{% for m in messages %}<tool_call>{{ m.content }}{% endfor %}"
    script.write_text(json.dumps({"chat_template": template, "replies": [{"reply": "ok"}]}))
    core = make_core(load_replay(str(script), dtype=torch.float32, device="cpu"))
    assert core.tokenizer.chat_template == template
    assert core.model_name == "replay:templated.json"


@pytest.mark.parametrize("content", ["not json", '{"replies": [{"match": "x"}]}', '[{"reply": 3}]'])
def test_bad_scripts_are_load_errors(tmp_path, content):
    script = tmp_path / "bad.json"
    script.write_text(content)
    with pytest.raises(ModelLoadError):
        load_replay(str(script), dtype=torch.float32, device="cpu")
