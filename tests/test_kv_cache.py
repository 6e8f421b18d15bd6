"""BlockPool and KVCacheManager: ref counts, prefix hash chain, LRU of free cached blocks."""

import pytest

from tallow.engine.kv_cache import BlockPool, KVCacheManager
from tallow.engine.request import Sequence
from tallow.engine.sampling import SamplingParams

BS = 4


def make_seq(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=8))


def admit(kv: KVCacheManager, seq: Sequence) -> int:
    """Admit seq as the scheduler does, compute its whole prompt, register its blocks."""
    blocks, num_cached = kv.get_computed_prefix(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - num_cached, blocks)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    kv.check_invariants()
    return num_cached


def test_pool_prefers_truly_free_blocks_then_evicts_least_recently_freed():
    pool = BlockPool(4, BS)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.register(a, 101)
    pool.register(b, 102)
    pool.release(b)
    pool.release(a)  # LRU: b then a
    pool.release(c)  # no hash: truly free
    assert pool.num_free == 4
    assert {pool.allocate(), pool.allocate()} == {3, c}  # the two uncached blocks first
    assert pool.num_evictions == 0 and pool.lookup(102) == b
    assert pool.allocate() == b  # freed first, evicted first
    assert pool.num_evictions == 1 and pool.lookup(102) is None and pool.lookup(101) == a
    pool.check_invariants()


def test_blocks_touched_counts_the_distinct_blocks_ever_handed_out():
    """A released block is handed out again before any untouched one (its pages are resident),
    so the touched blocks are always 0 .. blocks_touched - 1 (the CPU pool's resident part), as
    many as were ever in use at once."""
    pool = BlockPool(6, BS)
    for _ in range(3):  # hold 2, free them, again: the same two blocks each time
        held = [pool.allocate(), pool.allocate()]
        assert held == [0, 1] and pool.blocks_touched == 2
        for b in reversed(held):
            pool.release(b)
    held = [pool.allocate() for _ in range(4)]  # 4 at once: two reused, two new
    assert held == [0, 1, 2, 3] and pool.blocks_touched == 4
    pool.release(held[1])
    assert pool.allocate() == 1 and pool.blocks_touched == 4  # the freed block, not block 4
    pool.check_invariants()


def test_pool_revives_a_free_cached_block_and_keeps_the_first_of_duplicate_hashes():
    pool = BlockPool(3, BS)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, 7)
    pool.register(b, 7)  # the same content computed twice: a stays the cached copy
    assert pool.lookup(7) == a and pool.block_hashes[b] is None
    pool.release(a)
    pool.release(b)
    assert pool.num_free == 3
    pool.touch(a)  # a hit revives it out of the LRU
    assert pool.ref_counts[a] == 1 and pool.num_free == 2
    pool.check_invariants()


def test_prefix_lookup_follows_the_hash_chain_and_leaves_one_token_to_compute():
    kv = KVCacheManager(16, BS)
    first = make_seq(range(12))  # three full blocks
    assert admit(kv, first) == 0
    assert admit(kv, make_seq(range(12))) == 8  # the last full block holds the last token
    assert admit(kv, make_seq(list(range(12)) + [99])) == 12
    assert admit(kv, make_seq(list(range(6)) + [50, 51, 52, 53])) == 4  # diverges in block 2
    # Block 2's tokens match but its parent does not: the chain tells the prefixes apart.
    assert admit(kv, make_seq([9, 9, 9, 9] + list(range(4, 12)))) == 0


def test_shared_blocks_are_ref_counted_and_counters_are_in_tokens():
    kv = KVCacheManager(16, BS)
    a, b = make_seq(range(10)), make_seq(list(range(8)) + [70, 71, 72])
    admit(kv, a)
    admit(kv, b)
    assert b.num_computed_tokens == b.num_tokens and b.block_table[:2] == a.block_table[:2]
    assert [kv.pool.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    assert kv.prefix_queries == 21 and kv.prefix_hits == 8
    assert kv.num_free_blocks == 16 - 4 and kv.usage == pytest.approx(4 / 16)
    kv.free(a)
    kv.free(b)
    kv.check_invariants()
    assert kv.num_free_blocks == 16


def test_allocate_slots_grows_block_by_block_and_changes_nothing_when_full():
    kv = KVCacheManager(3, BS, enable_prefix_caching=False)
    seq = make_seq(range(5))
    assert kv.allocate_slots(seq, 5) and len(seq.block_table) == 2
    seq.num_computed_tokens = 5
    for _ in range(3):  # positions 5..7 fit in block 2
        assert kv.allocate_slots(seq, 1) and len(seq.block_table) == 2
        seq.num_computed_tokens += 1
    assert kv.allocate_slots(seq, 1) and len(seq.block_table) == 3
    seq.num_computed_tokens += 4
    table = list(seq.block_table)
    assert not kv.allocate_slots(seq, 1)
    assert seq.block_table == table and kv.num_free_blocks == 0
    kv.check_invariants()


def test_a_hit_on_free_cached_blocks_counts_them_against_the_free_space():
    kv = KVCacheManager(4, BS)
    first = make_seq(range(13))  # 3 full blocks cached, 4 blocks in all
    admit(kv, first)
    kv.free(first)
    again = make_seq(list(range(12)) + [1, 2, 3, 4, 5, 6])  # hits 3 blocks, needs 2 more
    blocks, num_cached = kv.get_computed_prefix(again)
    assert num_cached == 12
    assert not kv.allocate_slots(again, again.num_tokens - num_cached, blocks)
    assert again.block_table == [] and again.num_computed_tokens == 0
    assert kv.num_free_blocks == 4 and kv.num_evictions == 0
    kv.check_invariants()


def test_free_releases_the_tail_first_so_eviction_keeps_the_head_of_a_prefix():
    kv = KVCacheManager(6, BS)
    old = make_seq(range(16))  # blocks 0..3, of which 0..2 are looked up later
    admit(kv, old)
    kv.free(old)
    # 2 truly free blocks + 4 cached ones; needing 4 evicts the 2 tail blocks of `old`.
    other = make_seq(range(100, 116))
    admit(kv, other)
    assert kv.num_evictions == 2
    kv.free(other)
    assert admit(kv, make_seq(range(16))) == 8


def test_disabled_prefix_caching_never_hits():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    admit(kv, make_seq(range(9)))
    assert admit(kv, make_seq(range(9))) == 0
    assert kv.prefix_queries == 0
