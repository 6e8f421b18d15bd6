"""Structured output, engine side: grammar specs checked by llguidance, per-row token masks in
the batched sampler (checked against llguidance's own matcher), the compile wait in the scheduler,
jump-forward, n > 1, seeds, preemption and abort.

Engine cases run a small random model with the default model's tokenizer (49152 tokens: the
SmolLM2 architecture cut to 2 narrow layers), so the grammar, not the model, decides validity;
greedy outputs are compared with an independent reference: llguidance's matcher deciding the
allowed tokens and the model's logits from a full prefill of the context at every token.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading

import jsonschema
import llguidance as llg
import numpy as np
import pytest
import torch

from tallow.config import EngineConfig
from tallow.engine.core import EngineCore
from tallow.engine.grammar import (GrammarError, GrammarSpec, GrammarState, check_grammar, grammar_backend,
                                   unpack_bitmasks)
from tallow.engine.request import Sequence, SequenceStatus
from tallow.engine.sampler import Sampler
from tallow.engine.sampling import SamplingParams
from tallow.models.dummy import PRESETS
from model_utils import PagedBatches

TINY_PRESET = "tiny-smollm2-grammar"


def schema_spec(schema: dict, start_after=None) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema, separators=(",", ":")), start_after)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "active"], "additionalProperties": False}


def bounded_schemas(count: int) -> list[dict]:
    """Distinct schemas whose every instance is short (so no run is cut by max_tokens)."""
    out = []
    for i in range(count):
        props = {f"field_{i}_{j}": kind for j, kind in enumerate([
            {"type": "boolean"},
            {"enum": [f"v{i}", f"w{i}", "x"]},
            {"type": "integer", "minimum": -5, "maximum": 9 + i},
            {"type": "string", "maxLength": 1 + i % 4},
            {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 1 + i % 3},
        ][: 1 + i % 5])}
        out.append({"type": "object", "properties": props, "required": sorted(props),
                    "additionalProperties": False})
    return out


@pytest.fixture(scope="module")
def tiny_loaded():
    from tallow.models.loader import load_model

    PRESETS[TINY_PRESET] = dict(PRESETS["smollm2-135m"], hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    try:
        yield load_model(f"dummy:{TINY_PRESET}", dtype=torch.float32, device=torch.device("cpu"))
    finally:
        del PRESETS[TINY_PRESET]


def make_core(loaded, **overrides) -> EngineCore:
    cfg = dataclasses.replace(EngineConfig(model=f"dummy:{TINY_PRESET}", device="cpu", quantization="none",
                                           async_scheduling=False), **overrides)
    return EngineCore(cfg, loaded=loaded)


@pytest.fixture(scope="module")
def core(tiny_loaded):
    return make_core(tiny_loaded)


@pytest.fixture(scope="module")
def tokenizer(core):
    return core.tokenizer


def run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]):
    seqs = [s for ids, p in zip(prompts, params) for s in core.make_sequences(ids, p)]
    outs: dict[int, list] = {s.seq_id: [] for s in seqs}
    for s in seqs:
        core.add(s)
    steps = 0
    while core.has_work():
        for seq, out in core.step():
            outs[seq.seq_id].append(out)
        steps += 1
        assert steps < 10_000
    return seqs, outs


def text_of(core, seq) -> str:
    return core.tokenizer.decode(seq.output_ids)


# ---- the spec and its check -------------------------------------------------------------------

@pytest.mark.parametrize("spec, reason", [
    (GrammarSpec("regex", "a("), "unclosed group"),
    (GrammarSpec("regex", "(?=a)b"), "look-around"),
    (GrammarSpec("json_schema", '{"type":"strin"}'), "strin"),
    (GrammarSpec("json_schema", '{"properties":{"a":{"$ref":"#/nowhere"}},"type":"object"}'), "nowhere"),
    (GrammarSpec("json_schema", "{not json"), "invalid json_schema"),
    (GrammarSpec("json_schema", "[1]"), "must be an object"),
    (GrammarSpec("choice", "[]"), "non-empty list"),
    (GrammarSpec("choice", '["a", 1]'), "non-empty list"),
    (GrammarSpec("lark", "start: undefined_rule"), "undefined_rule"),
])
def test_a_rejected_grammar_raises_grammar_error_with_the_backends_reason(tokenizer, spec, reason):
    with pytest.raises(GrammarError, match=None) as e:
        check_grammar(spec, tokenizer)
    assert reason in str(e.value)
    assert isinstance(e.value, ValueError)


def test_size_cap_and_spec_validation(tokenizer):
    backend = grammar_backend(tokenizer)
    big = GrammarSpec("regex", "a" * (backend.limits.max_text_bytes + 1))
    with pytest.raises(GrammarError, match="over the limit"):
        check_grammar(big, tokenizer)
    with pytest.raises(GrammarError):
        GrammarSpec("yaml", "")
    with pytest.raises(GrammarError):
        GrammarSpec("regex", "a", start_after=())
    with pytest.raises(Exception, match="grammar"):
        SamplingParams(grammar={"type": "json_object"})


def test_accepted_kinds_compile_and_are_cached(tokenizer):
    backend = grammar_backend(tokenizer)
    specs = [schema_spec(PERSON), GrammarSpec("json_object", ""), GrammarSpec("regex", r"[0-9]{3}-[a-z]+"),
             GrammarSpec("choice", json.dumps(["yes", "no", 'say "hi"\n', "é"])),
             GrammarSpec("lark", 'start: "call " %json{"type": "integer"}')]
    for spec in specs:
        check_grammar(spec, tokenizer)
        first = backend.compile(spec)
        assert first.result(timeout=30) is not None
        assert backend.compile(spec) is first  # the cache's entry


def test_choice_allows_exactly_its_strings(tokenizer):
    choices = ["yes", "no", 'say "hi"\n', "é", ""]
    matcher = grammar_backend(tokenizer).compile(GrammarSpec("choice", json.dumps(choices))).result(timeout=30)
    for text in choices + ["maybe", "yess", "n"]:
        m = matcher.deep_copy()
        ids = tokenizer.encode(text)
        ok = m.try_consume_tokens(ids) == len(ids) and m.is_accepting()
        assert ok == (text in choices), text


# ---- masks in the sampler ------------------------------------------------------------------------

def test_unpacked_bitmask_is_llguidances_layout():
    rng = np.random.default_rng(0)
    words = rng.integers(-2**31, 2**31, size=(3, 7), dtype=np.int64).astype(np.int32)
    vocab = 7 * 32 - 5
    logits = np.zeros((3, vocab), dtype=np.float32)
    from llguidance.numpy import apply_token_bitmask_inplace

    apply_token_bitmask_inplace(logits, words.copy())
    expected = np.isfinite(logits)
    assert (unpack_bitmasks(torch.from_numpy(words), vocab).numpy() == expected).all()


def _grammar_seq(spec: GrammarSpec, params: SamplingParams, backend) -> Sequence:
    seq = Sequence([1, 2, 3], dataclasses.replace(params, grammar=spec))
    seq.grammar = GrammarState(spec, backend)
    seq.grammar.future.result(timeout=30)
    assert seq.grammar.bind() is None
    return seq


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.0),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.7, top_k=40, min_p=0.05, presence_penalty=0.5, repetition_penalty=1.2),
    dict(temperature=1.3, seed=5, logit_bias={39428: 30.0, 0: 5.0}, logprobs=3),
])
def test_masks_agree_with_llguidances_matcher_on_random_logits(tokenizer, sampling):
    """Rows under different grammars (and one free row) sample from random logits for several steps:
    every masked logit is exactly one llguidance's own logit bias forbids, every sampled token is
    one an independent matcher accepts, and logprobs are those of the masked distribution."""
    backend = grammar_backend(tokenizer)
    specs = [schema_spec(PERSON), GrammarSpec("regex", r"(ab|cd)[0-9]+x"), None,
             GrammarSpec("json_object", ""), GrammarSpec("choice", '["alpha", "beta", "gamma"]')]
    params = SamplingParams(max_tokens=100, **sampling)
    seqs = [_grammar_seq(s, params, backend) if s else Sequence([1, 2, 3], params) for s in specs]
    refs = [llg.LLMatcher(backend.ll_tokenizer, llg.LLMatcher.grammar_from_json_schema(
        s.text, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        if s.kind == "json_schema" else llg.grammar_from("regex", s.text) if s.kind == "regex"
        else llg.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults={
            "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        if s.kind == "json_object" else llg.grammar_from("lark", 'start: "alpha" | "beta" | "gamma"'))
        if s else None for s in specs]
    vocab = backend.vocab_size
    sampler = Sampler(vocab, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for step in range(12):
        live = [i for i, s in enumerate(seqs) if not s.is_finished]
        logits = torch.randn(len(live), vocab, generator=gen) * 4
        before = logits.clone()
        rows = [seqs[i] for i in live]
        processed = sampler._apply_grammars(sampler.process_logits(logits, rows), logits, rows)
        out = sampler(logits, rows)
        assert torch.equal(logits, before), "the caller's logits were changed"
        for j, i in enumerate(live):
            t = int(out.token_ids[j])
            if refs[i] is None:
                assert torch.isfinite(processed[j]).all()
                continue
            allowed = np.frombuffer(refs[i].compute_logit_bias(), dtype=np.uint8)[:vocab] > 0
            assert (torch.isfinite(processed[j]).numpy() == allowed).all(), (i, step)
            assert allowed[t]
            if out.logprobs is not None:
                masked = processed[j].log_softmax(-1)
                assert math.isclose(float(out.logprobs[j]), float(masked[t]), rel_tol=1e-5, abs_tol=1e-5)
                assert all(allowed[int(k)] or not math.isfinite(float(v))
                           for k, v in zip(out.top_ids[j], out.top_logprobs[j]))
            assert refs[i].consume_token(t)
            seq = seqs[i]
            seq.append_token(t)
            reason, forced = seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens, jump_forward=True)
            if forced:
                assert refs[i].consume_tokens(forced)
                seq.token_ids.extend(forced)
            if reason is not None:
                assert reason == "stop" and refs[i].is_stopped()
                seq.status = SequenceStatus.FINISHED


# ---- through the engine ------------------------------------------------------------------------

PROMPTS = ["Give me a JSON object:", "The user record is", "Answer in JSON.", "{"]


def test_outputs_validate_and_finish_with_stop(core):
    """Greedy and seeded temperature-1 outputs of bounded schemas parse and validate with jsonschema;
    regex and choice outputs match; each ends with "stop" when its grammar is complete."""
    import re

    schemas = [PERSON] + bounded_schemas(5)
    prompts = [core.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(len(schemas))]
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=11), dict(temperature=1.0, top_p=0.8, seed=3)):
        params = [SamplingParams(max_tokens=200, grammar=schema_spec(s), **sampling) for s in schemas]
        params += [SamplingParams(max_tokens=60, grammar=GrammarSpec("regex", r"[A-Z][a-z]{2,6}-[0-9]{2}"), **sampling),
                   SamplingParams(max_tokens=60, grammar=GrammarSpec("choice", '["red", "green", "blue"]'), **sampling)]
        seqs, _ = run(core, prompts + prompts[:2], params)
        for seq, schema in zip(seqs, schemas):
            assert seq.finish_reason == "stop", (text_of(core, seq), schema)
            jsonschema.validate(json.loads(text_of(core, seq)), schema)
        assert re.fullmatch(r"[A-Z][a-z]{2,6}-[0-9]{2}", text_of(core, seqs[-2]))
        assert text_of(core, seqs[-1]) in ("red", "green", "blue")
        assert all(s.grammar.matcher is None for s in seqs), "a finished sequence kept its matcher"


def reference_greedy(core: EngineCore, prompt: list[int], spec: GrammarSpec, max_tokens: int,
                     jump_forward: bool) -> tuple[list[int], int]:
    """Greedy decoding under the grammar, independently of the engine: llguidance's matcher
    (built here from the spec) says which tokens are allowed, the model's logits come from a full
    prefill of the context each token; with jump_forward, tokens the matcher forces are appended
    as they are. Returns the output ids and how many were forced."""
    backend = grammar_backend(core.tokenizer)
    m = llg.LLMatcher(backend.ll_tokenizer, llg.LLMatcher.grammar_from_json_schema(
        spec.text, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}))
    model = core.loaded.model
    vocab = core.model_config.vocab_size
    out: list[int] = []
    forced_count = 0
    if jump_forward:  # forced from the start, unless they would complete the grammar
        forced = m.compute_ff_tokens()
        probe = m.deep_copy()
        if forced and len(forced) < max_tokens and probe.consume_tokens(forced) and not probe.is_stopped():
            assert m.consume_tokens(forced)
            out += forced
            forced_count += len(forced)
    while len(out) < max_tokens:
        batch = PagedBatches(core.model_config, num_blocks=64, block_size=16)
        ids, pos, meta = batch.step([(0, prompt + out)])
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, pos, batch.kv_caches, meta)[-1:])[0, :vocab]
        allowed = torch.from_numpy(np.frombuffer(m.compute_logit_bias(), dtype=np.uint8)[:vocab] > 0)
        t = int(logits.masked_fill(~allowed, -math.inf).argmax())
        assert m.consume_token(t)
        out.append(t)
        if m.is_stopped() or t in core.eos_token_ids:
            break
        if jump_forward:  # forced after a sampled token
            forced = m.compute_ff_tokens()[: max_tokens - len(out)]
            if forced:
                assert m.consume_tokens(forced)
                out += forced
                forced_count += len(forced)
                if m.is_stopped():
                    break
    return out, forced_count


@pytest.mark.parametrize("jump_forward", [True, False])
def test_greedy_output_equals_an_independent_reference_and_fill_is_counted(tiny_loaded, jump_forward):
    """Long fixed keys: with jump-forward the forced tokens (the grammar's canonical tokenization)
    are appended without sampling and counted in TokenOutput.fill; without it every token is
    the masked argmax. Either way the engine's output is the reference's, token for token."""
    core = make_core(tiny_loaded, grammar_jump_forward=jump_forward)
    schema = {"type": "object", "additionalProperties": False,
              "required": ["customer_identification_number", "shipping_address_line_one", "express"],
              "properties": {"customer_identification_number": {"type": "integer", "minimum": 0, "maximum": 999},
                             "shipping_address_line_one": {"enum": ["12 High Street", "Main Road 5"]},
                             "express": {"type": "boolean"}}}
    spec = schema_spec(schema)
    prompts = [core.tokenizer.encode(p) for p in PROMPTS[:2]]
    seqs, outs = run(core, prompts, [SamplingParams(temperature=0.0, max_tokens=120, grammar=spec)] * 2)
    for seq, prompt in zip(seqs, prompts):
        expected, forced = reference_greedy(core, prompt, spec, 120, jump_forward)
        assert seq.output_ids == expected
        outputs = outs[seq.seq_id]
        assert [t for o in outputs for t in o.token_ids] == expected
        assert outputs[-1].fill == forced == seq.grammar.fill
        assert (forced > 10) == jump_forward
        assert seq.finish_reason == "stop"
        jsonschema.validate(json.loads(text_of(core, seq)), schema)


def test_batch_of_32_schemas_mixed_with_free_rows_equals_each_alone(core):
    schemas = bounded_schemas(32)
    tok = core.tokenizer
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)] + " " * (i % 3)) for i in range(32)]
    constrained = [SamplingParams(temperature=0.0, max_tokens=80, grammar=schema_spec(s)) for s in schemas]
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    free_prompts = [tok.encode(p) for p in PROMPTS]
    seqs, _ = run(core, prompts + free_prompts, constrained + [free] * len(free_prompts))
    together = [s.output_ids for s in seqs]
    alone = [run(core, [p], [sp])[0][0].output_ids for p, sp in zip(prompts + free_prompts,
                                                                  constrained + [free] * len(free_prompts))]
    assert together == alone
    for seq, schema in zip(seqs, schemas):
        jsonschema.validate(json.loads(text_of(core, seq)), schema)


def test_seeds_reproduce_and_n_choices_each_follow_the_grammar(core):
    prompt = core.tokenizer.encode("Record:")
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, seed=1234, max_tokens=200, grammar=schema_spec(PERSON))
    first, _ = run(core, [prompt], [params])
    again, _ = run(core, [prompt], [params])
    assert [s.output_ids for s in first] == [s.output_ids for s in again]
    assert len({tuple(s.output_ids) for s in first}) > 1, "seeded choices should differ"
    for seq in first:
        jsonschema.validate(json.loads(text_of(core, seq)), PERSON)


def test_preemption_keeps_outputs_and_abort_frees_the_matcher(tiny_loaded, core):
    schemas = bounded_schemas(8)
    tok = core.tokenizer
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=80, grammar=schema_spec(s)) for s in schemas]
    reference = [s.output_ids for s in run(core, prompts, params)[0]]
    small = make_core(tiny_loaded, num_kv_blocks=24, block_size=4, enable_prefix_caching=False)
    free0 = small.kv.num_free_blocks
    seqs, _ = run(small, prompts, params)
    assert small.scheduler.num_preemptions_total > 0, "the pool was meant to be too small"
    assert [s.output_ids for s in seqs] == reference
    assert small.kv.num_free_blocks == free0
    assert all(s.grammar.matcher is None for s in seqs)

    seq = core.make_sequences(prompts[0], SamplingParams(temperature=1.0, seed=1, max_tokens=50, ignore_eos=True,
                                                         grammar=GrammarSpec("regex", "[a-z]{200}")))[0]
    core.add(seq)
    while seq.num_computed_tokens == 0:
        core.step()
    assert seq.grammar.matcher is not None and not seq.is_finished
    core.abort(seq)
    assert seq.grammar.matcher is None and seq.finish_reason == "abort"
    assert not core.has_work()


def test_a_compiling_grammar_waits_in_the_queue_without_stalling_free_rows(core):
    backend = grammar_backend(core.tokenizer)
    gate = threading.Event()
    slow = schema_spec({"type": "object", "properties": {"slow": {"type": "boolean"}}, "required": ["slow"],
                        "additionalProperties": False})
    backend.compile_delay_hook = lambda spec: gate.wait(30) if spec == slow else None
    try:
        tok = core.tokenizer
        waiting = core.make_sequences(tok.encode("Slow:"), SamplingParams(temperature=0.0, max_tokens=30, grammar=slow))[0]
        free = core.make_sequences(tok.encode("Free:"), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
        core.add(waiting)
        core.add(free)
        steps = 0
        while not free.is_finished:
            core.step()
            steps += 1
            assert steps < 100
        assert free.num_output_tokens == 12
        assert waiting.num_output_tokens == 0 and waiting.num_computed_tokens == 0 and not waiting.is_finished
    finally:
        gate.set()
    while core.has_work():
        core.step()
    backend.compile_delay_hook = None
    assert waiting.finish_reason == "stop"
    assert json.loads(text_of(core, waiting)) in ({"slow": True}, {"slow": False})


def test_a_grammar_that_fails_in_the_engine_fails_its_sequence_alone(core):
    """A spec that never went through check_grammar and cannot compile: its sequence ends with
    "error" and the rest of the batch runs on."""
    tok = core.tokenizer
    bad = core.make_sequences(tok.encode("x"), SamplingParams(max_tokens=5, grammar=GrammarSpec("regex", "(")))[0]
    good = core.make_sequences(tok.encode("y"), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    outputs = {}
    core.add(bad)
    core.add(good)
    while core.has_work():
        for seq, out in core.step():
            outputs.setdefault(seq.seq_id, []).append(out)
    assert bad.finish_reason == "error" and bad.num_output_tokens == 0
    assert outputs[bad.seq_id][-1].finish_reason == "error"
    assert good.finish_reason == "length" and good.num_output_tokens == 5


def test_start_after_leaves_the_reasoning_free(core):
    """The grammar applies once the output ends with the marker: here the marker is the two tokens
    the model writes first unconstrained, so those stay what they were and the rest is JSON."""
    tok = core.tokenizer
    prompt = tok.encode("Think first.")
    free, _ = run(core, [prompt], [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)])
    marker = tuple(free[0].output_ids)
    spec = schema_spec(PERSON, start_after=marker)
    seqs, _ = run(core, [prompt], [SamplingParams(temperature=0.0, max_tokens=200, grammar=spec)])
    out = seqs[0].output_ids
    assert tuple(out[:2]) == marker
    jsonschema.validate(json.loads(tok.decode(out[2:])), PERSON)
    assert seqs[0].finish_reason == "stop"


def test_logprobs_are_those_of_the_masked_distribution(core):
    tok = core.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=10,
                            grammar=GrammarSpec("choice", '["yes", "no"]'))
    seqs, outs = run(core, [tok.encode("Yes or no?")], [params])
    first = outs[seqs[0].seq_id][0]
    top = first.top_logprobs[0]
    # The first token may be any token that starts "yes" or "no" ("y", "ye", "yes", "n", "no").
    allowed = {t for t in range(tok.vocab_size) if tok.token_bytes(t) and (
        b"yes".startswith(tok.token_bytes(t)) or b"no".startswith(tok.token_bytes(t)))}
    assert 2 <= len(allowed) < 10
    finite = {t: lp for t, lp in top if math.isfinite(lp)}
    assert set(finite) == allowed
    # The allowed tokens hold all the probability: the masked distribution's logprobs.
    assert math.isclose(math.log(sum(math.exp(lp) for lp in finite.values())), 0.0, abs_tol=1e-4)
    assert text_of(core, seqs[0]) in ("yes", "no")


def test_llm_generate_takes_a_grammar(tiny_loaded):
    from tallow.llm import LLM

    llm = LLM.__new__(LLM)
    llm.engine = make_core(tiny_loaded)
    llm.tokenizer = llm.engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=200, grammar=schema_spec(PERSON))
    outs = llm.generate(["Person:", "Someone:"], params)
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
        assert out.outputs[0].finish_reason == "stop"


def test_compile_cache_is_an_lru_bounded_by_bytes(tokenizer):
    from tallow.engine.grammar import GrammarBackend, GrammarLimits

    specs = [GrammarSpec("regex", f"[a-z]{{{i}}}") for i in range(1, 6)]
    one = 64 * 1024 + 16 * len(specs[0].text)  # the estimate of one of them
    backend = GrammarBackend(tokenizer, limits=GrammarLimits(cache_bytes=3 * one + 100))
    try:
        futures = [backend.compile(s) for s in specs[:3]]
        assert backend.compile(specs[0]) is futures[0]  # a hit, now the most recent
        backend.compile(specs[3])  # evicts specs[1], the least recently used
        assert backend.cache_size() == 3 and backend.cache_bytes <= 3 * one + 100
        assert backend.compile(specs[0]) is futures[0]
        assert backend.compile(specs[1]) is not futures[1]  # compiled again
        for s in specs:
            assert backend.compile(s).result(timeout=30) is not None
    finally:
        backend.shutdown()


def test_a_grammar_past_the_compile_time_limit_fails_its_sequence(core):
    from tallow.engine.grammar import GrammarLimits

    backend = grammar_backend(core.tokenizer)
    gate = threading.Event()
    stuck = GrammarSpec("regex", "stuck[0-9]")
    limits = backend.limits
    backend.compile_delay_hook = lambda spec: gate.wait(30) if spec == stuck else None
    backend.limits = GrammarLimits(compile_timeout_s=0.2)
    try:
        seq = core.make_sequences(core.tokenizer.encode("x"), SamplingParams(max_tokens=5, grammar=stuck))[0]
        core.add(seq)
        outputs = []
        steps = 0
        while core.has_work():
            outputs += core.step()
            steps += 1
            assert steps < 500
        assert seq.finish_reason == "error" and seq.num_output_tokens == 0
        assert outputs[-1][1].finish_reason == "error"
        # the request's own doing: the output says why (the server's 400, not a 500)
        assert outputs[-1][1].error == "its grammar cannot be used: the grammar did not compile within 0.2 s"
    finally:
        gate.set()
        backend.limits = limits
        backend.compile_delay_hook = None
        backend.clear_cache()


def test_usage_reports_fill_only_when_not_zero():
    from tallow.serve.executor import Usage
    from tallow.serve.protocols.base import usage_json

    plain = Usage(prompt_tokens=5, completion_tokens=7, cached_tokens=2)
    filled = Usage(prompt_tokens=5, completion_tokens=7, cached_tokens=2, fill=4)
    assert "fill" not in plain.to_openai() and filled.to_openai()["fill"] == 4
    for usage in (plain, filled):
        assert json.loads(usage_json(usage)) == usage.to_openai()


def test_asynchronous_scheduling_gives_the_same_outputs_with_grammar_rows_joining(tiny_loaded, core):
    """With async_scheduling grammar rows run in asynchronous steps too (the forward is queued,
    the step before resolved and the masks filled, then the step sampled): free rows running
    asynchronously when grammar rows join mid-run, and after they end, get the tokens of the
    synchronous loop."""
    tok = core.tokenizer
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    schemas = bounded_schemas(3)

    def drive(engine: EngineCore):
        first = [engine.make_sequences(tok.encode(p), free)[0] for p in PROMPTS]
        for s in first:
            engine.add(s)
        for _ in range(5):
            engine.step()
        late = [engine.make_sequences(tok.encode(PROMPTS[i]), SamplingParams(
            temperature=0.0, max_tokens=80, grammar=schema_spec(schemas[i])))[0] for i in range(3)]
        for s in late:
            engine.add(s)
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
            assert steps < 1000
        return [(s.output_ids, s.finish_reason) for s in first + late], engine.num_overlapped_steps

    asyn = make_core(tiny_loaded, async_scheduling=True)
    got, overlapped = drive(asyn)
    expected, _ = drive(core)
    assert got == expected
    assert overlapped > 0


LONG_KEYS = {"type": "object", "additionalProperties": False, "properties": {
    "customer_account_identification_number": {"type": "integer", "minimum": 0, "maximum": 99},
    "preferred_shipping_method": {"enum": ["standard", "express"]},
    "subscribed_to_marketing_newsletter": {"type": "boolean"}},
    "required": ["customer_account_identification_number", "preferred_shipping_method",
                 "subscribed_to_marketing_newsletter"]}


@pytest.mark.parametrize("chunk_max_seqs", [None, 0])
def test_asynchronous_grammar_steps_with_jump_forward_equal_synchronous(tiny_loaded, core, chunk_max_seqs):
    """Grammar rows from the first step, with long forced keys (jump-forward) and free rows beside
    them: asynchronous steps (the masks of step N+1 filled after step N is resolved, a row
    launched before its sequence's forced tokens were known dropped) give the synchronous loop's
    tokens, fill counts and finish reasons; the steps overlap. chunk_max_seqs 0: forced tokens
    computed one per step (single-token rows that do not sample), with the same tokens."""
    tok = core.tokenizer
    spec = schema_spec(LONG_KEYS)
    schemas = bounded_schemas(3)
    requests = [SamplingParams(temperature=0.0, max_tokens=120, grammar=spec),
                SamplingParams(temperature=1.0, seed=7, max_tokens=120, grammar=spec),
                SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                SamplingParams(temperature=0.0, max_tokens=80, grammar=schema_spec(schemas[2])),
                SamplingParams(temperature=0.0, max_tokens=120, logprobs=2, grammar=spec)]

    def drive(engine: EngineCore):
        seqs, outs = run(engine, [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(len(requests))], requests)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        return [(s.output_ids, s.finish_reason, _fill(s), [t for o in outs[s.seq_id] for t in o.token_ids])
                for s in seqs], [lp for o in outs[seqs[-1].seq_id] for lp in (o.logprobs or [])]

    asyn = make_core(tiny_loaded, async_scheduling=True, jump_forward_chunk_max_seqs=chunk_max_seqs)
    got, got_lp = drive(asyn)
    expected, expected_lp = drive(core)
    assert got == expected
    assert got_lp == pytest.approx(expected_lp, abs=1e-5)
    for output_ids, reason, fill, streamed in got[:2]:
        assert reason == "stop" and fill > 10 and streamed == output_ids
    assert asyn.num_overlapped_steps > 10 and asyn.num_masked_after_resolve > 3
    assert asyn.num_dropped_rows > 0


def test_jump_forward_chunk_limit_is_checked(tiny_loaded):
    from tallow.errors import TallowError

    with pytest.raises(TallowError, match="jump_forward_chunk_max_seqs"):
        make_core(tiny_loaded, jump_forward_chunk_max_seqs=-1)
    assert make_core(tiny_loaded).scheduler.forced_chunk_max_seqs is None  # the CPU: no limit


def _fill(seq) -> int:
    return 0 if seq.grammar is None else seq.grammar.fill


def test_parallel_mask_fill_equals_one_matcher_at_a_time(core):
    """The backend fills many rows' masks in parallel (llguidance's executor): each row equals
    that matcher's own mask computed alone."""
    import llguidance as llg
    from llguidance.numpy import fill_next_token_bitmask

    backend = grammar_backend(core.tokenizer)
    tok = core.tokenizer
    matchers = []
    for i, schema in enumerate(bounded_schemas(5) + [LONG_KEYS]):
        m = llg.LLMatcher(backend.ll_tokenizer, llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ", ",
                                          "key_separator": ": "}))
        prefix = tok.encode('{"' if i % 2 else "")
        assert m.consume_tokens(prefix)
        matchers.append(m)
    together = np.zeros((len(matchers), backend.words), dtype=np.int32)
    backend.fill_bitmasks(matchers, together)
    for j, m in enumerate(matchers):
        alone = np.zeros((1, backend.words), dtype=np.int32)
        fill_next_token_bitmask(m, alone, 0)
        assert np.array_equal(together[j], alone[0]), j
    assert len({together[j].tobytes() for j in range(len(matchers))}) > 2  # the states differ


def test_a_tokenizer_llguidance_cannot_read_gives_a_grammar_error(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    from tallow.tokenizer import Tokenizer

    Backend(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    with pytest.raises(GrammarError, match="not available with this model's tokenizer"):
        check_grammar(GrammarSpec("regex", "a+"), Tokenizer.from_hf_dir(tmp_path))


@pytest.mark.parametrize("pattern, expected", [
    (r"\d{3}-\d+", "[0-9]{3}-[0-9]+"),
    (r"[\d_]x", "[0-9_]x"),
    (r"\\d", r"\\d"),
    (r"[]\d]|[^\d]", "[]0-9]|[^0-9]"),
    (r"[a-z&&[^\d]]\d", "[a-z&&[^0-9]][0-9]"),
    (r"\D\w", r"\D\w"),
])
def test_regex_digits_are_ascii(pattern, expected):
    from tallow.engine.grammar import ascii_digits

    assert ascii_digits(pattern) == expected


def test_regex_d_takes_ascii_digits_only(tokenizer):
    m = grammar_backend(tokenizer).compile(GrammarSpec("regex", r"\d{2}")).result(timeout=30)
    for text, ok in (("12", True), ("\U0001FBF8\U0001FBF8", False), ("\u0663\u0664", False)):
        probe = m.deep_copy()
        ids = tokenizer.encode(text)
        assert (probe.try_consume_tokens(ids) == len(ids) and probe.is_accepting()) == ok, text


def test_json_keys_come_in_the_schemas_order(core):
    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "alpha", "mid"],
              "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}, "mid": {"enum": [1, 2]}}}
    seqs, _ = run(core, [core.tokenizer.encode("Keys:")], [SamplingParams(temperature=0.0, max_tokens=60,
                                                                          grammar=schema_spec(schema))])
    text = text_of(core, seqs[0])
    assert list(json.loads(text)) == ["zeta", "alpha", "mid"]


@pytest.mark.parametrize("spec", [GrammarSpec("regex", "[^\\x00-\\x{10FFFF}]"),  # no character at all
                                  GrammarSpec("json_schema", '{"$ref": "#"}')])  # itself, with no base case
def test_a_grammar_that_admits_no_output_fails_its_sequence_with_the_reason(core, spec):
    # llguidance lets such a grammar end at once: the reply was "" with finish_reason "stop",
    # which the grammar does not admit either; now the compile fails and the server says why
    seq = core.make_sequences(core.tokenizer.encode("x"), SamplingParams(max_tokens=5, grammar=spec))[0]
    core.add(seq)
    outputs = []
    for _ in range(500):
        if not core.has_work():
            break
        outputs += core.step()
    assert seq.finish_reason == "error" and seq.num_output_tokens == 0
    assert outputs[-1][1].error == f"its grammar cannot be used: the {spec.kind} admits no output (no value matches it)"
    # what may be empty or short still runs
    for ok in (GrammarSpec("regex", ""), GrammarSpec("regex", "a"), GrammarSpec("choice", '["", "b"]')):
        assert grammar_backend(core.tokenizer).compile(ok).result(timeout=30) is not None
