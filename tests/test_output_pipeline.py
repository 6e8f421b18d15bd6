"""The output pipeline every front end shares: one choice's engine outputs -> events, the engine
sequence aborted when the sink is done, the finish reason; and LLM.generate / LLM.chat,
`tallow generate` and the server cutting a reply at the same place, with the same finish
reason, on the replay model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest
from serve_utils import ByteTokenizer, LiveServer

import tallow.testing  # noqa: F401  (registers the replay: model source)
from tallow import LLM, SamplingParams
from tallow.cli import main
from tallow.config import EngineConfig
from tallow.engine.core import TokenOutput
from tallow.output.events import ContentEvent, ToolCallsEvent
from tallow.output.pipeline import OutputPipeline, make_sink

# Multi-byte characters split across tokens; stop strings that start inside a token.
REPLY = "Alpha beta gamma. Délta epsilon 🙂 zeta, eta; theta."
PROMPT = "Say something."
CASES = [  # stop strings, max_tokens
    (["lta eps"], 64),  # ends inside "Délta": the "é" before it stays whole
    (["zeta", " beta"], 64),  # the earliest match wins, not the first listed
    (["🙂 z"], 64),  # a stop string that begins with a character split over tokens
    (["not in the reply"], 64),  # no match: the reply ends at eos
    (["theta"], 6),  # max_tokens comes first
]


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "reply.json"
    path.write_text(json.dumps([{"reply": REPLY}]))
    return path


@pytest.fixture(scope="module")
def llm(script):
    return LLM(f"replay:{script}", device="cpu", quantization="none", num_kv_blocks=64)


@pytest.fixture(scope="module")
def server(script):
    from tallow.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(EngineConfig(model=f"replay:{script}", device="cpu", quantization="none",
                                                  num_kv_blocks=64))
    with LiveServer(engine) as live:
        yield live
    asyncio.run(engine.shutdown())


def served(server, chat: bool, stop: list[str], max_tokens: int, stream: bool) -> tuple[str, str]:
    """(text, finish_reason) of one request to the server, streamed or not."""
    body = {"max_tokens": max_tokens, "temperature": 0, "stop": stop, "stream": stream}
    if chat:
        url, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": PROMPT}]
    else:
        url, body["prompt"] = "/v1/completions", PROMPT
    r = httpx.post(server.base_url + url, json=body, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]
    text, finish = "", None
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[len("data: "):])["choices"][0]
        text += (choice["delta"].get("content") or "") if chat else choice["text"]
        finish = choice["finish_reason"] or finish
    return text, finish


def generated(script, capsys, chat: bool, stop: list[str], max_tokens: int) -> tuple[str, str]:
    """(text, finish reason) of `tallow generate -v`, in this process."""
    args = ["generate", PROMPT, "--model", f"replay:{script}", "--device", "cpu", "--quantization", "none",
            "--kv-cache-memory", "0.01", "--max-tokens", str(max_tokens), "-v"]
    args += ["--chat"] if chat else []
    for s in stop:
        args += ["--stop", s]
    capsys.readouterr()
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n")
    return out[:-1], err.rsplit("finish ", 1)[1].split("]")[0]


def expected(stop: list[str], max_tokens: int, tokenizer) -> tuple[str, str]:
    """The reference, from the reply itself: the text of its first max_tokens tokens, cut before
    the earliest stop string that occurs in it whole."""
    ids = tokenizer.encode(REPLY)
    text = tokenizer.decode(ids[:max_tokens])
    starts = [text.find(s) for s in stop if s in text]
    if starts:
        return text[:min(starts)], "stop"
    return text, "length" if max_tokens < len(ids) else "stop"


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("stop, max_tokens", CASES)
def test_every_front_end_cuts_the_reply_at_the_same_place(llm, server, script, capsys, chat, stop, max_tokens):
    want = expected(stop, max_tokens, llm.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop)
    if chat:
        [out] = llm.chat([{"role": "user", "content": PROMPT}], params)[0].outputs
    else:
        [out] = llm.generate(PROMPT, params)[0].outputs
    assert (out.text, out.finish_reason) == want
    if want[1] == "stop" and want[0] != REPLY:  # the stop string that matched, where it matched
        assert out.stop_reason in stop and REPLY.startswith(want[0] + out.stop_reason)
    assert served(server, chat, stop, max_tokens, stream=False) == want
    assert served(server, chat, stop, max_tokens, stream=True) == want
    assert generated(script, capsys, chat, stop, max_tokens) == want


def output(text: str, finish_reason: str | None = None) -> TokenOutput:
    ids = list(text.encode())  # ByteTokenizer: token i < 256 is byte i
    return TokenOutput(ids, None, None, finish_reason, 3, 0)


class Aborts:
    def __init__(self):
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def content(events) -> str:
    return "".join(e.text for e in events if isinstance(e, ContentEvent))


def test_the_pipeline_takes_tokens_up_to_the_stop_string_and_aborts_once():
    aborts = Aborts()
    pipeline = OutputPipeline(make_sink(ByteTokenizer(), SamplingParams(stop=["STOP"])), aborts)
    text = content(pipeline.feed(output("naïve ST")))
    assert pipeline.taken == len("naïve ST".encode()) and not pipeline.done and aborts.calls == 0
    tail = "OP and the rest"
    text += content(pipeline.feed(output(tail)))
    # Taken: up to the token that completes the stop string; the rest of the output is dropped.
    assert pipeline.taken == len("OP") and pipeline.done and pipeline.finished and aborts.calls == 1
    result, reason = pipeline.finish()
    assert text + content(result.events) == "naïve " == result.content
    assert (reason, result.stop_string) == ("stop", "STOP")


@pytest.mark.parametrize("engine_reason", ["length", "stop", "abort"])
def test_the_engine_finish_reason_passes_through_when_no_stop_string_matches(engine_reason):
    aborts = Aborts()
    pipeline = OutputPipeline(make_sink(ByteTokenizer(), SamplingParams(stop=["zz"])), aborts)
    text = content(pipeline.feed(output("a z")))
    assert not pipeline.finished
    text += content(pipeline.feed(output(" caf\u00e9 z", engine_reason)))
    assert pipeline.finished and not pipeline.done and aborts.calls == 0
    result, reason = pipeline.finish()
    assert text + content(result.events) == "a z café z" and (reason, result.stop_string) == (engine_reason, None)


def test_the_last_tool_call_allowed_ends_generation_with_tool_calls():
    aborts = Aborts()
    sink = make_sink(ByteTokenizer(), SamplingParams(), tool_parser="hermes", max_tool_calls=1)
    pipeline = OutputPipeline(sink, aborts)
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    pipeline.feed(output("Let me see. " + call + " and more"))
    assert pipeline.done and aborts.calls == 1 and pipeline.taken == len(("Let me see. " + call).encode())
    result, reason = pipeline.finish()
    assert reason == "tool_calls" and result.content == "Let me see."
    assert isinstance(result.events[-1], ToolCallsEvent) and result.tool_calls[0].arguments == '{"x":1}'


@pytest.mark.parametrize("stream", [False, True])
def test_a_second_call_cut_by_the_token_limit_is_length_and_leaves_no_markup(stream):
    # forced tools with parallel calls: one call made, the next cut after its name (the audit's
    # case); the reply says the limit was reached and no markup reaches the content
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
    for cut in ('<tool_call>\n{"name": "f", "arguments":', '<tool_call>\n{"na', "<tool_"):
        pipeline = OutputPipeline(make_sink(ByteTokenizer(), SamplingParams(), tool_parser="hermes"), Aborts())
        pieces = list(call + cut) if stream else [call + cut]
        events = [e for i, piece in enumerate(pieces)
                  for e in pipeline.feed(output(piece, "length" if i == len(pieces) - 1 else None))]
        result, reason = pipeline.finish()
        assert reason == "length", cut
        assert content(events) + content(result.events) == "" == result.content, cut
        assert [(c.name, c.arguments) for c in result.tool_calls] == [("f", '{"x":1}')], cut
    # the same markup cut short by a stop of the model (not the limit) is content, as before
    pipeline = OutputPipeline(make_sink(ByteTokenizer(), SamplingParams(), tool_parser="hermes"), Aborts())
    pipeline.feed(output("Hi <tool_call>\n{\"na", "stop"))
    result, reason = pipeline.finish()
    assert result.content == "Hi <tool_call>\n{\"na" and reason == "stop"


def test_the_offline_front_ends_import_no_serving_code():
    code = ("import sys, tallow.llm, tallow.cli, tallow.output.offline, tallow.output.pipeline; "
            "print(sorted(m for m in sys.modules if m.startswith('tallow.serve')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
