"""The OpenAI endpoints end to end: the official client against a live server, over the real
engine on the replay: test fixture model (scripted replies, so exact expected texts) and on the
default model."""

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest

from deadlines import wait_until
from serve_utils import LiveServer, engine_idle, replay_engine, scripted_reply
from tallow.config import ServerConfig
from tallow.serve.chat_prompt import render_chat

REPLAY_SCRIPT = Path(__file__).parent / "data" / "replay_openai.json"
REPLY = scripted_reply(None, REPLAY_SCRIPT)  # what the replay model says to anything else
NON_ASCII_REPLY = scripted_reply("Japanese", REPLAY_SCRIPT)


@pytest.fixture(scope="module", params=["replay", "real"])
def server(request):
    if request.param == "real":
        yield request.getfixturevalue("real_server")
        return
    engine = replay_engine(REPLAY_SCRIPT)
    with LiveServer(engine) as live:
        yield live
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def is_replay(server) -> bool:
    return server.engine.model_name.startswith("replay:")


def replayed(server, reply: str, num_tokens: int) -> str:
    """The text of the first num_tokens tokens of a scripted reply."""
    tok = server.engine.tokenizer
    return tok.decode(tok.encode(reply)[:num_tokens])


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def stream_text(chunks) -> tuple[list[str], str | None]:
    """The content deltas of a one-choice stream, and its finish_reason."""
    deltas, finish = [], None
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(choice.delta.content)
            finish = choice.finish_reason or finish
    return deltas, finish


def raw_frames(server, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", server.base_url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        return [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]


def test_streamed_chat_equals_the_whole_reply(server, client):
    messages = ask("Write one sentence about the sea.")
    whole = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=8)
    deltas, finish = stream_text(client.chat.completions.create(
        model="m", messages=messages, temperature=0, max_tokens=8, stream=True))
    content = whole.choices[0].message.content
    assert "".join(deltas) == content
    assert finish == whole.choices[0].finish_reason
    assert whole.usage.completion_tokens <= 8
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    prompt_ids = server.engine.tokenizer.encode(render_chat(server.engine.chat_template, messages, ServerConfig()).text)
    assert whole.usage.prompt_tokens == len(prompt_ids)
    if is_replay(server):
        assert content == replayed(server, REPLY, 8)


def test_streamed_completion_equals_the_whole_text_and_echo(server, client):
    prompt = "Once upon a time"
    whole = client.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=6)
    chunks = client.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=6, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    echoed = client.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=6, echo=True)
    assert echoed.choices[0].text == prompt + whole.choices[0].text
    chunks = client.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=6, echo=True,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text


def test_completion_prompt_lists_give_one_choice_per_prompt_and_sample(server, client):
    prompts = ["The sky is", "Two plus two"]
    single = [client.completions.create(model="m", prompt=p, temperature=0, max_tokens=4) for p in prompts]
    both = client.completions.create(model="m", prompt=prompts, temperature=0, max_tokens=4, n=2)
    texts = [r.choices[0].text for r in single]
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [texts[0], texts[0], texts[1], texts[1]]
    assert both.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in single)
    token_ids = [server.engine.tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    by_ids = client.completions.create(model="m", prompt=token_ids, temperature=0, max_tokens=4)
    assert [c.text for c in by_ids.choices] == texts


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_token_boundaries(server, client, stream):
    messages = ask("List three colours, separated by commas.")
    first = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=16,
                                           logprobs=True)
    text = first.choices[0].message.content
    # Token boundaries inside the text, from the tokens' own bytes.
    bounds, offset = [], 0
    for entry in first.choices[0].logprobs.content:
        offset += len(bytes(entry.bytes).decode(errors="replace"))
        bounds.append(offset)
    stop = next(text[b - 2:b + 2] for b in bounds[len(bounds) // 3:]
                if 2 <= b <= len(text) - 2 and text.find(text[b - 2:b + 2]) == b - 2)
    expected = text[:text.find(stop)]
    kwargs = dict(model="m", messages=messages, temperature=0, max_tokens=16, stop=[stop, "never-seen"])
    if stream:
        deltas, finish = stream_text(client.chat.completions.create(stream=True, **kwargs))
        content = "".join(deltas)
    else:
        reply = client.chat.completions.create(**kwargs)
        content, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert (content, finish) == (expected, "stop")
    kept = client.chat.completions.create(extra_body={"include_stop_str_in_output": True}, **kwargs)
    assert kept.choices[0].message.content == expected + stop


def test_chat_logprobs_are_consistent(server, client):
    reply = client.chat.completions.create(model="m", messages=ask("Name a fruit."), temperature=0,
                                           max_tokens=6, logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in entries).decode(errors="replace") == choice.message.content
    for e in entries:
        assert len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)  # greedy
        assert e.logprob <= 0


def test_completion_legacy_logprobs_are_consistent(server, client):
    reply = client.completions.create(model="m", prompt="The capital of France is", temperature=0,
                                      max_tokens=8, logprobs=2)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == reply.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    if "\ufffd" not in "".join(lp.tokens):
        assert "".join(lp.tokens) == choice.text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and top[token] == logprob == max(top.values())


def test_n_choices_and_seeds(server, client):
    def sample(seed):
        reply = client.chat.completions.create(model="m", messages=ask("Say something."), temperature=1.0,
                                               max_tokens=6, n=3, seed=seed)
        assert [c.index for c in reply.choices] == [0, 1, 2]
        return [c.message.content for c in reply.choices]

    first = sample(7)
    assert sample(7) == first
    if is_replay(server):  # one-hot logits: any seed samples the scripted reply
        assert first == [replayed(server, REPLY, 6)] * 3
    else:
        assert sample(8) != first


def test_concurrent_requests_give_the_sequential_texts(server, client):
    prompts = [f"Count from {i} to {i + 3}." for i in range(12)]
    sequential = [client.chat.completions.create(model="m", messages=ask(p), temperature=0, max_tokens=6)
                  .choices[0].message.content for p in prompts]

    async def together():
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        replies = await asyncio.gather(*(aclient.chat.completions.create(
            model="m", messages=ask(p), temperature=0, max_tokens=6) for p in prompts))
        return [r.choices[0].message.content for r in replies]

    assert asyncio.run(together()) == sequential


def test_repeated_system_prompt_is_served_from_the_prefix_cache(server, client):
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: be kind." for i in range(60))
    def cached(question):
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "system", "content": system}, *ask(question)], temperature=0,
            max_tokens=2)
        return reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens

    prompt_tokens, _ = cached("What is rule 3?")
    assert prompt_tokens >= 300
    prompt_tokens, hits = cached("What is rule 7?")
    assert 256 <= hits < prompt_tokens


def test_non_ascii_text_streams_without_replacement_characters(server, client):
    question = "Write 'naïve café' and the Japanese for cat (猫)."
    deltas, _ = stream_text(client.chat.completions.create(model="m", messages=ask(question), temperature=0,
                                                           max_tokens=24, stream=True))
    whole = client.chat.completions.create(model="m", messages=ask(question), temperature=0, max_tokens=24)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == whole.choices[0].message.content
    if is_replay(server):  # the scripted reply holds accents, CJK and emoji
        assert "🙂" in "".join(deltas) and any(ord(c) > 0x3000 for c in "".join(deltas))
        assert "".join(deltas) == replayed(server, NON_ASCII_REPLY, 24)


def test_usage_chunks(server):
    body = {"messages": ask("Hello"), "temperature": 0, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    frames = raw_frames(server, "/v1/chat/completions", body)
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 6
    body["stream_options"]["continuous_usage_stats"] = True
    chunks = [json.loads(f) for f in raw_frames(server, "/v1/chat/completions", body)[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks[1:]]
    assert counts == sorted(counts) and counts[-1] == chunks[-1]["usage"]["completion_tokens"]


def test_a_dropped_stream_frees_the_engine(server):
    body = {"messages": ask("Tell me a very long story."), "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.engine.stats()["running"] == 1
    wait_until(lambda: engine_idle(server.engine))


def test_a_dropped_request_frees_the_engine(server):
    body = {"messages": ask("Tell me a very long story."), "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=0.5)
    wait_until(lambda: engine_idle(server.engine))
