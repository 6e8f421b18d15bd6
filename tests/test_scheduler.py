"""Scheduler driven by a fake model: budgets, chunked prefill, prefix sharing, preemption, abort."""

import random

import numpy as np
import pytest

from tallow.config import EngineConfig
from tallow.engine.kv_cache import KVCacheManager
from tallow.engine.request import Sequence, SequenceStatus
from tallow.engine.sampling import SamplingParams
from tallow.engine.scheduler import Scheduler, SchedulerOutput
from tallow.errors import TallowError

EOS = 0


class FakeModel:
    """Stands in for the model runner: writes each computed token id into its KV slot.

    Before writing, it checks that every earlier position of each row holds that row's token
    there: what paged attention would read. This catches a block table pointing at the wrong
    block, a prefix cache hit on other content, and a block reused while still in use.
    Sampled tokens are random but reproducible.
    """

    def __init__(self, kv: KVCacheManager, seed: int = 0, vocab: int = 50):
        self.bs = kv.block_size
        self.slots = np.full(kv.num_blocks * kv.block_size, -1, dtype=np.int64)
        self.rng = random.Random(seed)
        self.vocab = vocab

    def slot_of(self, seq: Sequence, positions: np.ndarray) -> np.ndarray:
        table = np.asarray(seq.block_table, dtype=np.int64)
        return table[positions // self.bs] * self.bs + positions % self.bs

    def run(self, out: SchedulerOutput) -> list[int]:
        sampled = []
        for s in out.scheduled:
            tokens = np.asarray(s.seq.token_ids, dtype=np.int64)
            context = np.arange(s.start)
            assert (self.slots[self.slot_of(s.seq, context)] == tokens[:s.start]).all(), \
                f"{s.seq} reads a context that is not its own"
            new = np.arange(s.start, s.start + s.num_new_tokens)
            self.slots[self.slot_of(s.seq, new)] = tokens[new]
            if s.samples:
                sampled.append(self.rng.randrange(self.vocab))
        return sampled


class Harness:
    def __init__(self, num_blocks=64, block_size=16, max_model_len=4096, seed=0, **config):
        self.config = EngineConfig(block_size=block_size, **config)
        self.kv = KVCacheManager(num_blocks, block_size, self.config.enable_prefix_caching)
        self.sched = Scheduler(self.config, self.kv, max_model_len)
        self.model = FakeModel(self.kv, seed)
        self.outputs: list[SchedulerOutput] = []

    def add(self, prompt, max_tokens=4, **kw) -> Sequence:
        seq = Sequence(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       eos_token_ids={EOS}, **kw)
        self.sched.add(seq)
        return seq

    def step(self) -> list[Sequence]:
        out = self.sched.schedule()
        self.outputs.append(out)
        self.check(out)
        finished = self.sched.update(out, self.model.run(out))
        self.sched.check_invariants()
        return finished

    def check(self, out: SchedulerOutput) -> None:
        self.sched.check_invariants()
        rows = out.scheduled
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in rows)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len({s.seq.seq_id for s in rows}) == len(rows)
        is_decode = [s.num_new_tokens == 1 and s.samples for s in rows]
        assert is_decode == sorted(is_decode, reverse=True), "decode rows must come first"
        for s in rows:
            assert s.seq.status is SequenceStatus.RUNNING and s.start == s.seq.num_computed_tokens
            assert s.num_new_tokens >= 1 and s.start + s.num_new_tokens <= s.seq.num_tokens
            if self.config.long_prefill_token_threshold and not s.samples:
                assert s.num_new_tokens <= self.config.long_prefill_token_threshold

    def run_until_done(self, max_steps=10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("the scheduler made no progress")


def prompt(n, start=1000):
    return range(start, start + n)


def test_cached_tokens_count_only_the_prompt_when_forced_tokens_follow_it():
    # a grammar forces tokens at the start before the sequence is scheduled (they follow the
    # prompt in token_ids); a second identical request finds them cached too, yet usage counts
    # cached tokens as part of the prompt (Anthropic's input_tokens = prompt - cached went -1)
    h = Harness(num_blocks=64, block_size=16)
    forced = list(prompt(10, 7000))
    first = h.add(list(prompt(30)), max_tokens=12)
    first.token_ids.extend(forced)
    h.run_until_done()
    again = h.add(list(prompt(30)), max_tokens=12)
    again.token_ids.extend(forced)
    h.step()
    assert again.num_prompt_tokens == 30 and again.num_cached_tokens == 30
    h.run_until_done()


def test_prefix_cache_shares_the_full_blocks_of_a_common_prefix():
    h = Harness(num_blocks=64, block_size=16)
    shared = list(prompt(300))
    a = h.add(shared + list(prompt(20, 5000)), max_tokens=6)
    h.step()
    b = h.add(shared + list(prompt(25, 6000)), max_tokens=6)
    h.step()
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 288  # 18 full blocks of 16
    assert b.block_table[:18] == a.block_table[:18] and b.block_table[18] != a.block_table[18]
    shared_blocks = a.block_table[:18]
    assert all(h.kv.pool.ref_counts[x] == 2 for x in shared_blocks)
    h.run_until_done()
    # Free again, but still cached: they wait in the LRU.
    assert h.kv.num_free_blocks == 64
    assert all(h.kv.pool.ref_counts[x] == 0 and h.kv.pool.block_hashes[x] is not None
               for x in shared_blocks)
    c = h.add(shared + [7], max_tokens=2)
    h.step()
    assert c.num_cached_tokens == 288 and c.block_table[:18] == shared_blocks
    h.run_until_done()
    assert h.kv.prefix_hits == 2 * 288 and h.kv.num_free_blocks == 64


def test_eviction_under_pressure_takes_the_least_recently_freed_blocks_first():
    h = Harness(num_blocks=12, block_size=4)
    old, new = list(prompt(16, 100)), list(prompt(16, 200))
    h.add(old + [1], max_tokens=1)
    h.run_until_done()
    h.add(new + [1], max_tokens=1)
    h.run_until_done()
    # Both prefixes are cached in 8 free blocks; 4 blocks are truly free.
    assert h.kv.num_free_blocks == 12 and h.kv.num_evictions == 0
    h.add(prompt(24, 300), max_tokens=1)  # 6 blocks: 4 free ones, then 2 evictions
    h.run_until_done()
    assert h.kv.num_evictions == 2
    def cached_tokens(tokens):
        return h.kv.get_computed_prefix(Sequence(tokens, SamplingParams()))[1]

    assert cached_tokens(new + [2]) == 16
    assert cached_tokens(old + [2]) == 8  # the older prefix lost its two tail blocks
    assert h.kv.num_free_blocks == 12


def test_chunked_prefill_spans_steps_and_samples_only_on_the_last_chunk():
    h = Harness(num_blocks=128, block_size=16, max_num_batched_tokens=256)
    seq = h.add(prompt(1000), max_tokens=3)
    chunks = []
    while seq.num_output_tokens == 0:
        h.step()
        (row,) = h.outputs[-1].scheduled
        chunks.append((row.num_new_tokens, row.samples))
    assert chunks == [(256, False), (256, False), (256, False), (232, True)]
    assert seq.first_token_time is not None and seq.first_token_time >= seq.first_scheduled_time
    h.run_until_done()
    assert seq.num_output_tokens == 3 and seq.finish_reason == "length"


def test_decode_rows_come_first_and_share_the_budget_with_prefill_chunks():
    h = Harness(num_blocks=256, block_size=16, max_num_batched_tokens=256,
                long_prefill_token_threshold=100)
    decoding = [h.add(prompt(10, 10 * i), max_tokens=30) for i in range(3)]
    h.step()
    long = h.add(prompt(700), max_tokens=2)
    for _ in range(3):
        h.step()
        out = h.outputs[-1]
        assert [s.seq for s in out.scheduled] == decoding + [long]
        assert out.scheduled[-1].num_new_tokens == 100 and not out.is_decode_only
    h.run_until_done()
    assert any(out.is_decode_only for out in h.outputs)
    assert all(seq.num_output_tokens == 30 for seq in decoding) and long.num_output_tokens == 2
    assert h.kv.num_free_blocks == 256


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes_the_newest_sequence_and_everyone_finishes(prefix_caching):
    h = Harness(num_blocks=24, block_size=4, max_num_batched_tokens=64,
                long_prefill_token_threshold=8, enable_prefix_caching=prefix_caching)
    seqs = [h.add(prompt(18, 100 * i), max_tokens=40) for i in range(4)]  # each needs 15 blocks
    while h.sched.has_work():
        before = list(h.sched.running)
        h.step()
        out = h.outputs[-1]
        if out.preempted:
            # Victims are taken newest first.
            assert out.preempted == before[::-1][:len(out.preempted)]
            assert all(seq.num_computed_tokens == 0 for seq in out.preempted)
            assert list(h.sched.waiting)[:len(out.preempted)] == out.preempted[::-1]
            # Memory is short: nobody is admitted in that step, the victims least of all.
            assert {s.seq for s in out.scheduled} <= set(before) - set(out.preempted)
        assert len(h.outputs) < 2000
    assert h.sched.num_preemptions_total > 0
    assert sum(seq.num_preemptions for seq in seqs) == h.sched.num_preemptions_total
    assert all(seq.num_output_tokens == 40 and seq.finish_reason == "length" for seq in seqs)
    assert h.kv.num_free_blocks == 24


def test_a_context_that_outgrows_the_whole_pool_finishes_with_length():
    h = Harness(num_blocks=4, block_size=4)
    seq = h.add(prompt(14), max_tokens=100)
    h.run_until_done()
    # 16 slots: tokens 15 and 16 fit, a 17th could never be computed.
    assert seq.finish_reason == "length" and seq.num_output_tokens == 3
    assert h.kv.num_free_blocks == 4


def test_max_num_seqs_and_fifo_admission():
    h = Harness(num_blocks=256, max_num_seqs=3)
    seqs = [h.add(prompt(5 + i, 100 * i), max_tokens=4 + i) for i in range(8)]
    admitted = []
    while h.sched.has_work():
        h.step()
        assert h.sched.num_running <= 3
        admitted += [s.seq for s in h.outputs[-1].scheduled if s.start == 0]
    assert admitted == seqs


def test_a_waiting_sequence_that_does_not_fit_blocks_the_ones_behind_it():
    h = Harness(num_blocks=10, block_size=4, max_num_batched_tokens=512)
    running = h.add(prompt(20), max_tokens=8)  # 5 blocks, 6 once decoding
    h.step()
    big = h.add(prompt(24, 300), max_tokens=1)  # 6 blocks: must wait for `running`
    small = h.add(prompt(3, 500), max_tokens=1)  # would fit now
    h.step()
    assert big.status is SequenceStatus.WAITING and small.status is SequenceStatus.WAITING
    h.run_until_done()
    assert big.first_scheduled_time <= small.first_scheduled_time
    assert big.first_scheduled_time > running.first_token_time


@pytest.mark.parametrize("where", ["waiting", "mid-prefill", "decode"])
def test_abort_frees_every_block(where):
    h = Harness(num_blocks=64, block_size=16, max_num_batched_tokens=128)
    other = h.add(prompt(40, 100), max_tokens=50)
    seq = h.add(prompt(300), max_tokens=50)
    steps = {"waiting": 0, "mid-prefill": 2, "decode": 5}[where]
    for _ in range(steps):
        h.step()
    assert (seq.status is SequenceStatus.RUNNING) == (where != "waiting")
    assert (0 < seq.num_computed_tokens < 300) == (where == "mid-prefill")
    assert (seq.num_output_tokens > 0) == (where == "decode")
    h.sched.abort(seq)
    h.sched.check_invariants()
    assert seq.finish_reason == "abort" and seq.block_table == []
    assert seq not in h.sched.running and seq not in h.sched.waiting
    h.run_until_done()
    assert other.num_output_tokens == 50 and h.kv.num_free_blocks == 64


def test_abort_between_schedule_and_update_skips_the_row():
    h = Harness()
    a, b = h.add(prompt(5, 100), max_tokens=3), h.add(prompt(6, 200), max_tokens=3)
    out = h.sched.schedule()
    sampled = h.model.run(out)
    h.sched.abort(a)
    assert h.sched.update(out, sampled) == []
    assert a.num_output_tokens == 0 and b.output_ids == [sampled[1]]
    h.run_until_done()
    assert h.kv.num_free_blocks == 64


def test_fail_finishes_the_scheduled_sequences_with_error():
    h = Harness(num_blocks=64, max_num_seqs=2)
    a, b, c = (h.add(prompt(20, 100 * i), max_tokens=5) for i in range(3))
    out = h.sched.schedule()
    assert h.sched.fail(out) == [a, b]
    assert a.finish_reason == b.finish_reason == "error" and c.status is SequenceStatus.WAITING
    h.sched.check_invariants()
    h.run_until_done()
    assert c.num_output_tokens == 5 and h.kv.num_free_blocks == 64


def test_stop_token_finishes_and_first_token_time_is_recorded():
    h = Harness()
    seq = Sequence(list(prompt(5)), SamplingParams(max_tokens=10), eos_token_ids={EOS})
    h.sched.add(seq)
    out = h.sched.schedule()
    assert h.sched.update(out, [EOS]) == [seq]
    assert seq.finish_reason == "stop" and seq.stop_token_id == EOS and seq.first_token_time
    assert out.scheduled[0].samples  # fixed at schedule time, true after the token is appended
    assert h.kv.num_free_blocks == 64


def test_n_siblings_wait_for_the_prompt_then_share_its_blocks():
    h = Harness(num_blocks=128, block_size=16, max_num_batched_tokens=256)
    first = h.add(prompt(600), max_tokens=4)
    siblings = [h.add(prompt(600), max_tokens=4, prefill_after=first) for _ in range(2)]
    other = h.add(prompt(30, 9000), max_tokens=4)
    for _ in range(3):  # 600 tokens in chunks of 256: the prompt is done after step 3
        h.step()
        assert all(s.status is SequenceStatus.WAITING for s in siblings)
    h.step()
    assert all(s.status is SequenceStatus.RUNNING for s in siblings)
    assert other.first_scheduled_time < siblings[0].first_scheduled_time  # not held behind them
    for s in siblings:
        assert s.num_cached_tokens == 592 and s.block_table[:37] == first.block_table[:37]
    assert all(h.kv.pool.ref_counts[x] == 3 for x in first.block_table[:37])
    h.run_until_done()
    assert all(s.num_output_tokens == 4 for s in [first, *siblings])
    assert h.kv.num_free_blocks == 128


def test_add_rejects_prompts_that_can_never_run():
    h = Harness(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(TallowError):
        h.add(prompt(17))  # 5 blocks, the pool has 4
    with pytest.raises(TallowError):
        Harness(max_model_len=10).add(prompt(10))
    seq = h.add(prompt(16), max_tokens=50)
    assert seq.max_model_len == 100
    h.run_until_done()
    assert seq.finish_reason == "length" and seq.num_output_tokens == 1


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_workload_keeps_the_cache_consistent(prefix_caching):
    """Shared prefixes, arrivals over time, aborts, a small pool: every step is checked."""
    rng = random.Random(1)
    h = Harness(num_blocks=40, block_size=4, max_num_batched_tokens=48, max_num_seqs=6,
                long_prefill_token_threshold=20, enable_prefix_caching=prefix_caching, seed=2)
    bases = [[rng.randrange(1, 50) for _ in range(40)] for _ in range(3)]
    seqs, aborted = [], set()
    for step in range(400):
        if step < 250 and rng.random() < 0.3:
            base = rng.choice(bases)
            p = base[:rng.randrange(1, 40)] + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 12))]
            first = h.add(p, max_tokens=rng.randrange(1, 30))
            seqs.append(first)
            if rng.random() < 0.2:
                seqs += [h.add(p, max_tokens=rng.randrange(1, 30), prefill_after=first)]
        live = [s for s in seqs if not s.is_finished]
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            h.sched.abort(victim)
            aborted.add(victim.seq_id)
        if h.sched.has_work():
            h.step()
    h.run_until_done()
    for s in seqs:
        if s.seq_id not in aborted:
            assert s.finish_reason == "length" and s.num_output_tokens == s.params.max_tokens
    assert h.kv.num_free_blocks == 40
    assert (h.kv.prefix_hits > 0) == prefix_caching
