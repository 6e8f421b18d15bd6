"""tallow.LLM called as vLLM users call vLLM's LLM: generate's use_tqdm / sampling_params /
lora_request keywords, TextPrompt and TokensPrompt dicts, logprobs as Logprob objects (logprob,
rank, decoded_token) for the sampled tokens and the prompt, cumulative_logprob, finished, and
chat's continue_final_message and chat_template. On a tiny random Llama over a byte tokenizer,
checked against the engine's own numbers and transformers' logits on the same weights."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from model_utils import tiny_text_model
from tallow import LLM, Logprob, SamplingParams

TOL = 1e-4  # float32 logprobs, the engine's kernels against transformers' eager torch
PROMPT = "The quick brown fox jumps over"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(LLM, transformers model) on the same tiny random weights."""
    path = tmp_path_factory.mktemp("tiny_llm_api")
    hf = tiny_text_model(path)
    llm = LLM(str(path), device="cpu", quantization="none", block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=2048)
    return llm, hf


@pytest.fixture(scope="module")
def llm(tiny):
    return tiny[0]


def reference(hf, ids: list[int]) -> torch.Tensor:
    """float64 log-softmax of transformers' logits at every position of ids: [len, V]."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)


def engine_outputs(llm, ids: list[int], params: SamplingParams):
    """The engine's TokenOutputs of one sequence, run on the LLM's own EngineCore."""
    [seq] = llm.engine.make_sequences(ids, params)
    llm.engine.add(seq)
    outs = []
    while llm.engine.has_work():
        outs += [out for s, out in llm.engine.step() if s is seq]
    return outs


def chosen(c) -> list[float]:
    """The chosen tokens' logprobs of a CompletionOutput."""
    return [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]


def summary(outs):
    return [(o.prompt, o.prompt_token_ids, [(c.text, c.token_ids, c.finish_reason) for c in o.outputs])
            for o in outs]


def test_generate_takes_vllms_keywords(llm):
    ids = llm.tokenizer.encode(PROMPT)
    want = summary(llm.generate(PROMPT, GREEDY))
    assert summary(llm.generate([PROMPT], GREEDY, use_tqdm=False)) == want
    assert summary(llm.generate(PROMPT, sampling_params=GREEDY, use_tqdm=lambda *a, **k: None)) == want
    assert summary(llm.generate(prompts=[PROMPT], sampling_params=[GREEDY], lora_request=None)) == want
    assert llm.generate([PROMPT], GREEDY)[0].finished is True
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate(PROMPT, GREEDY, lora_request=object())
    with pytest.raises(ValueError, match="LoRA"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, lora_request=object())
    assert not llm.engine.has_work()
    assert [o.prompt_token_ids for o in llm.generate(ids, GREEDY, use_tqdm=False)] == [ids]


def test_text_and_tokens_prompts(llm):
    ids = llm.tokenizer.encode(PROMPT)
    other = "Pack my box with"
    [text_out] = llm.generate(PROMPT, GREEDY)
    [ids_out] = llm.generate(ids, GREEDY)
    # singly
    assert summary(llm.generate({"prompt": PROMPT}, GREEDY)) == summary([text_out])
    assert summary(llm.generate({"prompt_token_ids": ids}, GREEDY)) == summary([ids_out])
    assert summary([ids_out])[0][0] is None  # token prompts have no text, as vLLM's
    # in a list, mixed with strings and id lists, in order
    mixed = llm.generate([{"prompt_token_ids": ids}, other, {"prompt": other}, ids, PROMPT], GREEDY)
    [other_out] = llm.generate(other, GREEDY)
    assert summary(mixed) == summary([ids_out, other_out, other_out, ids_out, text_out])
    assert [o.request_id for o in mixed] == ["0", "1", "2", "3", "4"]
    # a TokensPrompt with its text: the ids are used, the text is reported
    [both] = llm.generate({"prompt_token_ids": ids, "prompt": "whatever"}, GREEDY)
    assert both.prompt == "whatever" and summary([both])[0][1:] == summary([ids_out])[0][1:]


def test_unsupported_prompt_dicts_are_clear_errors(llm):
    ids = llm.tokenizer.encode(PROMPT)
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": None}}, GREEDY)
    with pytest.raises(ValueError, match="prompt_embeds"):
        # a bad prompt later in the list: nothing of the call reaches the engine
        llm.generate([PROMPT, {"prompt_embeds": [0.5]}], GREEDY)
    assert not llm.engine.has_work()
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({}, GREEDY)
    with pytest.raises(TypeError, match="integers"):
        llm.generate({"prompt_token_ids": [1.5, 2]}, GREEDY)
    with pytest.raises(TypeError, match="string"):
        llm.generate({"prompt": ids}, GREEDY)
    assert not llm.engine.has_work()


def test_logprobs_are_logprob_objects(tiny):
    llm, hf = tiny
    ids = llm.tokenizer.encode(PROMPT)
    params = dataclasses.replace(GREEDY, logprobs=3, prompt_logprobs=2)
    [out] = llm.generate({"prompt_token_ids": ids}, params)
    [choice] = out.outputs
    engine = engine_outputs(llm, ids, params)
    # The floats the engine gave (what LLM returned before Logprob objects), unchanged.
    assert choice.token_ids == [t for o in engine for t in o.token_ids]
    assert chosen(choice) == [lp for o in engine for lp in o.logprobs]
    tops = [top for o in engine for top in o.top_logprobs]
    for d, token, top in zip(choice.logprobs, choice.token_ids, tops):
        assert list(d) == [token] + [t for t, _ in top if t != token]
        assert all(d[t].logprob == lp for t, lp in top)
    assert [(e.token_id, e.logprob) for e in engine[0].prompt_logprobs] == [
        (t, out.prompt_logprobs[p][t].logprob) for p, t in enumerate(ids[1:], 1)]

    ref = reference(hf, ids + choice.token_ids)
    decode = lambda t: llm.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    assert len(choice.logprobs) == len(choice.token_ids) == 6
    for j, (d, token) in enumerate(zip(choice.logprobs, choice.token_ids)):
        row = ref[len(ids) - 1 + j]
        assert all(isinstance(v, Logprob) for v in d.values())
        assert list(d)[0] == token and token == row.argmax().item()  # greedy: the chosen is the argmax
        assert d[token].rank == 1
        assert len(d) == 3  # the chosen token is one of the top 3
        assert [v.rank for v in d.values()] == [1, 2, 3]
        assert [t for t, v in sorted(d.items(), key=lambda kv: kv[1].rank)] == row.topk(3).indices.tolist()
        for t, v in d.items():
            assert v.logprob == pytest.approx(row[t].item(), abs=TOL)
            assert v.decoded_token == decode(t)
    assert choice.cumulative_logprob == pytest.approx(math.fsum(chosen(choice)))
    assert choice.cumulative_logprob == pytest.approx(
        sum(ref[len(ids) - 1 + j, t].item() for j, t in enumerate(choice.token_ids)), abs=6 * TOL)

    # The greedy continuation scored as a prompt: each of its tokens is the argmax there, so in
    # the top list with rank 1, and its logprob is the one it had when sampled.
    [scored] = llm.generate({"prompt_token_ids": ids + choice.token_ids}, dataclasses.replace(params, max_tokens=1))
    for j, token in enumerate(choice.token_ids):
        d = scored.prompt_logprobs[len(ids) + j]
        assert list(d)[0] == token and len(d) == 2 and d[token].rank == 1
        assert d[token].logprob == pytest.approx(choice.logprobs[j][token].logprob, abs=TOL)

    # Prompt logprobs: None first, then the prompt token (first, its rank from the engine) and the top 2.
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        d, token, row = out.prompt_logprobs[p], ids[p], ref[p - 1]
        entry = engine[0].prompt_logprobs[p - 1]
        assert list(d)[0] == token
        assert d[token].logprob == entry.logprob == pytest.approx(row[token].item(), abs=TOL)
        assert d[token].decoded_token == PROMPT[p]
        top = [t for t, _ in entry.top]
        if token in top:  # vLLM's: a chosen token in the top list ranks by its place there
            assert d[token].rank == top.index(token) + 1 and len(d) == 2
        else:
            assert d[token].rank == entry.rank and len(d) == 3
            # rank: 1 + the tokens more likely (near-ties may go either way)
            better = lambda margin: (row > row[token] + margin).sum().item() + 1  # noqa: E731
            assert better(TOL) <= d[token].rank <= better(-TOL)
        assert [d[t].rank for t in top] == [1, 2]
        assert top == row.topk(2).indices.tolist()
        for t in top:
            assert d[t].logprob == pytest.approx(row[t].item(), abs=TOL)


def test_logprobs_without_alternatives_and_without_logprobs(llm):
    ids = llm.tokenizer.encode(PROMPT)
    [plain] = llm.generate(ids, GREEDY)
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    assert plain.prompt_logprobs is None and plain.finished is True
    # logprobs=0: the chosen token alone; tallow's sampler computes no rank for it, so None.
    [out] = llm.generate(ids, dataclasses.replace(GREEDY, logprobs=0, prompt_logprobs=0))
    choice = out.outputs[0]
    assert [list(d) for d in choice.logprobs] == [[t] for t in choice.token_ids]
    assert all(d[t].rank is None for d, t in zip(choice.logprobs, choice.token_ids))
    assert choice.cumulative_logprob == pytest.approx(math.fsum(chosen(choice)))
    assert choice.cumulative_logprob < 0
    # prompt_logprobs=0: the prompt token alone, with its rank
    assert [list(d) for d in out.prompt_logprobs[1:]] == [[t] for t in ids[1:]]
    assert all(isinstance(d[t].rank, int) and d[t].rank >= 1 for d, t in zip(out.prompt_logprobs[1:], ids[1:]))
    # Sampled (not greedy) with one alternative: a chosen token outside the top 1 has no rank
    # and the dict holds both; inside it, rank 1.
    sampled = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True, seed=3, logprobs=1, n=2)
    [out] = llm.generate(ids, sampled)
    for c in out.outputs:
        assert c.cumulative_logprob == pytest.approx(math.fsum(chosen(c)))
        for d, t in zip(c.logprobs, c.token_ids):
            assert list(d)[0] == t
            if len(d) == 1:
                assert d[t].rank == 1
            else:
                assert d[t].rank is None and [v.rank for v in d.values()] == [None, 1]


def test_chat_continue_final_message_and_chat_template(llm, tmp_path):
    tok = llm.tokenizer
    conv = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    one = dataclasses.replace(GREEDY, max_tokens=1)
    [out] = llm.chat(conv, one, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    text = tok.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\nThe colour is")
    # the default: the assistant turn is closed and a new one opened
    [closed] = llm.chat(conv, one, use_tqdm=False)
    assert tok.decode(closed.prompt_token_ids, skip_special_tokens=False).endswith(
        "The colour is<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(conv, one, continue_final_message=True)  # add_generation_prompt is true by default, as vLLM's

    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last %}|{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    [custom] = llm.chat(conv, one, chat_template=template)
    assert tok.decode(custom.prompt_token_ids) == "<user>Name a colour.|<assistant>The colour is<assistant>"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    [from_file] = llm.chat(conv, one, chat_template=str(path), add_generation_prompt=False,
                           continue_final_message=True)
    assert tok.decode(from_file.prompt_token_ids) == "<user>Name a colour.|<assistant>The colour is"
    # the override is for that call only
    [again] = llm.chat(conv, one)
    assert again.prompt_token_ids == closed.prompt_token_ids
    # vLLM's positional order: messages, sampling_params, use_tqdm, lora_request, chat_template
    [positional] = llm.chat(conv, one, False, None, template)
    assert positional.prompt_token_ids == custom.prompt_token_ids


# ---- vLLM parity: errors, options, structured outputs, stop_reason, tokenizer --------------------

def test_bfloat16_and_float16_run_on_the_cpu_with_quantized_weights():
    """The CPU's quantized linears return float32 while the KV cache holds the model's dtype: the
    K/V are written in the cache's dtype. Greedy text agrees with float32's at the start."""
    from tallow.engine.sampling import SamplingParams as SP

    params = SP(temperature=0.0, max_tokens=6)
    texts = {}
    for dtype in ("float32", "bfloat16", "float16"):
        llm = LLM("default", dtype=dtype, device="cpu")
        [out] = llm.generate("Once upon a time", params)
        c = out.outputs[0]
        assert c.finish_reason == "length" and c.text, (dtype, c)
        texts[dtype] = c.text
        del llm
    assert texts["bfloat16"][:8] == texts["float32"][:8]
    assert texts["float16"][:8] == texts["float32"][:8]


def test_bad_requests_are_errors_before_anything_runs(llm):
    from tallow.engine.grammar import GrammarSpec

    ok = SamplingParams(temperature=0.0, max_tokens=3)
    with pytest.raises(ValueError, match="request 1: the grammar"):
        llm.generate([PROMPT, PROMPT], [ok, SamplingParams(max_tokens=3, grammar=GrammarSpec("regex", "("))])
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"5": 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: math.nan})
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=["5"])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(PROMPT, SamplingParams(max_tokens=3, logit_bias={10**7: 1.0}))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(PROMPT, SamplingParams(max_tokens=3, stop_token_ids=[10**7]))
    assert not llm.engine.has_work()


def test_a_request_the_engine_fails_raises_with_the_other_results(llm, monkeypatch):
    """A sequence that ends with finish_reason "error" is a RequestError naming its reason, not a
    silent ''; the call's other results come with it (.outputs)."""
    import tallow.llm
    from tallow import RequestError
    from tallow.engine.grammar import GrammarSpec

    monkeypatch.setattr(tallow.llm, "check_grammar", lambda spec, tok: None)  # let it reach the engine
    ok = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with pytest.raises(RequestError, match="request 1 .*regex") as info:
        llm.generate([PROMPT, PROMPT], [ok, SamplingParams(max_tokens=3, grammar=GrammarSpec("regex", "("))])
    first, second = info.value.outputs
    assert first.outputs[0].finish_reason == "length" and len(first.outputs[0].token_ids) == 3
    assert second.outputs[0].finish_reason == "error"
    assert not llm.engine.has_work()


def test_vllms_no_op_engine_options(tiny, tmp_path):
    llm = tiny[0]
    path = llm.config.model
    same = dict(device="cpu", quantization="none", block_size=4, num_kv_blocks=16)
    other = LLM(path, trust_remote_code=True, swap_space=4, disable_log_stats=True, download_dir=str(tmp_path),
                tokenizer_mode="auto", tokenizer=path, **same)
    assert summary(other.generate(PROMPT, GREEDY)) == summary(llm.generate(PROMPT, GREEDY))
    with pytest.raises(ValueError, match="tokenizer="):
        LLM(path, tokenizer="gpt2", **same)
    with pytest.raises(ValueError, match="tokenizer_mode"):
        LLM(path, tokenizer_mode="slow", **same)
    with pytest.raises(TypeError, match="unknown engine options"):
        LLM(path, not_an_option=1, **same)


def test_structured_outputs_params(llm):
    import json

    from tallow import GrammarSpec, GuidedDecodingParams, StructuredOutputsParams

    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    p = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    assert p.grammar.kind == "json_schema"
    compiled = json.loads(p.grammar.text)
    assert list(compiled["properties"]) == ["b", "a"] and compiled["additionalProperties"] is False
    assert compiled["x-guidance"]["lenient"] is True
    assert dataclasses.replace(p, seed=4).grammar == p.grammar  # as make_sequences copies it for n > 1
    assert SamplingParams(structured_outputs=StructuredOutputsParams(json=json.dumps(schema))).grammar == p.grammar
    assert SamplingParams(guided_decoding=GuidedDecodingParams(json=schema)).grammar == p.grammar
    assert SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")).grammar == GrammarSpec("regex", "a+")
    assert SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)).grammar.kind == "json_object"
    assert SamplingParams(structured_outputs=StructuredOutputsParams(grammar='start: "x"')).grammar.kind == "lark"
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    # GrammarSpec("json_schema", dict): its compact JSON, key order kept
    spec = SamplingParams(grammar=GrammarSpec("json_schema", schema)).grammar
    assert spec.text == json.dumps(schema, separators=(",", ":"))
    choice = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    [out] = llm.generate(PROMPT, choice)
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"


def test_chat_prompt_is_the_rendered_text(llm):
    [out] = llm.chat([{"role": "user", "content": "hi"}], dataclasses.replace(GREEDY, max_tokens=1))
    assert out.prompt is not None and out.prompt.endswith("<|im_start|>assistant\n")
    assert llm.tokenizer.encode(out.prompt) == out.prompt_token_ids


def test_stop_reason_is_none_for_eos_and_the_id_for_stop_token_ids(llm):
    eos = llm.tokenizer.eos_token_id
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, logit_bias={eos: 100.0}))
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", None, [eos])
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, logit_bias={65: 100.0},
                                                stop_token_ids=[65]))
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", 65)


def test_sampling_params_type_and_range_errors():
    with pytest.raises(ValueError, match="min_tokens must be less than or equal to max_tokens"):
        SamplingParams(min_tokens=20, max_tokens=5)
    with pytest.raises(ValueError, match="n must be an int"):
        SamplingParams(n=2.0)
    with pytest.raises(ValueError, match="seed must be an int"):
        SamplingParams(seed="5")
    assert SamplingParams(min_tokens=20, max_tokens=None).min_tokens == 20


def test_get_tokenizer_has_transformers_methods(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("hello")
    assert ids == llm.tokenizer.encode("hello", add_special_tokens=True)
    assert tok("hello") == {"input_ids": ids} and tok.decode(ids) == "hello"
    assert len(tok) == tok.vocab_size == llm.tokenizer.vocab_size
    assert tok.eos_token_id == llm.tokenizer.eos_token_id and tok.eos_token == llm.tokenizer.eos_token
    assert "".join(tok.convert_ids_to_tokens(ids)) == "hello"
    conv = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    [out] = llm.chat(conv, dataclasses.replace(GREEDY, max_tokens=1))
    assert text == out.prompt
    assert tok.apply_chat_template(conv, add_generation_prompt=True) == out.prompt_token_ids
