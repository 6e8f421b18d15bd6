"""Speculative decoding inside the continuous batch (tallow/engine/speculative/).

Greedy: on the batch-invariant CPU kernels, speculation must give plain greedy decoding's
tokens exactly (and its logprobs), alone, in a batch of 16 and with a pool small enough to
preempt; the pool's free blocks come back. Sampling: the rejection rule must leave the
distribution of the sampled tokens that of plain sampling (a chi-square test over 20k draws
on a tiny model), and the same test must reject a verifier that skips the residual step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from tallow.config import EngineConfig
from tallow.engine.core import EngineCore
from tallow.engine.sampling import SamplingParams
from tallow.engine.speculative import verify as verify_module
from tallow.engine.speculative.ngram import NgramProposer
from tallow.engine.speculative.speculator import Speculator
from tallow.engine.speculative.state import SpecState
from tallow.errors import TallowError
from tallow.llm import LLM
from tallow.models.config import ModelConfig
from tallow.models.dummy import PRESETS, init_random_
from tallow.models.llama import LlamaForCausalLM
from tallow.models.loader import LoadedModel, TokenizerSource

# Row cost 0: every sequence drafts whenever the proposer finds something (the adaptive
# off-switch is tested on its own), so the verifier sees as many drafts as there can be.
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, ngram_max=4, ngram_min=2,
            speculative_row_cost=0.0)

CODE = '''def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
    return a * b
'''

REPEATING = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    "Rewrite this code, renaming add to plus:\n" + CODE + "\nRewritten:\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5,",
    "red green blue red green blue red green blue red",
    "Copy the list: apples, pears, plums, figs.\nCopy: apples, pears,",
    "Hello world! Hello world! Hello world! Hello",
    "def f(x):\n    return x\n\ndef g(x):\n    return x\n\ndef h(x):\n",
    "Once upon a time there was a cat. Once upon a time there was a dog. Once upon a time",
]
PLAIN = ["The capital of France is", "Once upon a time", "List three colors:", "Water boils at"]


def random_prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 30))] for _ in range(count)]


def make_core(loaded, **overrides) -> EngineCore:
    cfg = dataclasses.replace(EngineConfig(model="default", device="cpu", quantization="none"), **overrides)
    return EngineCore(cfg, loaded=loaded)


def run_all(core: EngineCore, prompts_ids, params, record=None):
    seqs = [s for ids in prompts_ids for s in core.make_sequences(ids, params)]
    for s in seqs:
        core.add(s)
    while core.has_work():
        for seq, out in core.step():
            if record is not None:
                record.setdefault(seq.seq_id, []).append(out)
        core.scheduler.check_invariants()
    return seqs


# ---- the proposer ------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_longest_recent_suffix():
    p = NgramProposer(ngram_max=3, ngram_min=2)
    index = p.new_index()
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # Suffix (6, 7): its latest earlier occurrence ends at 7, followed by 2, 6, 7.
    assert p.propose(index, tokens, 3) == [2, 6, 7]
    # The longest suffix wins: (2, 6, 7) -> 1, 5 over the later (6, 7) -> 3, 2.
    tokens = [2, 6, 7, 1, 5, 6, 7, 3, 2, 6, 7]
    assert p.propose(p.new_index(), tokens, 2) == [1, 5]
    assert p.propose(p.new_index(), [1, 2, 3, 4], 4) == []  # no suffix repeats
    # A match that runs into the end: the loop goes on for the whole draft.
    assert p.propose(p.new_index(), [5, 7, 7, 7], 4) == [7, 7, 7, 7]
    assert p.propose(p.new_index(), [5, 1, 2, 1, 2, 1], 5) == [2, 1, 2, 1, 2]
    assert p.propose(p.new_index(), [1, 2, 1, 2], 0) == []
    # The index grows with the tokens: a draft exactly where a fresh index has one, read after
    # an occurrence of the same longest suffix.
    grown = p.new_index()
    seq = []
    for t in [3, 1, 2, 3, 1, 2, 3, 1, 9, 1, 2]:
        seq.append(t)
        draft, fresh = p.propose(grown, seq, 4), p.propose(p.new_index(), seq, 4)
        assert bool(draft) == bool(fresh)
        if draft:
            n = max(n for n in (2, 3) if any(seq[e - n:e] == seq[-n:] for e in range(n, len(seq))))
            assert any(seq[e - n:e] == seq[-n:] and draft[0] == seq[e] for e in range(n, len(seq)))


def test_ngram_follows_the_source_its_last_draft_came_from():
    """Of the suffix's occurrences, the one where the text being copied has got to since the last
    draft: a copy of the source that meets a pair repeated further on stays in place."""
    p = NgramProposer(ngram_max=2, ngram_min=2)
    #         0  1  2  3  4  5  6  7  8  9  10
    source = [1, 2, 3, 4, 5, 6, 2, 3, 7, 8, 9]  # (2, 3) twice: followed by 4 and by 7
    index = p.new_index()
    assert p.propose(index, source + [1, 2], 4) == [3, 4, 5, 6]  # (1, 2) occurs once: read at 2
    # One token on, the source has moved to 3: (2, 3) there, not its later occurrence at 8.
    assert p.propose(index, source + [1, 2, 3], 4) == [4, 5, 6, 2]
    assert p.propose(p.new_index(), source + [1, 2, 3], 4) == [7, 8, 9, 1]  # no draft before: the latest
    # A substitution (5 -> 0) and the text goes on: 6, 2, 3 resume at the source's second (2, 3).
    assert p.propose(index, source + [1, 2, 3, 4, 0, 6, 2, 3], 3) == [7, 8, 9]


@pytest.mark.parametrize("sizes", [(2, 4), (1, 3), (3, 4)])
def test_may_propose_before_the_last_token_covers_every_proposal(sizes):
    """may_propose with the last token pending (asynchronous scheduling) is False only when
    no value of that token would give a proposal: the engine then launches a plain step."""
    ngram_min, ngram_max = sizes
    p = NgramProposer(ngram_max=ngram_max, ngram_min=ngram_min)
    rng = random.Random(ngram_min)
    vocab = 6
    said_no = 0
    for trial in range(60):
        grown = p.new_index()
        tokens = [rng.randrange(vocab) for _ in range(3)]
        for _ in range(rng.randrange(1, 25)):
            pending = tokens + [-1]
            may = p.may_propose(grown, pending, 4)
            proposes = [t for t in range(vocab) if p.propose(p.new_index(), tokens + [t], 4)]
            if proposes:
                assert may, (tokens, proposes)
            said_no += not may
            tokens.append(rng.randrange(vocab + trial // 10))  # later trials repeat less
            # With every token known it says whether propose() does.
            assert p.may_propose(p.new_index(), tokens, 4) == bool(p.propose(p.new_index(), tokens, 4))
    if ngram_min > 1:
        assert said_no > 20  # it does rule steps out
    assert p.may_propose(p.new_index(), [1, 2, -1], 0) is False


@pytest.mark.parametrize("sizes", [(2, 4), (1, 3), (3, 4)])
def test_the_late_guess_is_whether_the_known_tokens_had_a_draft(sizes):
    """may_propose(exact=False) with the last token pending: True exactly when the tokens before
    it had a proposal, whatever the index saw before (grown with them or fresh); it never reads
    the pending token."""
    ngram_min, ngram_max = sizes
    p = NgramProposer(ngram_max=ngram_max, ngram_min=ngram_min)
    rng = random.Random(7 + ngram_min)
    yes = no = 0
    for trial in range(40):
        grown = p.new_index()
        tokens = [rng.randrange(5) for _ in range(2)]
        for step in range(rng.randrange(1, 30)):
            late = p.may_propose(grown, tokens + [-1], 4, exact=False)
            assert late == bool(p.propose(p.new_index(), list(tokens), 1)), tokens
            yes, no = yes + late, no + (not late)
            tokens.append(rng.randrange(5 + trial // 8))
            if step % 3 == 0:  # a sync step between: propose() on every known token
                assert -1 not in p.propose(grown, list(tokens), 4)
    assert yes > 10 and no > 10


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_late_guess_keeps_random_text_overlapped(default_model, prompts, greedy_reference):
    """Asynchronous scheduling with the real proposer on prompts that rarely draft: guessing from
    the known tokens (greedy requests) overlaps more steps than the exact test, which waits
    whenever the last known token occurred before; the tokens are plain decoding's both ways."""
    random_ids = prompts[len(REPEATING) + len(PLAIN):]
    want = greedy_reference[-len(random_ids):]
    counts = []
    for exact in (True, False):
        core = make_core(default_model, async_scheduling=True, **SPEC)
        proposer = core.speculator.proposer
        if exact:
            may = proposer.may_propose
            proposer.may_propose = lambda index, token_ids, k, exact=True: may(index, token_ids, k)
        assert [s.output_ids for s in run_all(core, random_ids, GREEDY)] == want
        counts.append(core.num_overlapped_steps)
        assert core.kv.num_free_blocks == core.kv.num_blocks
    assert counts[1] > counts[0], counts


def test_adaptive_draft_length_pauses_and_resumes():
    state = SpecState(None, k_max=4, row_cost=0.5)
    assert state.draft_length() == 4  # a fresh sequence tries its full draft
    # Drafts whose first two tokens stand and the rest fail: positions 3 and 4 do not pay.
    for _ in range(6):
        state.record(4, 2)
    assert state.draft_length() == 2
    # Drafts that all fail: it pauses, for its own steps without a draft, then tries again.
    n = 0
    while not state.paused:
        state.record(state.draft_length(), 0)
        n += 1
    assert n <= 4
    first_pause = state.paused
    for _ in range(first_pause):
        assert state.draft_length() == 0
        state.step_without_draft()
    assert state.draft_length() == 1  # it tries again with one token
    # A pause that ends on drafts still not worth it is longer: one failed token is enough.
    state.record(1, 0)
    assert state.paused == 2 * first_pause
    for _ in range(state.paused):
        state.step_without_draft()
    # Drafts accepted whole: the length doubles back to the full draft.
    lengths = []
    for _ in range(3):
        lengths.append(state.draft_length())
        state.record(lengths[-1], lengths[-1])
    assert lengths == [1, 2, 4] and state.draft_length() == 4
    good = SpecState(None, k_max=4, row_cost=0.5)
    for _ in range(20):
        good.record(4, 3)
    assert good.paused == 0 and good.draft_length() == 3


def test_a_position_cut_by_early_rejections_is_tried_again():
    """Early drafts that fail at their second token cut the draft to one token; once the first
    token keeps being accepted, the later positions are proposed again (a position no longer
    proposed is never judged, so its rate must not stay where the rejections left it)."""
    state = SpecState(None, k_max=4, row_cost=0.25)
    for proposed, accepted in [(4, 0), (4, 4), (4, 4), (4, 1), (4, 0), (4, 0)]:
        state.record(proposed, accepted)
    assert state.draft_length() == 1
    lengths = []
    for _ in range(12):  # every proposed token accepted
        lengths.append(state.draft_length())
        state.record(lengths[-1], lengths[-1])
    assert lengths[-1] == 4, lengths


def test_rows_are_priced_at_the_batch_unless_a_seeded_text_depends_on_them():
    """A row costs more, against a plain step's tokens, the more sequences share the step: a
    draft position reached half the time pays at one sequence (row cost 0.25), not among 16.
    A seeded sampled request's drafts must not depend on the batch (rejection sampling draws
    its text differently where a draft was verified), so it keeps its one-sequence price."""
    speculator = Speculator(EngineConfig(speculative_method="ngram", speculative_row_cost=0.25))

    def seq(params):
        state = SpecState(None, k_max=4, row_cost=0.25)
        for i in range(12):  # one-token drafts, every other one accepted
            state.record(1, i % 2)
        return SimpleNamespace(params=params, spec=state, prompt_logprobs=None, max_output_tokens=100,
                               num_output_tokens=10, token_ids=list(range(30)))

    greedy = seq(SamplingParams(temperature=0.0, seed=7))
    unseeded = seq(SamplingParams(temperature=0.8))
    seeded = seq(SamplingParams(temperature=0.8, seed=7))
    for s in (greedy, unseeded):
        assert speculator.draft_length(s, 10_000, batch=1) > 0
        assert speculator.draft_length(s, 10_000, batch=16) == 0
    assert speculator.draft_length(seeded, 10_000, batch=16) == speculator.draft_length(seeded, 10_000, batch=1) > 0


def test_the_longest_draft_defaults_by_device():
    """num_speculative_tokens None: 6 on the CPU, 4 on CUDA (its verify graphs are sized by it);
    a value given is kept on either, and one outside [1, 64] is refused naming the field."""
    default = EngineConfig(speculative_method="ngram", speculative_row_cost=0.25)
    assert Speculator(default, "cpu").k == 6
    assert Speculator(default, "cuda").k == 4
    assert default.speculative_tokens("cuda") == 4
    given = EngineConfig(speculative_method="ngram", speculative_row_cost=0.25, num_speculative_tokens=3)
    assert Speculator(given, "cpu").k == Speculator(given, "cuda").k == given.speculative_tokens("cpu") == 3
    with pytest.raises(TallowError, match="num_speculative_tokens"):
        Speculator(EngineConfig(speculative_method="ngram", num_speculative_tokens=0), "cpu")


# ---- greedy: token for token plain decoding -------------------------------------------------

@pytest.fixture(scope="module")
def plain_core(default_model):
    return make_core(default_model)


@pytest.fixture(scope="module")
def spec_core(default_model):
    return make_core(default_model, **SPEC)


@pytest.fixture(scope="module")
def prompts(plain_core):
    tok = plain_core.tokenizer
    ids = [tok.encode(p) for p in REPEATING + PLAIN]
    return ids + random_prompts(plain_core.model_config.vocab_size, 16 - len(ids))


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_reference(plain_core, prompts):
    return [s.output_ids for s in run_all(plain_core, prompts, GREEDY)]


def test_greedy_equals_plain_on_16_prompts_together(spec_core, prompts, greedy_reference):
    free0 = spec_core.kv.num_free_blocks
    got = [s.output_ids for s in run_all(spec_core, prompts, GREEDY)]
    assert got == greedy_reference
    stats = spec_core.stats()["speculative"]
    assert stats["num_accepted_tokens"] > 50, stats  # the repeating prompts' drafts were taken
    assert stats["num_draft_tokens"] > stats["num_accepted_tokens"], stats  # and some rejected
    assert spec_core.kv.num_free_blocks == free0
    assert spec_core.kv.pool.num_free == spec_core.kv.num_blocks


def test_greedy_equals_plain_alone(spec_core, prompts, greedy_reference):
    for i in (1, 9, 15):
        assert run_all(spec_core, [prompts[i]], GREEDY)[0].output_ids == greedy_reference[i]


@pytest.mark.slow
def test_greedy_with_preemption_and_no_prefix_cache(default_model, prompts, greedy_reference):
    small = make_core(default_model, num_kv_blocks=48, block_size=4, enable_prefix_caching=False, **SPEC)
    free0 = small.kv.num_free_blocks
    got = [s.output_ids for s in run_all(small, prompts, GREEDY)]
    assert small.scheduler.num_preemptions_total > 0, "the pool was meant to be too small: no preemption happened"
    assert got == greedy_reference
    assert small.kv.num_free_blocks == free0


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_greedy_with_preemption_and_prefix_cache(default_model, prompts, greedy_reference):
    small = make_core(default_model, num_kv_blocks=40, block_size=4, **SPEC)
    short = dataclasses.replace(GREEDY, max_tokens=16)  # plain greedy's first 16 tokens
    got = [s.output_ids for s in run_all(small, prompts, short)]
    assert small.scheduler.num_preemptions_total > 0
    assert got == [r[:16] for r in greedy_reference]
    # Every block is free again (some still cached); the cache only ever names accepted tokens:
    # the same prompts again hit it and give the same tokens.
    assert small.kv.num_free_blocks == small.kv.num_blocks
    assert [s.output_ids for s in run_all(small, prompts[:4], short)] == [r[:16] for r in greedy_reference[:4]]
    assert small.kv.prefix_hits > 0


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_off_switch_stops_bad_drafts_and_keeps_outputs(default_model, prompts, greedy_reference):
    """With the CPU's row cost, a proposer whose drafts are always wrong is soon not asked:
    each sequence drafts a few times, then pauses (longer each time); the tokens stay plain
    decoding's."""
    adaptive = make_core(default_model, **dict(SPEC, speculative_row_cost=None))
    assert 0.0 < adaptive.speculator.row_cost < 1.0  # the kernels' default (config.py)
    bad = adaptive.model_config.vocab_size - 1  # never a greedy pick here
    assert all(bad not in out for out in greedy_reference)
    adaptive.speculator.proposer.propose = lambda index, token_ids, k: [bad] * k
    assert [s.output_ids for s in run_all(adaptive, prompts[8:], GREEDY)] == greedy_reference[8:]
    stats = adaptive.stats()["speculative"]
    assert stats["num_accepted_tokens"] == 0
    # Always on, every one of the 8 x 32 sampling rows but the last would draft.
    assert 8 <= stats["num_drafts"] <= 8 * 4, stats
    assert adaptive.kv.num_free_blocks == adaptive.kv.num_blocks


def test_logprobs_equal_plain(plain_core, spec_core, prompts):
    params = dataclasses.replace(GREEDY, logprobs=3, max_tokens=20)
    want, got = {}, {}
    ref = run_all(plain_core, prompts[:6], params, want)
    spec = run_all(spec_core, prompts[:6], params, got)
    assert spec_core.stats()["speculative"]["num_accepted_tokens"] > 0
    for r, s in zip(ref, spec):
        assert s.output_ids == r.output_ids
        a = [x for out in want[r.seq_id] for x in out.logprobs]
        b = [x for out in got[s.seq_id] for x in out.logprobs]
        assert len(a) == len(b) == 20
        # log_softmax over batches of other shapes: float32 rounding apart.
        assert b == pytest.approx(a, abs=1e-4)
        ta = [x for out in want[r.seq_id] for x in out.top_logprobs]
        tb = [x for out in got[s.seq_id] for x in out.top_logprobs]
        assert [[t for t, _ in row] for row in tb] == [[t for t, _ in row] for row in ta]
        for ra, rb in zip(ta, tb):
            assert [v for _, v in rb] == pytest.approx([v for _, v in ra], abs=1e-4)


def test_stop_id_inside_an_accepted_run(spec_core, prompts, greedy_reference):
    """A stop id that the verifier accepted in the middle of a run: the tokens after it are
    dropped, the output is plain decoding's up to and including the stop token."""
    runs = []
    original = spec_core.scheduler.update

    def spy(out, sampled, runs_=None):
        if runs_ is not None:
            runs.extend(list(r) for r in runs_)
        return original(out, sampled, runs_)

    spec_core.scheduler.update = spy
    try:
        # A prompt whose greedy output has a run of at least 3 tokens, and the run's middle
        # token appears there first.
        for i in range(len(REPEATING)):
            runs.clear()
            ref = greedy_reference[i]
            run_all(spec_core, [prompts[i]], GREEDY)
            done = 0
            stop = None
            for r in runs:
                if len(r) >= 3 and ref.index(r[1]) == done + 1:
                    stop = r[1]
                    break
                done += len(r)
            if stop is not None:
                break
        assert stop is not None, "no accepted run of 3 tokens"
        cut = ref.index(stop) + 1
        runs.clear()
        records = {}
        seq = run_all(spec_core, [prompts[i]], dataclasses.replace(GREEDY, stop_token_ids=[stop]), records)[0]
    finally:
        spec_core.scheduler.update = original
    assert seq.output_ids == ref[:cut]
    assert seq.finish_reason == "stop" and seq.stop_token_id == stop
    assert [t for out in records[seq.seq_id] for t in out.token_ids] == ref[:cut]
    assert spec_core.kv.num_free_blocks == spec_core.kv.num_blocks


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_stop_string_inside_an_accepted_run_and_max_tokens(default_model):
    def llm_for(**kw):
        llm = LLM.__new__(LLM)
        llm.config = EngineConfig(model="default", device="cpu", quantization="none", **kw)
        llm.engine = EngineCore(llm.config, loaded=default_model)
        llm.tokenizer = llm.engine.tokenizer
        return llm

    plain, spec = llm_for(), llm_for(**SPEC)
    prompt = REPEATING[5]  # "Hello world! Hello world! ...": the continuation repeats
    greedy = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)
    full = plain.generate(prompt, greedy)[0].outputs[0]
    got = spec.generate(prompt, greedy)[0].outputs[0]
    assert got.token_ids == full.token_ids and got.finish_reason == "length" and len(got.token_ids) == 23
    # A stop string from the middle of the text, cut inside a token.
    cut = len(full.text) // 2
    stop = full.text[cut:cut + 3]
    want = plain.generate(prompt, dataclasses.replace(greedy, stop=[stop]))[0]
    out = spec.generate(prompt, dataclasses.replace(greedy, stop=[stop]))[0]
    assert out.outputs[0].text == want.outputs[0].text == full.text[:full.text.find(stop)]
    assert out.outputs[0].finish_reason == "stop"
    assert spec.engine.stats()["speculative"]["num_accepted_tokens"] > 0
    assert spec.engine.kv.num_free_blocks == spec.engine.kv.num_blocks


def test_min_tokens_logit_bias_and_refusals(plain_core, spec_core, prompts):
    eos = sorted(plain_core.eos_token_ids)[0]
    # logit_bias makes eos the greedy pick everywhere; min_tokens holds it off for 6 tokens:
    # speculation must apply both at each draft position as plain sampling does there.
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=6, logit_bias={eos: 40.0})
    ref = [s.output_ids for s in run_all(plain_core, prompts[:8], params)]
    assert all(len(r) == 7 and r[-1] == eos for r in ref)
    drafts = spec_core.stats()["speculative"]["num_draft_tokens"]
    assert [s.output_ids for s in run_all(spec_core, prompts[:8], params)] == ref
    assert spec_core.stats()["speculative"]["num_draft_tokens"] > drafts
    before = dict(spec_core.stats()["speculative"]["requests_not_speculating"])
    off = dataclasses.replace(GREEDY, max_tokens=4, speculative=False)
    seqs = run_all(spec_core, prompts[:2], off)
    assert all(s.spec is None for s in seqs)
    after = spec_core.stats()["speculative"]["requests_not_speculating"]
    assert after.get("request", 0) - before.get("request", 0) == 2


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
@pytest.mark.parametrize("penalties", [
    dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
    dict(presence_penalty=0.8, frequency_penalty=0.6),
    dict(repetition_penalty=0.9, frequency_penalty=-0.5)])
def test_penalties_per_draft_position_equal_plain(plain_core, spec_core, prompts, penalties):
    """Penalties count the output as of each draft position: the tokens of plain decoding
    (which, with penalties, break the loops that drafts feed on less often than not)."""
    params = dataclasses.replace(GREEDY, max_tokens=24, **penalties)
    ref = [s.output_ids for s in run_all(plain_core, prompts[:8], params)]
    drafts = spec_core.stats()["speculative"]["num_accepted_tokens"]
    assert [s.output_ids for s in run_all(spec_core, prompts[:8], params)] == ref
    assert spec_core.stats()["speculative"]["num_accepted_tokens"] > drafts


def staged(core: EngineCore, first, late, steps_before_late: int = 3):
    """first: (prompt ids, params) pairs added at once; late: the same, added after
    steps_before_late steps, so their prefill rows follow the drafted rows of the first ones in
    a step. Each sequence's outputs by seq_id."""
    outs: dict[int, list] = {}
    seqs = [s for ids, p in first for s in core.make_sequences(ids, p)]
    for s in seqs:
        core.add(s)
    for step in range(10_000):
        if step == steps_before_late:
            late_seqs = [s for ids, p in late for s in core.make_sequences(ids, p)]
            for s in late_seqs:
                core.add(s)
            seqs += late_seqs
        if step > steps_before_late and not core.has_work():
            break
        for seq, out in core.step():
            outs.setdefault(seq.seq_id, []).append(out)
    assert core.kv.num_free_blocks == core.kv.num_blocks
    return seqs, outs


def speculating_batch(prompts):
    """Input-grounded prompts that draft and get accepted runs with ngram."""
    return [(ids, dataclasses.replace(GREEDY, max_tokens=24)) for ids in prompts[:4]]


def spec_counts(core) -> tuple[int, Counter]:
    s = core.stats()["speculative"]
    return s["num_accepted_tokens"], Counter(s["requests_not_speculating"])


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}


COLORS = r"( (red|green|blue)){6,14}\."


def grammar_requests(tok):
    """A JSON-schema request (forced keys: jump-forward fill) and a regex whose reply repeats
    (so ngram drafts it), with a start_after variant: the grammar applies once the output has
    said " Colors:" (as the prompt's answers do: the marker may complete inside a draft)."""
    from tallow.engine.grammar import GrammarSpec

    person = GrammarSpec("json_schema", json.dumps(PERSON, separators=(",", ":")))
    colors = GrammarSpec("regex", COLORS)
    marker = tuple(tok.encode(" Colors:"))
    late = GrammarSpec("regex", COLORS, start_after=marker)
    greedy = dict(temperature=0.0, max_tokens=48)
    return [
        (tok.encode("Describe a user as JSON:"), SamplingParams(**greedy, grammar=person)),
        (tok.encode("red green blue red green blue red green blue red green"), SamplingParams(**greedy, grammar=colors)),
        (tok.encode("Q: colors? A: Colors: red green blue.\nQ: colors? A: Colors: red green blue.\nQ: colors? A:"),
         SamplingParams(**greedy, grammar=late)),
    ]


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_grammar_requests_speculate_as_plain_decoding(plain_core, spec_core, prompts):
    """Grammar requests speculate beside other speculating sequences: their drafts are cut to
    what the grammar allows, the verified positions masked by a matcher advanced over the draft;
    tokens, finish reasons and validity are plain decoding's, and they took drafts of their own."""
    jsonschema = pytest.importorskip("jsonschema")
    tok = plain_core.tokenizer
    requests = grammar_requests(tok)
    accepted0, refused0 = spec_counts(spec_core)
    results = []
    for core in (plain_core, spec_core):
        seqs, outs = staged(core, speculating_batch(prompts) + requests[:1], requests[1:])
        results.append([(s.output_ids, s.finish_reason) for s in seqs])
        person, colors, late = seqs[4], seqs[5], seqs[6]
        assert person.finish_reason == "stop" and sum(o.fill for o in outs[person.seq_id]) > 0
        jsonschema.validate(json.loads(tok.decode(person.output_ids)), PERSON)
        assert re.fullmatch(COLORS, tok.decode(colors.output_ids)), tok.decode(colors.output_ids)
        text = tok.decode(late.output_ids)
        assert re.fullmatch(COLORS, text[text.index("Colors:") + len("Colors:"):]), text
        if core is spec_core:
            assert all(s.spec is not None for s in seqs[4:])
            assert colors.spec.accepted > 0 and late.spec.accepted > 0  # their own drafts stood
    assert results[1] == results[0]
    accepted, refused = spec_counts(spec_core)
    assert accepted > accepted0 and refused == refused0


def test_sampled_grammar_request_speculates_within_its_grammar(spec_core):
    """Rejection sampling over masked rows: a sampled color request (seeded) drafts, and every
    token it emits is one the grammar allows (its reply matches the regex, it ends by it)."""
    tok = spec_core.tokenizer
    ids, greedy = grammar_requests(tok)[1]
    params = dataclasses.replace(greedy, temperature=0.7, seed=11)
    for seed in (11, 12, 13):
        s = run_all(spec_core, [ids], dataclasses.replace(params, seed=seed))[0]
        assert s.finish_reason == "stop" and re.fullmatch(COLORS, tok.decode(s.output_ids)), tok.decode(s.output_ids)
        assert s.spec.proposed > 0


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_grammar_cuts_drafts_at_a_token_it_rejects(default_model, plain_core, prompts):
    """A proposer whose drafts carry a token the grammar forbids after their first: each draft is
    cut before it (one token verified), and the tokens stay plain decoding's."""
    tok = plain_core.tokenizer
    requests = grammar_requests(tok)[1:]
    plain = [s.output_ids for ids, p in requests for s in run_all(plain_core, [ids], p)]
    core = make_core(default_model, **SPEC)
    bad = tok.encode("{")[0]  # never allowed by the color regex
    ngram = core.speculator.proposer.propose
    core.speculator.proposer.propose = lambda index, ids, k: (d := ngram(index, ids, k))[:1] + [bad] * (len(d) > 0)
    got, drafts = [], []
    for ids, p in requests:
        before = core.stats()["speculative"]
        got += [s.output_ids for s in run_all(core, [ids], p)]
        after = core.stats()["speculative"]
        drafts.append((after["num_drafts"] - before["num_drafts"],
                       after["num_draft_tokens"] - before["num_draft_tokens"]))
    assert got == plain
    # The color regex applies from the first token: every draft was cut to one token. The
    # start_after one drafts freely until its marker (its grammar does not apply before).
    assert drafts[0][0] > 0 and drafts[0][1] == drafts[0][0], drafts
    assert core.kv.num_free_blocks == core.kv.num_blocks


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_reasoning_budget_request_in_a_speculating_batch_is_plain(plain_core, spec_core, prompts):
    """A reasoning-budget request's forced end-of-reasoning tokens come where they come without
    speculation; its prompt repeats itself, so it would draft if it speculated."""
    end = tuple(plain_core.tokenizer.encode("</think>"))
    budget = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, reasoning_budget=6,
                            reasoning_end_ids=end, reasoning_open=True)
    accepted0, refused0 = spec_counts(spec_core)
    results = []
    for core in (plain_core, spec_core):
        seqs, outs = staged(core, speculating_batch(prompts), [(prompts[0], budget)])
        results.append([s.output_ids for s in seqs] + [[o.token_ids for o in outs[seqs[-1].seq_id]]])
        late = seqs[-1]
        assert late.spec is None
        assert tuple(late.output_ids[6:6 + len(end)]) == end
    assert results[1] == results[0]
    accepted, refused = spec_counts(spec_core)
    assert accepted > accepted0
    assert refused["reasoning_budget"] - refused0["reasoning_budget"] == 1


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_prompt_logprobs_unchanged_beside_drafted_rows(plain_core, spec_core, prompts):
    """A prompt-logprob request whose prefill follows drafted rows in a step (the rows scoring its
    prompt sit after the drafts in the flat batch) gets plain decoding's prompt logprobs and
    tokens; it drafts only once they are out."""
    params = dataclasses.replace(GREEDY, max_tokens=16, prompt_logprobs=2)
    late = [(prompts[1], params)]
    got = []
    for core in (plain_core, spec_core):
        seqs, outs = staged(core, speculating_batch(prompts), late)
        s = seqs[-1]
        first = outs[s.seq_id][0]
        assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompts[1]) - 1
        assert all(o.prompt_logprobs is None for o in outs[s.seq_id][1:])
        got.append((s, first.prompt_logprobs, outs[s.seq_id]))
    (ps, pl, _), (ss, sl, souts) = got
    assert ss.output_ids == ps.output_ids
    assert [(e.token_id, e.rank, [t for t, _ in e.top]) for e in sl] == \
        [(e.token_id, e.rank, [t for t, _ in e.top]) for e in pl]
    assert [e.logprob for e in sl] == pytest.approx([e.logprob for e in pl], abs=1e-4)
    assert souts[0].speculation is None or souts[0].speculation == (0, 0)  # no draft before they went out
    assert sum(o.speculation[1] for o in souts if o.speculation) > 0  # then it speculates


def test_abort_and_n_siblings_free_blocks(spec_core, prompts):
    params = dataclasses.replace(GREEDY, n=3, max_tokens=12)
    seqs = [s for s in spec_core.make_sequences(prompts[0], params)]
    for s in seqs:
        spec_core.add(s)
    spec_core.step()
    spec_core.step()
    spec_core.abort(seqs[1])
    while spec_core.has_work():
        spec_core.step()
    assert seqs[1].finish_reason == "abort"
    assert seqs[0].output_ids == seqs[2].output_ids and len(seqs[0].output_ids) == 12
    assert spec_core.kv.num_free_blocks == spec_core.kv.num_blocks


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_mixed_batch_and_async_scheduling(default_model, prompts, greedy_reference):
    """Speculating and plain sequences (speculative=False, sampled ones) share steps; with
    asynchronous scheduling forced on, steps with speculating sequences run synchronously."""
    core = make_core(default_model, async_scheduling=True, **SPEC)
    plain = dataclasses.replace(GREEDY, speculative=False)
    sampled = SamplingParams(temperature=0.7, max_tokens=32, seed=5, ignore_eos=True)
    seqs = []
    for i, ids in enumerate(prompts[:9]):
        params = (GREEDY, plain, sampled)[i % 3]
        seq = core.make_sequences(ids, params)[0]
        core.add(seq)
        seqs.append(seq)
    while core.has_work():
        core.step()
    for i, seq in enumerate(seqs):
        assert len(seq.output_ids) == 32
        if i % 3 != 2:
            assert seq.output_ids == greedy_reference[i], i
    assert core.stats()["speculative"]["num_accepted_tokens"] > 0
    assert core.kv.num_free_blocks == core.kv.num_blocks
    # The sampled ones again, alone: the same text (their seeds, their own drafts).
    for i in (2, 5):
        again = run_all(core, [prompts[i]], sampled)[0]
        assert again.output_ids == seqs[i].output_ids


def test_steps_without_drafts_take_the_plain_asynchronous_path(default_model, prompts):
    """With speculation on, a step in which no row can carry a draft is plain decoding's step:
    launched before the previous step's tokens are read (asynchronous scheduling), sampled by
    the Sampler, never verified. Here the proposer never finds anything: the speculating core
    overlaps exactly the steps a core without speculation overlaps, with the same tokens, and
    each output still reports its speculation (0 proposed)."""
    plain = make_core(default_model, async_scheduling=True)
    spec = make_core(default_model, async_scheduling=True, **SPEC)
    proposer = spec.speculator.proposer
    proposer.propose = lambda index, token_ids, k: []
    proposer.may_propose = lambda index, token_ids, k, exact=True: False
    params = dataclasses.replace(GREEDY, max_tokens=12)
    want = run_all(plain, prompts[:6], params)
    record = {}
    got = run_all(spec, prompts[:6], params, record)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert plain.num_overlapped_steps > 0
    assert (spec.num_steps, spec.num_overlapped_steps) == (plain.num_steps, plain.num_overlapped_steps)
    assert spec.num_verified_steps == 0
    assert all(out.speculation == (0, 0) for outs in record.values() for out in outs)
    assert spec.stats()["speculative"]["requests"] == 6


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_async_steps_wait_only_where_a_draft_may_come(default_model, prompts, greedy_reference):
    """The real n-gram proposer under asynchronous scheduling: repeating prompts draft (their
    steps verified, synchronously), random ones mostly cannot, and their steps overlap; the
    greedy tokens are plain decoding's either way."""
    core = make_core(default_model, async_scheduling=True, **SPEC)
    random_ids = prompts[len(REPEATING) + len(PLAIN):]
    assert [s.output_ids for s in run_all(core, random_ids, GREEDY)] == greedy_reference[-len(random_ids):]
    assert core.num_overlapped_steps > 0
    assert [s.output_ids for s in run_all(core, prompts[:4], GREEDY)] == greedy_reference[:4]
    assert core.num_verified_steps > 0
    assert core.kv.num_free_blocks == core.kv.num_blocks


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_seeded_sampling_repeats_alone_and_in_a_batch(spec_core, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=1234, ignore_eos=True)
    alone = run_all(spec_core, [prompts[0]], params)[0].output_ids
    again = run_all(spec_core, [prompts[0]], params)[0].output_ids
    batch = run_all(spec_core, prompts[:8], params)[0].output_ids
    assert alone == again == batch


# ---- sampling: the rejection rule, statistically ---------------------------------------------

VOCAB = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer random llama with a 16-token vocabulary, float32 on the CPU."""
    from tokenizers import Tokenizer, models

    config = ModelConfig.from_hf_dict(dict(PRESETS["smollm2-135m"], num_hidden_layers=2, hidden_size=128,
                                           intermediate_size=192, num_attention_heads=2, num_key_value_heads=1,
                                           vocab_size=VOCAB, tie_word_embeddings=False,
                                           max_position_embeddings=256))
    model = LlamaForCausalLM.empty(config, device=torch.device("cpu"), dtype=torch.float32)
    init_random_(model, 7)
    g = torch.Generator().manual_seed(8)
    model.model.embed_tokens.weight.data.normal_(0.0, 1.0, generator=g)
    model.lm_head.weight.data.normal_(0.0, 0.1, generator=g)
    model = model.eval().requires_grad_(False)
    path = tmp_path_factory.mktemp("tiny_tok")
    Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return LoadedModel(model.config, model, TokenizerSource("hf", str(path)), {}, "tiny")


def tiny_core(tiny, **overrides) -> EngineCore:
    cfg = EngineConfig(model="tiny", device="cpu", quantization="none", num_kv_blocks=4096, block_size=16,
                       max_num_seqs=1024, max_num_batched_tokens=16384)
    return EngineCore(dataclasses.replace(cfg, **overrides), loaded=tiny)


# 9 and 10 repeat: the suffix (9, 10) proposes 11, the token after its first occurrence.
TINY_PROMPT = [3, 9, 10, 11, 4, 5, 9, 10]
DRAFT = 11
DRAWS = 20000


def first_two(core: EngineCore, params: SamplingParams, seed0: int) -> Counter:
    seqs = []
    for i in range(DRAWS):
        seq = core.make_sequences(TINY_PROMPT, dataclasses.replace(params, seed=seed0 + i))[0]
        core.add(seq)
        seqs.append(seq)
    while core.has_work():
        core.step()
    assert all(len(s.output_ids) == 2 for s in seqs)
    return Counter(tuple(s.output_ids) for s in seqs)


def chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity (cells with fewer than 10 draws in all are
    pooled); the p-value from the Wilson-Hilferty normal approximation of the chi-square tail."""
    cells = set(a) | set(b)
    na, nb = sum(a.values()), sum(b.values())
    rows, pool = [], [0, 0]
    for c in cells:
        if a[c] + b[c] < 10:
            pool[0] += a[c]
            pool[1] += b[c]
        else:
            rows.append((a[c], b[c]))
    if sum(pool):
        rows.append(tuple(pool))
    stat = 0.0
    for x, y in rows:
        t = x + y
        ea, eb = t * na / (na + nb), t * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = len(rows) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def sampling_setup(tiny):
    """The bias that gives the draft token a probability near 1/2 at the first position (so it
    is accepted about half the time), and plain sampling's first two tokens under it."""
    plain = tiny_core(tiny)
    probe = SamplingParams(temperature=1.0, max_tokens=1, logprobs=VOCAB, ignore_eos=True, seed=0)
    out = {}
    run_all(plain, [TINY_PROMPT], probe, out)
    logprobs = dict(next(iter(out.values()))[0].top_logprobs[0])
    p = math.exp(logprobs[DRAFT])
    bias = math.log(0.5 / (1 - 0.5)) - math.log(p / (1 - p))
    params = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, logit_bias={DRAFT: bias})
    return params, first_two(plain, params, seed0=10**6)


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_rejection_sampling_keeps_the_distribution(tiny, sampling_setup):
    params, reference = sampling_setup
    spec = tiny_core(tiny, **SPEC)
    got = first_two(spec, params, seed0=0)
    stats = spec.stats()["speculative"]
    assert stats["num_draft_tokens"] >= DRAWS  # the first position always had the draft
    rate = stats["num_accepted_tokens"] / stats["num_draft_tokens"]
    assert 0.4 < rate < 0.6, stats
    assert chi_square_p(got, reference) > 1e-3, (got.most_common(8), reference.most_common(8))
    assert spec.kv.num_free_blocks == spec.kv.num_blocks


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_the_chi_square_rejects_a_verifier_without_the_residual(tiny, sampling_setup, monkeypatch):
    """On rejection, drawing from p itself (the draft token included) instead of the residual
    over-weights the draft: the same test must catch it."""
    params, reference = sampling_setup
    monkeypatch.setattr(verify_module, "residual_draw", lambda probs, token, noise: verify_module._race(probs, noise))
    spec = tiny_core(tiny, **SPEC)
    got = first_two(spec, params, seed0=0)
    assert chi_square_p(got, reference) < 1e-6


# ---- a draft model ---------------------------------------------------------------------------

def draft_core(default_model, draft, **overrides) -> EngineCore:
    cfg = dataclasses.replace(EngineConfig(model="default", device="cpu", quantization="none"),
                              **dict(SPEC, speculative_method="draft"), **overrides)
    return EngineCore(cfg, loaded=default_model, draft_loaded=draft)


def random_draft(vocab: int) -> LoadedModel:
    """A 2-layer random llama of the default model's vocabulary: a bad draft."""
    config = ModelConfig.from_hf_dict(dict(PRESETS["smollm2-135m"], num_hidden_layers=2, hidden_size=64,
                                           intermediate_size=96, num_attention_heads=1, num_key_value_heads=1,
                                           vocab_size=vocab, max_position_embeddings=8192))
    model = LlamaForCausalLM.empty(config, device=torch.device("cpu"), dtype=torch.float32)
    init_random_(model, 3)
    return LoadedModel(model.config, model.eval().requires_grad_(False), None, {}, "random-draft")


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
@pytest.mark.parametrize("which", ["self", "random"])
def test_draft_model_greedy_equals_plain(default_model, prompts, greedy_reference, which):
    """The default model drafting for itself (nearly every draft token accepted) and a random
    model of its vocabulary (nearly none): plain greedy decoding's tokens either way, with a
    pool small enough to preempt; both pools' blocks come back."""
    draft = default_model if which == "self" else random_draft(default_model.config.vocab_size)
    core = draft_core(default_model, draft, num_kv_blocks=48, block_size=4)
    got = [s.output_ids for s in run_all(core, prompts, dataclasses.replace(GREEDY, max_tokens=16))]
    assert got == [r[:16] for r in greedy_reference]
    stats = core.stats()["speculative"]
    assert core.scheduler.num_preemptions_total > 0
    if which == "self":
        assert stats["num_accepted_tokens"] > 0.9 * stats["num_draft_tokens"] > 100, stats
    else:
        assert stats["num_accepted_tokens"] < 0.2 * stats["num_draft_tokens"], stats
    proposer = core.speculator.proposer
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks
    assert core.kv.num_free_blocks == core.kv.num_blocks
