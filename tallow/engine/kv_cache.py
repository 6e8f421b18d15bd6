"""KV cache blocks: a ref-counted pool with a prefix cache, and the manager the scheduler uses.

A sequence's K/V live in fixed-size blocks listed in seq.block_table. With prefix caching, a
block that is full of computed tokens is registered under a hash chained over its parent's
hash and its own token ids, so the hash names the whole prefix up to the block's end. A later
sequence with the same prefix takes those blocks instead of computing them again. A cached
block whose last holder frees it is not forgotten: it waits in an LRU of free-but-cached
blocks, where a later hit revives it, until a fresh block is needed and it is evicted.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence as Tokens

from tallow.engine.request import Sequence


ROOT_HASH = 0  # the parent hash of a sequence's first block


def hash_block(parent: int, token_ids: Tokens[int]) -> int:
    """The prefix hash of a full block: chained over the parent block's hash.

    Python's hash of a tuple of ints is fast, 64-bit and the same in every process (ints are
    not randomised). A false hit would need two different prefixes to agree on all 64 bits,
    which we accept, as vLLM does with its default hash.
    """
    return hash((parent, tuple(token_ids)))


class BlockPool:
    """num_blocks blocks with ref counts, and the hash -> block map of the prefix cache.

    A block with ref count 0 is free: either truly free (no hash) or free-but-cached (it keeps
    its hash and sits in an LRU, oldest first). allocate() prefers truly free blocks and
    evicts the least recently freed cached block only when there are none.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got "
                             f"{num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU, oldest first
        self._cached: dict[int, int] = {}  # hash -> block id
        self.num_evictions = 0
        # Blocks ever handed out. The free list starts in id order and a released block goes
        # back to its front (handed out next, while its pages are resident and maybe in cache),
        # so these are blocks 0 .. blocks_touched - 1: on the CPU, where the cache's pages are
        # mapped lazily (runner.zeroed_cache), the part of the pool that is resident, as large as
        # the most blocks ever in use at once. (A FIFO list touched every block of the pool before
        # reusing one: a 7,500-token prompt after another spent 3.8% of its time faulting in and
        # zeroing fresh pages.)
        self.blocks_touched = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._free_cached)

    def allocate(self) -> int:
        """A block with ref count 1 and no hash. The caller checks num_free first."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._free_cached.popitem(last=False)
            del self._cached[self.block_hashes[block]]
            self.block_hashes[block] = None
            self.num_evictions += 1
        self.ref_counts[block] = 1
        if block >= self.blocks_touched:
            self.blocks_touched = block + 1
        return block

    def touch(self, block: int) -> None:
        """Take one more reference to a cached block, reviving it if it was free."""
        if self.ref_counts[block] == 0:
            del self._free_cached[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        """Drop one reference; at zero the block goes to the LRU if cached, else to the free list."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.block_hashes[block] is None:
                self._free.appendleft(block)
            else:
                self._free_cached[block] = None

    def lookup(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def register(self, block: int, block_hash: int) -> None:
        """Cache a full, computed block under its prefix hash.

        When the hash is already cached (two sequences computed the same prefix at the same
        time) the existing block stays the cached one and this block stays uncached.
        """
        if self.enable_prefix_caching and block_hash not in self._cached:
            self._cached[block_hash] = block
            self.block_hashes[block] = block_hash

    def check_invariants(self) -> None:
        free, free_cached = set(self._free), set(self._free_cached)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & free_cached, "a block is both free and free-cached"
        for block in range(self.num_blocks):
            ref, h = self.ref_counts[block], self.block_hashes[block]
            assert ref >= 0, f"block {block} has ref count {ref}"
            if h is not None:
                assert self._cached.get(h) == block, f"block {block} has a hash the cache does not map to it"
            if ref > 0:
                assert block not in free and block not in free_cached, f"used block {block} is on a free list"
            elif h is None:
                assert block in free, f"free block {block} is not on the free list"
            else:
                assert block in free_cached, f"free cached block {block} is not in the LRU"
        for h, block in self._cached.items():
            assert self.block_hashes[block] == h, f"cache maps a hash to block {block}, which has another"


class KVCacheManager:
    """Block tables of sequences over one BlockPool, with prefix cache lookups and counters.

    prefix_queries / prefix_hits count tokens over admissions (a sequence's first allocation,
    again after a preemption); num_evictions counts cached blocks given to new content.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # seq_id -> (the sequence, the hash chain of its leading blocks already offered to the cache)
        self._owners: dict[int, tuple[Sequence, list[int]]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_prefix(self, seq: Sequence) -> tuple[list[int], int]:
        """The longest run of cached full blocks that starts seq.token_ids, and its token count.

        Never the whole sequence: at least one token is left to compute (its logits are needed),
        so only the full blocks within token_ids[:-1] are looked up.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs, tokens = self.block_size, seq.token_ids
        blocks: list[int] = []
        parent = ROOT_HASH
        for start in range(0, (seq.num_tokens - 1) // bs * bs, bs):
            parent = hash_block(parent, tokens[start:start + bs])
            block = self.pool.lookup(parent)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * bs

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Grow seq.block_table to hold tokens up to seq.num_computed_tokens + num_new_tokens.

        On the sequence's first allocation, computed_blocks (from get_computed_prefix) are
        shared into its table and seq.num_computed_tokens is set to the tokens they hold;
        num_new_tokens counts from there. Returns False, changing nothing, when the pool has
        too few free blocks.
        """
        if seq.seq_id not in self._owners:
            return self._allocate_first(seq, num_new_tokens, computed_blocks or [])
        if computed_blocks:
            raise ValueError(f"{seq} already holds blocks; cached blocks come with its first allocation")
        num_needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if num_needed > self.pool.num_free:
            return False
        for _ in range(num_needed):
            seq.block_table.append(self.pool.allocate())
        return True

    def _allocate_first(self, seq: Sequence, num_new_tokens: int, computed: list[int]) -> bool:
        num_computed = len(computed) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens) - len(computed)
        # Cached blocks nobody holds count as free now; taking them uses up that free space.
        num_revived = sum(1 for b in computed if self.pool.ref_counts[b] == 0)
        if num_needed + num_revived > self.pool.num_free:
            return False
        for block in computed:
            self.pool.touch(block)
        seq.block_table.extend(computed)
        for _ in range(num_needed):
            seq.block_table.append(self.pool.allocate())
        seq.num_computed_tokens = num_computed
        self._owners[seq.seq_id] = (seq, [self.pool.block_hashes[b] for b in computed])
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_computed
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block of seq that is now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = self._owners[seq.seq_id][1]
        num_full = seq.num_computed_tokens // self.block_size
        bs, tokens = self.block_size, seq.token_ids
        for i in range(len(hashes), num_full):
            h = hash_block(hashes[-1] if hashes else ROOT_HASH, tokens[i * bs:(i + 1) * bs])
            hashes.append(h)
            self.pool.register(seq.block_table[i], h)

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past those that hold seq's computed tokens (a speculative step's
        rejected slots), last first. They hold no full computed block, so no cached hash."""
        keep = self.num_blocks_for(seq.num_computed_tokens)
        table = seq.block_table
        while len(table) > keep:
            self.pool.release(table.pop())

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, last first, so the tail of a prefix is evicted before its head
        (and uncached blocks go back to the front of the free list in their table's order)."""
        for block in reversed(seq.block_table):
            self.pool.release(block)
        seq.block_table.clear()
        self._owners.pop(seq.seq_id, None)

    def check_invariants(self) -> None:
        """Ref counts equal the number of block tables holding each block; free lists agree."""
        self.pool.check_invariants()
        holders = [0] * self.pool.num_blocks
        for seq, hashes in self._owners.values():
            assert len(hashes) <= len(seq.block_table), f"{seq} has more hashes than blocks"
            for block in seq.block_table:
                holders[block] += 1
        assert holders == self.pool.ref_counts, "ref counts differ from the block tables holding them"
