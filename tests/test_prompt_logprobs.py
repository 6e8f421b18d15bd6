"""Prompt logprobs (engine/prompt_logprobs.py) against transformers' float32 logprobs on the same
weights: in the engine (chunked prefill, a prefix-cache hit, asynchronous scheduling, a concurrent
request left unchanged) and through the server (/v1/completions echo with logprobs, max_tokens 0,
vLLM's prompt_logprobs on completions and chat, /tokenize, /detokenize, /tokenizer_info, and the
400s of combinations that cannot be honoured)."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import openai
import pytest
import torch

from model_utils import BYTE_EOS, tiny_text_model
from tallow.config import EngineConfig
from tallow.engine.core import EngineCore
from tallow.engine.sampling import SamplingParams

TOL = 1e-4  # float32 logprobs, the engine's kernels against transformers' eager torch

PROMPT_TEXT = "The quick brown fox jumps over the lazy dog, and then it naps in the sun."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, transformers model): a tiny random Llama over a byte-level tokenizer."""
    path = tmp_path_factory.mktemp("tiny_text")
    return str(path), tiny_text_model(path)


def reference(hf, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax over the vocabulary at every position of ids: [len, V]."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def own_logprobs(ref: torch.Tensor, ids: list[int]) -> list[float]:
    """Each prompt token's logprob after the ones before it (tokens 1 .. len - 1), from reference()."""
    return [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]


def prompt_ids(n: int = 45) -> list[int]:
    return list(PROMPT_TEXT.encode())[:n]


def config(path: str, **overrides) -> EngineConfig:
    return dataclasses.replace(EngineConfig(model=path, device="cpu", quantization="none", block_size=4,
                                            num_kv_blocks=128, max_num_batched_tokens=2048), **overrides)


def run(core: EngineCore, requests: list[tuple[list[int], SamplingParams]]):
    """Every request to the end; per request (its sequence, its outputs in order)."""
    seqs = [core.make_sequences(ids, params)[0] for ids, params in requests]
    outputs = {s.seq_id: [] for s in seqs}
    for s in seqs:
        core.add(s)
    while core.has_work():
        for seq, out in core.step():
            outputs[seq.seq_id].append(out)
    return [(s, outputs[s.seq_id]) for s in seqs]


def check_against_reference(hf, ids: list[int], entries, k: int) -> None:
    ref = reference(hf, ids)
    assert [e.token_id for e in entries] == ids[1:]
    for pos, e in enumerate(entries, 1):
        row = ref[pos - 1]
        assert e.logprob == pytest.approx(row[ids[pos]].item(), abs=TOL), f"token {pos}"
        # rank: 1 + the tokens clearly more likely; near-ties may go either way
        assert (row > row[ids[pos]] + TOL).sum().item() + 1 <= e.rank <= (row > row[ids[pos]] - TOL).sum().item() + 1
        assert len(e.top) == k
        top_values = row.topk(k).values.tolist() if k else []
        for (token, lp), expected in zip(e.top, top_values):
            assert lp == pytest.approx(expected, abs=TOL)
            assert lp == pytest.approx(row[token].item(), abs=TOL)


@pytest.mark.parametrize("chunk", [2048, 8], ids=["one-chunk", "chunked-prefill"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_match_transformers(tiny, chunk, async_scheduling):
    path, hf = tiny
    core = EngineCore(config(path, max_num_batched_tokens=chunk, async_scheduling=async_scheduling))
    ids = prompt_ids()
    [(seq, outs)] = run(core, [(ids, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3))])
    entries = outs[0].prompt_logprobs
    assert entries is not None and len(entries) == len(ids) - 1
    assert all(o.prompt_logprobs is None for o in outs[1:])  # sent once, with the first token
    check_against_reference(hf, ids, entries, 3)
    # the generated tokens are the greedy ones of transformers
    ref_ids = hf.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)[0, len(ids):].tolist()
    assert seq.output_ids == ref_ids


def test_prefix_cache_hit_is_recomputed_for_prompt_logprobs(tiny):
    path, hf = tiny
    core = EngineCore(config(path, max_num_batched_tokens=8))
    ids = prompt_ids()
    greedy = SamplingParams(temperature=0, max_tokens=2)
    [(first, _)] = run(core, [(ids, greedy)])
    [(again, _)] = run(core, [(ids, greedy)])
    assert again.num_cached_tokens == 44  # the prefix cache holds the prompt's full blocks
    [(scored, outs)] = run(core, [(ids, dataclasses.replace(greedy, prompt_logprobs=0))])
    assert scored.num_cached_tokens == 0  # it skipped them: every prompt row was computed
    check_against_reference(hf, ids, outs[0].prompt_logprobs, 0)
    assert scored.output_ids == first.output_ids
    [(after, _)] = run(core, [(ids, greedy)])
    assert after.num_cached_tokens == 44  # and caching goes on for the others


def test_concurrent_request_unchanged(tiny):
    """A request batched with one that scores its prompt (chunked, interleaved) generates the same
    tokens, and logprobs, as alone."""
    path, hf = tiny
    other = list(b"Pack my box with five dozen liquor jugs.")
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    core = EngineCore(config(path, max_num_batched_tokens=12))
    [(alone, alone_outs)] = run(core, [(other, params)])
    core = EngineCore(config(path, max_num_batched_tokens=12))
    ids = prompt_ids()
    [(scored, scored_outs), (together, together_outs)] = run(core, [
        (ids, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)), (other, params)])
    assert together.output_ids == alone.output_ids
    assert [lp for o in together_outs for lp in o.logprobs] == pytest.approx(
        [lp for o in alone_outs for lp in o.logprobs], abs=TOL)
    assert together_outs[0].prompt_logprobs is None
    check_against_reference(hf, ids, scored_outs[0].prompt_logprobs, 1)


def test_one_token_prompt_and_n_siblings(tiny):
    path, _ = tiny
    core = EngineCore(config(path))
    [(seq, outs)] = run(core, [([65], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))])
    assert outs[0].prompt_logprobs == []  # nothing to score: the first token has no logprob
    seqs = core.make_sequences(prompt_ids(), SamplingParams(n=2, max_tokens=2, prompt_logprobs=0))
    assert seqs[0].prompt_logprobs == [] and seqs[1].prompt_logprobs is None  # scored once


# ---- through the server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny):
    from serve_utils import LiveServer

    from tallow.engine.async_engine import AsyncEngine

    path, _ = tiny
    engine = AsyncEngine.from_config(config(path, max_num_batched_tokens=16))
    with LiveServer(engine) as live:
        yield live
    asyncio.run(engine.shutdown())


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_echo_with_logprobs_scores_the_prompt(server, tiny):
    _, hf = tiny
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    text = PROMPT_TEXT[:40]
    ids = list(text.encode())
    ref = reference(hf, ids)
    res = client.completions.create(model="m", prompt=text, echo=True, logprobs=1, max_tokens=1, temperature=0)
    choice = res.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(text) and len(choice.text) > len(text) - 1
    assert len(lp.tokens) == len(ids) + 1 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens[:len(ids)]) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(own_logprobs(ref, ids), abs=TOL)
    assert lp.text_offset[:len(ids)] == list(range(len(ids)))
    own = own_logprobs(ref, ids)
    for i in range(1, len(ids)):
        # the prompt token itself, then the top 1 (OpenAI's "up to logprobs + 1" entries)
        top = lp.top_logprobs[i]
        assert list(top)[0] == lp.tokens[i] and top[lp.tokens[i]] == pytest.approx(own[i - 1], abs=TOL)
        assert max(top.values()) == pytest.approx(ref[i - 1].max().item(), abs=TOL)
        assert len(top) == (1 if ids[i] == ref[i - 1].argmax().item() else 2)
        # lm-eval's greedy check: the token's logprob is the largest of them exactly when it is the argmax
        assert (lp.token_logprobs[i] == max(top.values())) == (ids[i] == ref[i - 1].argmax().item())
    # the generated token follows, with its own logprob
    assert lp.token_logprobs[-1] == pytest.approx(ref[-1].max().item(), abs=TOL)
    assert res.usage.prompt_tokens == len(ids) and res.usage.completion_tokens == 1


def test_echo_max_tokens_zero_scores_only(server, tiny):
    _, hf = tiny
    ids = prompt_ids(30)
    res = post(server, "/v1/completions", {"prompt": [ids, ids[:12]], "echo": True, "logprobs": 0, "max_tokens": 0})
    assert res.status_code == 200, res.text
    body = res.json()
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == 42
    for choice, prompt in zip(body["choices"], [ids, ids[:12]]):
        ref = reference(hf, prompt)
        assert choice["text"] == bytes(prompt).decode()
        assert choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == pytest.approx(own_logprobs(ref, prompt), abs=TOL)
        # logprobs 0: each position's own token alone (OpenAI and vLLM always give the chosen one)
        assert logprobs["top_logprobs"][1:] == [{t: lp} for t, lp in zip(logprobs["tokens"][1:],
                                                                         logprobs["token_logprobs"][1:])]
    # without logprobs: the prompt's text alone
    body = post(server, "/v1/completions", {"prompt": "abc", "echo": True, "max_tokens": 0}).json()
    assert body["choices"][0]["text"] == "abc" and body["choices"][0]["logprobs"] is None


def test_streamed_echo_with_logprobs(server, tiny):
    _, hf = tiny
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    text = PROMPT_TEXT[:20]
    ids = list(text.encode())
    ref = reference(hf, ids)
    chunks = list(client.completions.create(model="m", prompt=text, echo=True, logprobs=2, max_tokens=3,
                                            temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == text
    assert first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(own_logprobs(ref, ids), abs=TOL)
    # each position's own token, then the top 2, keyed by their text (bytes that are no UTF-8 alone
    # share the key "\ufffd": the legacy shape keys by text)
    from transformers import AutoTokenizer

    reference_tokenizer = AutoTokenizer.from_pretrained(tiny[0])

    def token_text(t: int) -> str:
        return reference_tokenizer.decode([t])

    for i, top in enumerate(first.logprobs.top_logprobs[1:], start=1):
        keys = [token_text(ids[i])] + [token_text(t) for t in ref[i - 1].topk(2).indices.tolist()]
        assert list(top) == list(dict.fromkeys(keys))
    whole = client.completions.create(model="m", prompt=text, echo=True, logprobs=2, max_tokens=3, temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs) == len(ids) + 3


def vllm_check(entries: list, ids: list[int], hf, k: int) -> None:
    ref = reference(hf, ids)
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        position = entries[pos]
        own = position[str(ids[pos])]
        assert own["logprob"] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=TOL)
        assert own["decoded_token"] == bytes([ids[pos]]).decode("utf-8", errors="replace")
        assert isinstance(own["rank"], int) and own["rank"] >= 1
        assert k <= len(position) <= k + 1
        top = ref[pos - 1].topk(k)
        for rank, (value, token) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
            entry = position.get(str(token))
            if entry is not None and str(token) != str(ids[pos]):
                assert entry["logprob"] == pytest.approx(value, abs=TOL) and entry["rank"] == rank


def test_vllm_prompt_logprobs_on_completions(server, tiny):
    _, hf = tiny
    ids = prompt_ids(33)
    body = post(server, "/v1/completions", {"prompt": bytes(ids).decode(), "max_tokens": 2,
                                            "prompt_logprobs": 2, "temperature": 0}).json()
    choice = body["choices"][0]
    assert choice["logprobs"] is None
    vllm_check(choice["prompt_logprobs"], ids, hf, 2)


def test_vllm_prompt_logprobs_on_chat(server, tiny):
    _, hf = tiny
    messages = [{"role": "user", "content": "Name a fox."}]
    tokenized = post(server, "/tokenize", {"messages": messages}).json()
    body = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert body["usage"]["prompt_tokens"] == tokenized["count"]
    vllm_check(body["prompt_logprobs"], tokenized["tokens"], hf, 0)
    assert all(len(p) == 1 for p in body["prompt_logprobs"][1:])


def test_tokenize_detokenize_round_trip(server, tiny):
    from transformers import AutoTokenizer

    path, _ = tiny
    reference_tokenizer = AutoTokenizer.from_pretrained(path)
    text = "Héllo, wörld! " + BYTE_EOS + " 日本"
    res = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    expected = reference_tokenizer(text, add_special_tokens=False).input_ids
    assert res["tokens"] == expected and res["count"] == len(expected)
    assert res["max_model_len"] == 256
    assert res["token_strs"] == reference_tokenizer.convert_ids_to_tokens(expected)
    assert post(server, "/tokenize", {"prompt": "ab"}).json()["token_strs"] is None
    back = post(server, "/detokenize", {"tokens": res["tokens"]}).json()
    assert back == {"prompt": reference_tokenizer.decode(expected)} == {"prompt": text}
    info = httpx.get(server.base_url + "/tokenizer_info").json()
    assert info["eos_token"] == reference_tokenizer.eos_token == BYTE_EOS
    assert info["bos_token"] is None and info["pad_token"] is None
    assert info["chat_template"]  # tallow's ChatML default for a tokenizer without one
    # lm-eval's remote tokenizer reads the EOS id as the first token of the EOS string
    assert post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"] == [
        reference_tokenizer.eos_token_id]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "ab", "echo": True, "logprobs": 1, "n": 2}, "n"),
    ("/v1/completions", {"prompt": "ab", "prompt_logprobs": 0, "n": 2}, "n"),
    ("/v1/completions", {"prompt": "ab", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "ab", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "ab", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "ab", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "ab", "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "prompt_logprobs": 99},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 0}, "max_tokens"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "messages"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
     "continue_final_message"),
    ("/detokenize", {"tokens": [65, 260]}, "tokens[1]"),
    ("/detokenize", {"tokens": "ab"}, "tokens"),
])
def test_bad_combinations_are_400s_naming_the_field(server, path, body, param):
    res = post(server, path, body)
    assert res.status_code == 400, res.text
    assert res.json()["error"]["param"] == param
