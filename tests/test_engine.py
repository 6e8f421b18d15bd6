"""End-to-end engine behaviour on the real default model (CPU): batching, preemption,
prefix caching, seeds, n>1, abort, and the asyncio bridge."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from tallow.config import EngineConfig
from tallow.engine.async_engine import AsyncEngine
from tallow.engine.core import EngineCore
from tallow.engine.sampling import SamplingParams
from tallow.llm import LLM
from deadlines import async_wait_until
from model_utils import run_all
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "List three colors:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "In 1492,",
    "Water boils at",
    "My favourite programming language is Python because it is easy to read, and",
    "Q: What is 2+2?\nA:",
    "Paris is",
    "The sun rises in the",
    "import numpy as np\nx = np.",
    "Dear Sir or Madam,",
    "Photosynthesis is the process",
    "1, 2, 3, 4,",
    "The three laws of robotics are",
]


@pytest.fixture(scope="module")
def loaded():
    """The default model of this file's engine cores, which quantize it in place (so not the
    shared dense default_model)."""
    from tallow.models.loader import load_model

    return load_model("default", dtype=torch.float32, device=torch.device("cpu"), cache_dir=EngineConfig().cache_dir)


@pytest.fixture(scope="module")
def dense_loaded(default_model):
    """Float32 weights, never quantized: recompute preemption and prefix-cache hits change how a
    token's K/V is computed (a prefill chunk instead of a decode step); in float32 that leaves
    greedy outputs unchanged, while the int4 path's bfloat16 activations can flip near-ties."""
    return default_model


def make_core(loaded, **overrides) -> EngineCore:
    cfg = dataclasses.replace(EngineConfig(model="default", device="cpu"), **overrides)
    return EngineCore(cfg, loaded=loaded)


@pytest.fixture(scope="module")
def core(loaded):
    return make_core(loaded)


def test_batching_invariance(core):
    ids = [core.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    free0 = core.kv.num_free_blocks
    together = [s.output_ids for s in run_all(core, ids, params)]
    alone = [run_all(core, [x], params)[0].output_ids for x in ids]
    assert together == alone
    assert core.kv.num_free_blocks == free0


def test_kv_cache_is_float16_with_quantized_weights_and_keeps_the_answers(loaded, core):
    """On the CPU with tallow's kernels and int4 weights the KV cache holds float16 (attention
    reads half the bytes); the real model's greedy answers stay those of a float32 cache.
    Dense weights keep a float32 cache; a dtype the cache cannot hold is refused by name."""
    from tallow.attention.cpu_backend import CpuAttentionBackend
    from tallow.errors import TallowError
    from tallow.models.engine_model import resolve_kv_cache_dtype

    cpu = torch.device("cpu")
    native = CpuAttentionBackend.supports(torch.float32, 64)
    assert core.kv_dtype == (torch.float16 if native else torch.float32)
    assert all(k.dtype == v.dtype == core.kv_dtype for k, v in core.runner.kv_caches)
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu, "none", 64) == torch.float32
    assert resolve_kv_cache_dtype("float32", torch.float32, cpu, "int4", 64) == torch.float32
    with pytest.raises(TallowError, match="kv_cache_dtype") as e:
        resolve_kv_cache_dtype("bfloat16", torch.float32, cpu, "int4", 64)
    assert e.value.param == "kv_cache_dtype"
    if native:
        full = make_core(loaded, kv_cache_dtype="float32")
        assert core.kv_block_bytes * 2 == full.kv_block_bytes
        ids = [core.tokenizer.encode(p) for p in PROMPTS]
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        assert [s.output_ids for s in run_all(core, ids, params)] == [s.output_ids for s in run_all(full, ids, params)]


def test_int8_kv_cache_option(loaded, core):
    """--kv-cache-dtype int8 (alias q8_0) on the CPU: rows of int8 codes with a float32 scale per
    32 (72 bytes a row of 64 against float16's 128), greedy answers independent of the batch and
    starting as the float16 cache's do; refused where tallow's kernels cannot read it."""
    from tallow.attention.cpu_backend import CpuAttentionBackend
    from tallow.errors import TallowError
    from tallow.models.engine_model import resolve_kv_cache_dtype

    cpu = torch.device("cpu")
    for name, dtype, device, head_dim in (("int8", torch.float32, torch.device("cuda"), 64),
                                          ("q8_0", torch.bfloat16, cpu, 64), ("int8", torch.float32, cpu, 40)):
        with pytest.raises(TallowError, match="kv_cache_dtype") as e:
            resolve_kv_cache_dtype(name, dtype, device, "int4", head_dim)
        assert e.value.param == "kv_cache_dtype"
    if not CpuAttentionBackend.supports(torch.float32, 64):
        pytest.skip("no CPU kernels")
    assert resolve_kv_cache_dtype("q8_0", torch.float32, cpu, "none", 64) == torch.int8
    q8 = make_core(loaded, kv_cache_dtype="int8")
    assert q8.kv_dtype == torch.int8
    assert all(k.dtype == v.dtype == torch.int8 and k.shape[-1] == v.shape[-1] == 72 for k, v in q8.runner.kv_caches)
    assert core.kv_dtype == torch.float16 and q8.kv_block_bytes * 128 == core.kv_block_bytes * 72
    ids = [q8.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    together = [s.output_ids for s in run_all(q8, ids, params)]
    assert together == [run_all(q8, [x], params)[0].output_ids for x in ids]
    half = [s.output_ids for s in run_all(core, ids, params)]
    assert all(a[:3] == b[:3] for a, b in zip(together, half))
    assert sum(a == b for a, b in zip(together, half)) >= len(ids) // 2


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_preemption_keeps_outputs(dense_loaded):
    dense = make_core(dense_loaded, quantization="none")
    ids = [dense.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = [s.output_ids for s in run_all(dense, ids, params)]
    small = make_core(dense_loaded, quantization="none", num_kv_blocks=24, block_size=4,
                      enable_prefix_caching=False)
    free0 = small.kv.num_free_blocks
    got = [s.output_ids for s in run_all(small, ids, params)]
    assert small.scheduler.num_preemptions_total > 0, "the pool was meant to be too small: no preemption happened"
    assert got == reference
    assert small.kv.num_free_blocks == free0


def test_prefix_cache_hit_and_same_output(dense_loaded):
    core = make_core(dense_loaded, quantization="none")
    tok = core.tokenizer
    system = " ".join(f"Rule {i}: answer briefly and politely." for i in range(60))
    prefix = tok.encode(system)[:300]
    assert len(prefix) == 300
    a = prefix + tok.encode(" Question: what is the capital of Italy?")
    b = prefix + tok.encode(" Question: name a large animal.")
    params = SamplingParams(temperature=0.0, max_tokens=12)
    run_all(core, [a], params)
    seq_b = run_all(core, [b], params)[0]
    assert seq_b.num_cached_tokens >= 300 - core.config.block_size
    assert seq_b.num_cached_tokens % core.config.block_size == 0
    nocache = make_core(dense_loaded, quantization="none", enable_prefix_caching=False)
    ref = run_all(nocache, [b], params)[0]
    assert ref.num_cached_tokens == 0
    assert seq_b.output_ids == ref.output_ids


def test_seed_is_batch_independent(core):
    ids = [core.tokenizer.encode(p) for p in PROMPTS[:6]]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = run_all(core, [ids[0]], seeded)[0].output_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    seqs = [s for s in core.make_sequences(ids[0], seeded)]
    for x in ids[1:]:
        seqs += core.make_sequences(x, others)
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    assert seqs[0].output_ids == alone
    again = run_all(core, [ids[0]], seeded)[0].output_ids
    assert again == alone


def test_n_samples_share_prompt_blocks(core):
    ids = core.tokenizer.encode(" ".join(PROMPTS))  # > 3 blocks
    params = SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True)
    seqs = run_all(core, [ids], params)
    assert len(seqs) == 3
    assert seqs[0].output_ids == seqs[1].output_ids == seqs[2].output_ids
    full_blocks = (len(ids) - 1) // core.config.block_size * core.config.block_size
    assert all(s.num_cached_tokens >= full_blocks for s in seqs[1:])


def test_seeded_n_samples_differ_and_repeat(core):
    """n=3 with a seed: the choices are different samples (choice i uses seed + i), and the
    same request gives the same three again."""
    ids = core.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    first = [s.output_ids for s in run_all(core, [ids], params)]
    again = [s.output_ids for s in run_all(core, [ids], params)]
    assert first == again
    assert len({tuple(o) for o in first}) == 3


def test_abort_frees_blocks(core):
    free0 = core.kv.num_free_blocks
    ids = [core.tokenizer.encode(p) for p in PROMPTS[:8]]
    seqs = [s for x in ids for s in core.make_sequences(x, SamplingParams(max_tokens=50, ignore_eos=True))]
    for s in seqs:
        core.add(s)
    for _ in range(3):
        core.step()
    assert core.kv.num_free_blocks < free0
    for s in seqs:
        core.abort(s)
    assert not core.has_work()
    assert core.kv.num_free_blocks == free0
    assert all(s.finish_reason == "abort" for s in seqs)


def test_llm_generate_stop_strings_and_chat(loaded):
    llm = LLM.__new__(LLM)
    llm.config = EngineConfig(model="default", device="cpu")
    llm.engine = EngineCore(llm.config, loaded=loaded)
    llm.tokenizer = llm.engine.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    full = llm.generate("Once upon a time", greedy)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    # A stop string taken from the middle of the greedy text: the output ends right before it.
    cut = len(full.text) // 2
    stop = full.text[cut:cut + 4]
    first = full.text.find(stop)
    out = llm.generate("Once upon a time", dataclasses.replace(greedy, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:first]
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0]
    assert "Paris" in chat.text


def test_async_engine_concurrent_and_cancel(loaded):
    core = make_core(loaded)
    engine = AsyncEngine(core)
    ids = [core.tokenizer.encode(p) for p in PROMPTS[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = [s.output_ids for s in run_all(make_core(loaded), ids, params)]
    free0 = core.kv.num_free_blocks

    async def collect(x):
        toks = []
        async for out in engine.generate(x, params):
            toks += out.token_ids
            last = out
        return toks, last

    async def cancelled():
        stream = engine.generate(ids[0], SamplingParams(max_tokens=500, ignore_eos=True))
        async for out in stream:
            break  # one token in: the sequence is running
        stream.abort()
        outs = [out async for out in stream]  # tokens already queued, then the abort
        assert outs and outs[-1].finish_reason == "abort"
        assert all(o.finish_reason is None for o in outs[:-1])

    async def main():
        results = await asyncio.gather(*(collect(x) for x in ids), cancelled())
        # The abort frees the sequence at the engine's next command drain.
        await async_wait_until(lambda: engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0)
        stats = engine.stats()
        await engine.shutdown()
        return results, stats

    results, stats = asyncio.run(main())
    assert [r[0] for r in results[:4]] == expected
    assert all(r[1].finish_reason == "length" and r[1].num_prompt_tokens == len(x) for r, x in zip(results, ids))
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert core.kv.num_free_blocks == free0
    assert 0 < stats["kv_blocks_touched"] <= stats["kv_blocks_total"]
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in core.runner.kv_caches)
    assert stats["kv_block_bytes"] * stats["kv_blocks_total"] == kv_bytes


def test_async_outputs_merge_while_the_consumer_is_behind(loaded):
    """Outputs that pile up while nobody reads the stream come out as one: every token, its
    logprob and top logprobs in order, and the last output's finish_reason."""
    core = make_core(loaded)
    engine = AsyncEngine(core)
    ids = core.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)

    async def main():
        steady = [out async for out in engine.generate(ids, params)]
        late = engine.generate(ids, params)
        # until the final output has reached the unread stream
        await async_wait_until(lambda: late._pending is not None and late._pending.finish_reason is not None,
                               timeout=30)
        merged = [out async for out in late]
        await engine.shutdown()
        return steady, merged

    steady, merged = asyncio.run(main())
    assert len(steady) > 1 and len(merged) == 1
    out = merged[0]
    assert out.finish_reason == "length" == steady[-1].finish_reason
    assert out.token_ids == [t for o in steady for t in o.token_ids] and len(out.token_ids) == 12
    assert out.logprobs == pytest.approx([lp for o in steady for lp in o.logprobs])
    assert [[t for t, _ in top] for top in out.top_logprobs] == [[t for t, _ in top] for o in steady
                                                                 for top in o.top_logprobs]
    assert out.num_prompt_tokens == len(ids)


def test_async_abort_ends_the_stream_before_the_engine_step_ends(loaded):
    """abort() ends the stream's iteration at once, while the engine thread is still inside a
    step (a long prefill, say); the engine frees the sequence after that step, and what it
    posts for it then is dropped."""
    import threading

    core = make_core(loaded)
    engine = AsyncEngine(core)
    free0 = core.kv.num_free_blocks
    in_step, release = threading.Event(), threading.Event()
    step = core.step

    def slow_step():
        outputs = step()
        if outputs:
            in_step.set()
            release.wait(10)
        return outputs

    core.step = slow_step

    async def main():
        stream = engine.generate(core.tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=500, ignore_eos=True))
        await asyncio.to_thread(in_step.wait, 10)  # the engine thread is now held inside a step
        stream.abort()
        outs = await asyncio.wait_for(_drain(stream), 1.0)
        held = not release.is_set()
        release.set()
        await async_wait_until(lambda: engine.stats()["running"] == 0)
        stats = engine.stats()
        await engine.shutdown()
        return outs, held, stats

    async def _drain(stream):
        return [out async for out in stream]

    outs, held, stats = asyncio.run(main())
    assert held and outs and outs[-1].finish_reason == "abort"
    assert all(o.finish_reason is None for o in outs[:-1])
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert core.kv.num_free_blocks == free0



def test_async_engine_builds_its_core_in_the_engine_thread(loaded):
    """A builder function runs in the engine thread (torch's OpenMP pool then belongs to the
    thread that steps the model); its error reaches the caller and no thread is left behind."""
    import threading

    built_in = []

    def build():
        built_in.append(threading.current_thread().name)
        return make_core(loaded)

    engine = AsyncEngine(build)
    assert built_in == ["tallow-engine"] and engine.core.tokenizer is engine.tokenizer

    async def one():
        ids = engine.tokenizer.encode(PROMPTS[0])
        toks = [t async for out in engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=4,
                                                                            ignore_eos=True)) for t in out.token_ids]
        await engine.shutdown()
        return toks

    assert len(asyncio.run(one())) == 4
    assert not engine._thread.is_alive()

    def broken():
        raise ValueError("no model here")

    before = threading.active_count()
    with pytest.raises(ValueError, match="no model here"):
        AsyncEngine(broken)
    assert threading.active_count() == before


def test_max_model_len_past_the_models_context_is_refused(loaded):
    """vLLM's rule: a max_model_len longer than the model's positions is an error naming the
    field, not quietly cut to the model's length (a client's long prompt would then be refused
    with a limit the operator never set)."""
    from tallow.errors import TallowError

    positions = loaded.config.max_position_embeddings
    with pytest.raises(TallowError) as e:
        make_core(loaded, max_model_len=positions + 1)
    assert e.value.param == "max_model_len" and str(positions) in str(e.value)
    assert make_core(loaded, max_model_len=positions // 2).max_model_len == positions // 2
