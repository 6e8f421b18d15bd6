"""Asynchronous scheduling (step N+1 scheduled and launched before step N's tokens are read)
gives the same tokens, logprobs and finish reasons as the synchronous step loop.

On the CPU the forward itself is synchronous, so nothing overlaps here, but every part of
the asynchronous path runs: pending tokens read from the previous step's sampled ids,
one-step-late stop checks, dropped tokens of sequences that finished, preemption of a
sequence whose token is pending, aborts between steps, and the fallback to synchronous
steps while a sequence with penalties is queued. tests/test_gpu_engine.py runs it on CUDA.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tallow.config import EngineConfig
from tallow.engine.async_engine import AsyncEngine
from tallow.engine.core import EngineCore
from tallow.engine.request import PENDING_TOKEN
from tallow.engine.sampling import SamplingParams
from deadlines import async_wait_until
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "List three colors:",
    "In 1492,",
    "Water boils at",
    "Q: What is 2+2?\nA:",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def loaded(default_model):
    return default_model  # dense: this file's cores use quantization="none"


def make_core(loaded, **overrides) -> EngineCore:
    cfg = dataclasses.replace(EngineConfig(model="default", device="cpu", quantization="none"), **overrides)
    return EngineCore(cfg, loaded=loaded)


def run(core: EngineCore, requests: list[tuple[list[int], SamplingParams]]):
    """Run the requests to the end; per sequence: (tokens from its outputs, logprobs, finish reason)."""
    seqs = [s for ids, p in requests for s in core.make_sequences(ids, p)]
    for s in seqs:
        core.add(s)
    got = {s.seq_id: ([], [], None) for s in seqs}
    steps = 0
    while core.has_work():
        for seq, out in core.step():
            tokens, logprobs, _ = got[seq.seq_id]
            assert got[seq.seq_id][2] is None, "an output after the sequence's last one"
            tokens += out.token_ids
            logprobs += out.logprobs or []
            got[seq.seq_id] = (tokens, logprobs, out.finish_reason)
        steps += 1
        assert steps < 5000
    for s in seqs:
        assert PENDING_TOKEN not in s.token_ids
        assert got[s.seq_id][0] == s.output_ids, "the outputs do not add up to the sequence's tokens"
    return [got[s.seq_id] for s in seqs], seqs


def mixed_requests(tok, reference_core) -> list[tuple[list[int], SamplingParams]]:
    ids = [tok.encode(p) for p in PROMPTS]
    # A stop token taken from a first greedy run, so that some sequences stop mid-way.
    first = reference_core.make_sequences(ids[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    reference_core.add(first)
    while reference_core.has_work():
        reference_core.step()
    stop_token = first.output_ids[5]
    return [
        (ids[0], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_token])),
        (ids[1], SamplingParams(temperature=0.0, max_tokens=1)),
        (ids[2], SamplingParams(temperature=0.0, max_tokens=17, logprobs=3)),
        (ids[3], SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=15, ignore_eos=True)),
        (ids[4], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=9, ignore_eos=True)),
        (ids[5], SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10, stop_token_ids=[stop_token])),
        (ids[6], SamplingParams(temperature=0.0, max_tokens=6, logit_bias={stop_token: 5.0})),
        (ids[0] + ids[7], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)),
    ]


def test_config_picks_async_only_where_asked(loaded):
    assert make_core(loaded).async_scheduling is False  # auto: off on the CPU
    assert make_core(loaded, async_scheduling=True).async_scheduling is True
    with pytest.raises(Exception, match="async_scheduling"):
        make_core(loaded, async_scheduling="sometimes")


def test_async_equals_sync_on_a_mixed_batch(loaded):
    sync = make_core(loaded)
    asyn = make_core(loaded, async_scheduling=True)
    requests = mixed_requests(sync.tokenizer, sync)
    free0 = asyn.kv.num_free_blocks
    want, want_seqs = run(sync, requests)
    got, got_seqs = run(asyn, requests)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[2] for g in got] == [w[2] for w in want]
    assert [g[1] for g in got] == [w[1] for w in want]
    assert any(r == "stop" for _, _, r in want) and any(r == "length" for _, _, r in want)
    assert [s.num_cached_tokens for s in got_seqs] == [s.num_cached_tokens for s in want_seqs]
    assert asyn.kv.num_free_blocks == free0
    asyn.scheduler.check_invariants()
    # Most steps were launched while the step before was pending.
    assert asyn.num_overlapped_steps >= asyn.num_steps - 3 > 10
    assert sync.num_overlapped_steps == 0


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_async_preemption_keeps_outputs(loaded):
    tok = make_core(loaded).tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want, _ = run(make_core(loaded), [(x, params) for x in ids])
    small = make_core(loaded, num_kv_blocks=24, block_size=4, enable_prefix_caching=False, async_scheduling=True)
    free0 = small.kv.num_free_blocks
    got, _ = run(small, [(x, params) for x in ids])
    assert small.scheduler.num_preemptions_total > 0, "the pool was meant to be too small"
    assert [g[0] for g in got] == [w[0] for w in want]
    assert small.kv.num_free_blocks == free0


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_async_prefix_cache_and_chunked_prefill(loaded):
    """Blocks completed while a token is pending are hashed with the right ids: a second
    request over the same long prefix hits the cache and gives the synchronous output."""
    tok = make_core(loaded).tokenizer
    prefix = tok.encode(" ".join(f"Rule {i}: answer briefly." for i in range(40)))[:150]
    a, b = prefix + tok.encode(" Name a color."), prefix + tok.encode(" Name a fruit.")
    params = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    results = []
    for async_scheduling in (False, True):
        core = make_core(loaded, async_scheduling=async_scheduling, max_num_batched_tokens=64)
        first, _ = run(core, [(a, params)])
        second, seqs = run(core, [(b, params)])
        # The output of the first request is cached too (its blocks were hashed with real ids).
        third, seqs3 = run(core, [(a + first[0][0][:16], params)])
        results.append((first, second, seqs[0].num_cached_tokens, third, seqs3[0].num_cached_tokens))
    assert results[1] == results[0]
    # Every full block is a hit: of the shared prefix, and of the first request's prompt and output.
    assert results[1][2] == 144 and results[1][4] == (len(a) + 16) // 16 * 16


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_async_abort_between_steps_frees_everything(loaded):
    core = make_core(loaded, async_scheduling=True)
    free0 = core.kv.num_free_blocks
    ids = [core.tokenizer.encode(p) for p in PROMPTS]
    seqs = [s for x in ids for s in core.make_sequences(x, SamplingParams(max_tokens=50, ignore_eos=True))]
    for s in seqs:
        core.add(s)
    delivered = {s.seq_id: 0 for s in seqs}
    for _ in range(4):
        for seq, out in core.step():
            delivered[seq.seq_id] += len(out.token_ids)
    for s in seqs[::2]:
        core.abort(s)
    while core.has_work():
        for seq, out in core.step():
            assert not seq.finish_reason == "abort" or out.finish_reason is not None
            delivered[seq.seq_id] += len(out.token_ids)
    assert all(s.finish_reason == "abort" for s in seqs[::2])
    assert all(s.finish_reason == "length" and s.num_output_tokens == 50 for s in seqs[1::2])
    assert all(delivered[s.seq_id] == s.num_output_tokens for s in seqs)
    assert core.kv.num_free_blocks == free0


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_async_falls_back_to_sync_steps_for_penalties(loaded):
    tok = make_core(loaded).tokenizer
    ids = [tok.encode(p) for p in PROMPTS[:4]]
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    penal = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                           frequency_penalty=0.5)
    requests = [(ids[0], plain), (ids[1], penal), (ids[2], plain), (ids[3], penal)]
    want, _ = run(make_core(loaded), requests)
    core = make_core(loaded, async_scheduling=True)
    got, _ = run(core, requests)
    assert got == want
    assert core.scheduler.num_host_token_seqs == 0


def test_async_engine_streams_with_async_core(loaded):
    """The asyncio bridge over an asynchronously scheduled core: concurrent requests get the
    texts they get alone, and a cancelled one frees its blocks."""
    engine = AsyncEngine(make_core(loaded, async_scheduling=True))
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def collect(ids):
        tokens = []
        async for out in engine.generate(ids, params):
            tokens += out.token_ids
        return tokens

    async def main():
        ids = [tok.encode(p) for p in PROMPTS]
        alone = [await collect(x) for x in ids[:3]]
        together = await asyncio.gather(*(collect(x) for x in ids[:3]))
        stream = engine.generate(ids[4], SamplingParams(max_tokens=500, ignore_eos=True))
        await stream.__anext__()
        await stream.aclose()
        await async_wait_until(lambda: engine.stats()["running"] == 0 and not engine.core.has_work())
        stats = engine.stats()
        await engine.shutdown()
        return alone, list(together), stats

    alone, together, stats = asyncio.run(main())
    assert together == alone
    assert stats["running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_llm_stop_strings_with_async_core():
    """A stop string aborts the sequence while its next token is pending: the text and the
    token ids end where the synchronous engine's do."""
    from tallow.llm import LLM

    prompts = PROMPTS[:4]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sync = LLM("default", device="cpu", quantization="none")
    first = sync.generate(prompts[0], greedy)[0].outputs[0].text
    stop = first[len(first) // 2: len(first) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    want = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in sync.generate(prompts, params)]
    asyn = LLM("default", device="cpu", quantization="none", async_scheduling=True)
    got = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in asyn.generate(prompts, params)]
    assert got == want
    assert want[0][2] == "stop" and stop not in want[0][0]
    again = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in asyn.generate(prompts, params)]
    assert again == want


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_async_random_mix_with_aborts_and_preemption(loaded):
    """Random requests (greedy, seeded sampling, logprobs, stop tokens, n=2, penalties that
    switch the engine to synchronous steps and back) over a KV pool small enough to preempt,
    with aborts at random steps. Every request that was not aborted gets the tokens of a
    synchronous run; an aborted one a prefix of them; the scheduler's invariants hold after
    every step and every block comes back."""
    import random

    rng = random.Random(5)
    tok = make_core(loaded).tokenizer
    words = "the a cat dog sat on mat red blue green one two three four".split()
    requests = []
    for i in range(14):
        ids = tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))))
        kind = rng.random()
        common = dict(max_tokens=rng.randint(1, 14), ignore_eos=True)
        if kind < 0.45:
            p = SamplingParams(temperature=0.0, logprobs=rng.choice([None, 2]), **common)
        elif kind < 0.8:
            p = SamplingParams(temperature=1.0, top_k=40, seed=i, n=rng.choice([1, 2]), **common)
        else:
            p = SamplingParams(temperature=0.0, stop_token_ids=[tok.encode(" the")[0]], **dict(common, ignore_eos=False))
        if i == 0:  # one short request with penalties: synchronous steps while it is queued
            p = SamplingParams(temperature=0.0, presence_penalty=0.5, max_tokens=3, ignore_eos=True)
        requests.append((ids, p))
    want, _ = run(make_core(loaded, num_kv_blocks=24, block_size=4), requests)

    core = make_core(loaded, num_kv_blocks=24, block_size=4, async_scheduling=True)
    free0 = core.kv.num_free_blocks
    seqs = [s for ids, p in requests for s in core.make_sequences(ids, p)]
    pending = list(seqs)
    rng.shuffle(pending)
    added, aborted, step = [], set(), 0
    while pending or core.has_work():
        if pending and rng.random() < 0.5:  # requests arrive over time
            seq = pending.pop()
            core.add(seq)
            added.append(seq)
        if added and rng.random() < 0.08:
            victim = rng.choice(added)
            if not victim.is_finished:
                core.abort(victim)
                aborted.add(victim.seq_id)
        core.step()
        core.scheduler.check_invariants()
        step += 1
        assert step < 5000
    assert core.scheduler.num_preemptions_total > 0, "the pool was meant to be too small"
    assert aborted and any(p.needs_penalties for _, p in requests) and core.num_overlapped_steps > 10
    assert core.kv.num_free_blocks == free0
    for s, (tokens, _, _) in zip(seqs, want):
        assert PENDING_TOKEN not in s.token_ids
        if s.seq_id in aborted and s.finish_reason == "abort":
            assert s.output_ids == tokens[: len(s.output_ids)]
        else:
            assert s.output_ids == tokens, s
