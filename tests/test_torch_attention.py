"""The CPU attention backends (the torch reference and tallow's own kernel, over float32,
float16 and int8 caches) against plain float64 attention, and a row's result bit for bit the
same whatever it is batched with. An int8 cache's rows are read back here independently of the
kernels (each block of 32 codes times its float32 scale, from the bytes after the row's codes),
so its attention is compared with float64 attention over the values the cache holds."""

from __future__ import annotations

import pytest
import torch

from tallow.attention.cpu_backend import CpuAttentionBackend
from tallow.attention.metadata import AttentionMetadata
from tallow.attention.torch_ref import TorchAttentionBackend
from tallow.ops import cpu_native

native = pytest.mark.skipif(cpu_native.lib() is None, reason=f"no CPU kernels: {cpu_native.unavailable_reason()}")


@pytest.fixture(params=[(TorchAttentionBackend, torch.float32), pytest.param((CpuAttentionBackend, torch.float32), marks=native),
                        pytest.param((CpuAttentionBackend, torch.float16), marks=native),
                        pytest.param((CpuAttentionBackend, torch.int8), marks=native)],
                ids=["torch", "native", "native-fp16-cache", "native-int8-cache"])
def backend(request):
    """PagedKV's backend and cache dtype."""
    cls, dtype = request.param
    return {"backend": cls, "dtype": dtype}

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M's attention
NUM_BLOCKS = 128
SCALE = HEAD_DIM ** -0.5
NATIVE_DTYPES = [torch.float32, torch.float16, torch.int8]


def random_cache(shape: tuple[int, int, int, int], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """A cache [blocks, block_size, kv_heads, D] of random values; int8: each row D codes in
    [-127, 127] and then a float32 scale's 4 bytes per block of 32 (values about N(0, 1))."""
    if dtype != torch.int8:
        return torch.randn(shape, generator=g).to(dtype)
    *lead, D = shape
    codes = torch.randint(-127, 128, (*lead, D), generator=g, dtype=torch.int8)
    scales = (torch.rand(*lead, D // 32, generator=g) * 0.02 + 0.005).float()
    return torch.cat((codes, scales.view(torch.int8)), dim=-1).contiguous()


def cache_values(cache: torch.Tensor, D: int) -> torch.Tensor:
    """The float32 values a cache holds, [..., D]: an int8 row's blocks of 32 codes times their scales."""
    if cache.dtype != torch.int8:
        return cache.float()
    scales = cache[..., D:].contiguous().view(torch.float32)  # [..., D / 32]
    return (cache[..., :D].float().unflatten(-1, (D // 32, 32)) * scales[..., None]).flatten(-2)


class PagedKV:
    """A filled KV cache with shuffled block tables; each sequence's queries and K/V are fixed,
    so the same sequence can be put into different batches."""

    def __init__(self, context_lens: list[int], seed: int = 0, backend=TorchAttentionBackend,
                 dtype: torch.dtype = torch.float32):
        self.backend = backend
        g = torch.Generator().manual_seed(seed)
        shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
        self.k_cache, self.v_cache = (random_cache(shape, dtype, g) for _ in range(2))
        free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        self.tables = [[free.pop() for _ in range(-(-n // BLOCK))] for n in context_lens]
        self.q = [torch.randn(n, HEADS, HEAD_DIM, generator=g) for n in context_lens]

    def kv(self, seq: int, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        slots = torch.tensor([self.tables[seq][p // BLOCK] * BLOCK + p % BLOCK for p in positions])
        return tuple(cache_values(c.view(-1, KV_HEADS, c.shape[-1])[slots], HEAD_DIM) for c in (self.k_cache, self.v_cache))

    def batch(self, chunks: list[tuple[int, int, int]]):
        """(seq, context length after the step, query length) per sequence -> backend inputs."""
        qs, ks, vs, slots, tables = [], [], [], [], []
        for seq, ctx, q_len in chunks:
            positions = range(ctx - q_len, ctx)
            k, v = (x.float() for x in self.kv(seq, positions))  # the model's K/V are float32 rows
            qs.append(self.q[seq][ctx - q_len: ctx])
            ks.append(k)
            vs.append(v)
            slots += [self.tables[seq][p // BLOCK] * BLOCK + p % BLOCK for p in positions]
            tables.append(self.tables[seq][: -(-ctx // BLOCK)])
        width = max(map(len, tables))
        query_lens = [q_len for _, _, q_len in chunks]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
            seq_lens=torch.tensor([ctx for _, ctx, _ in chunks], dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            max_query_len=max(query_lens), max_seq_len=max(ctx for _, ctx, _ in chunks),
            query_lens_cpu=query_lens, seq_lens_cpu=[ctx for _, ctx, _ in chunks], block_size=BLOCK)
        return torch.cat(qs), torch.cat(ks), torch.cat(vs), meta

    def attend(self, chunks: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """The backend's output rows of each sequence."""
        q, k, v, meta = self.batch(chunks)
        out = self.backend().forward(q, k, v, self.k_cache, self.v_cache, meta, SCALE)
        return list(out.split(meta.query_lens_cpu))

    def reference(self, seq: int, ctx: int, q_len: int) -> torch.Tensor:
        """Causal attention in float64 over the sequence's first ctx tokens, KV heads repeated."""
        k, v = (x.double().repeat_interleave(HEADS // KV_HEADS, dim=1) for x in self.kv(seq, range(ctx)))
        q = self.q[seq][ctx - q_len: ctx].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
        causal = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, v).float()


CONTEXTS = [37, 16, 1, 130, 48, 5, 100]


def test_matches_float64_attention(backend):
    kv = PagedKV(CONTEXTS, **backend)
    # Decode rows of several block counts, a prefill chunk over a cached prefix, a whole prompt.
    chunks = [(0, 37, 1), (1, 16, 1), (3, 130, 1), (4, 48, 20), (5, 5, 5), (6, 100, 1)]
    for (seq, ctx, q_len), out in zip(chunks, kv.attend(chunks)):
        torch.testing.assert_close(out, kv.reference(seq, ctx, q_len), atol=1e-5, rtol=1e-5)
    # A decode-only batch, and a lone sequence.
    decode = [(seq, n, 1) for seq, n in enumerate(CONTEXTS) if n > 1]
    for (seq, ctx, q_len), out in zip(decode, kv.attend(decode)):
        torch.testing.assert_close(out, kv.reference(seq, ctx, q_len), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.attend([(3, 130, 1)])[0], kv.reference(3, 130, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_row_does_not_depend_on_its_batch(threads, backend):
    kv = PagedKV(CONTEXTS + [40, 45, 33, 700], **backend)
    decode = [(seq, n, 1) for seq, n in enumerate(CONTEXTS + [40, 45, 33, 700]) if n > 1]
    batches = [
        decode,  # every block count, five rows of 3 blocks
        decode[::-1],
        [(0, 37, 1), (8, 45, 1)],  # same block count, other neighbours
        [(4, 48, 7), (0, 37, 1), (5, 5, 5), (3, 130, 1)],  # mixed with prefill chunks
    ]
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # threads split the work differently for different batches
    try:
        alone = {seq: kv.attend([(seq, ctx, 1)])[0] for seq, ctx, _ in decode}
        for batch in batches:
            for (seq, _, q_len), out in zip(batch, kv.attend(batch)):
                if q_len == 1:
                    assert torch.equal(out, alone[seq]), (seq, batch)
    finally:
        torch.set_num_threads(old_threads)



@pytest.mark.parametrize("threads", [1, 2])
def test_lone_row_on_consecutive_blocks_reads_them_in_place_with_the_same_result(threads, backend):
    kv = PagedKV(CONTEXTS, **backend)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        before = kv.attend([(3, 130, 1)])[0]
        # Move sequence 3's blocks to a run of consecutive free blocks.
        used = {b for table in kv.tables for b in table}
        n = len(kv.tables[3])
        start = next(s for s in range(NUM_BLOCKS - n) if used.isdisjoint(range(s, s + n)))
        for cache in (kv.k_cache, kv.v_cache):
            cache[start: start + n] = cache[kv.tables[3]]
        kv.tables[3] = list(range(start, start + n))
        assert torch.equal(kv.attend([(3, 130, 1)])[0], before)
    finally:
        torch.set_num_threads(old_threads)


@native
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_native_prefill_rows_do_not_depend_on_their_batch(threads, dtype):
    """The kernel computes every query token from its own causal context: a prefill chunk's
    rows too are the same alone, with neighbours, or split into smaller chunks."""
    kv = PagedKV(CONTEXTS, backend=CpuAttentionBackend, dtype=dtype)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = kv.attend([(4, 48, 20)])[0]
        mixed = kv.attend([(0, 37, 1), (4, 48, 20), (6, 100, 1)])[1]
        first, second = kv.attend([(4, 38, 10)])[0], kv.attend([(4, 48, 10)])[0]
        assert torch.equal(mixed, alone)
        assert torch.equal(torch.cat((first, second)), alone)
    finally:
        torch.set_num_threads(old_threads)


@native
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
def test_native_rows_over_several_spans_of_chunks(dtype):
    """Long contexts: a work item merges a span of up to four 64-key chunks, and a token's spans
    are merged at the end. A prefill chunk whose tokens end on both sides of a span boundary (8
    and 9+ chunks) and of query blocks: against float64, split differently, and each row the same
    as that token's decode row alone."""
    kv = PagedKV([600, 300], backend=CpuAttentionBackend, dtype=dtype)
    whole = kv.attend([(0, 600, 90), (1, 300, 1)])[0]
    torch.testing.assert_close(whole, kv.reference(0, 600, 90), atol=1e-5, rtol=1e-5)
    split = torch.cat(kv.attend([(0, 541, 31), (1, 300, 1)])[:1] + kv.attend([(0, 600, 59)]))
    assert torch.equal(split, whole)
    for ctx in (511, 512, 513, 577, 600):  # the token at position ctx - 1 as a lone decode row
        assert torch.equal(kv.attend([(0, ctx, 1)])[0][0], whole[ctx - 511])


@native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
def test_native_decode_batch_of_many_spans(threads, dtype):
    """A decode batch with spans enough that a thread claims a span's heads together and
    prefetches the next span's rows from inside the current one's loops: against float64."""
    contexts = [37, 16, 130, 48, 5, 100, 260, 300, 64, 65, 200, 129]
    kv = PagedKV(contexts, seed=3, backend=CpuAttentionBackend, dtype=dtype)
    decode = [(seq, n, 1) for seq, n in enumerate(contexts)]
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for (seq, ctx, q_len), out in zip(decode, kv.attend(decode)):
            torch.testing.assert_close(out, kv.reference(seq, ctx, q_len), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(old_threads)


class ManyHeads:
    """Sequences of the given context lengths over a float16 cache of `kv_heads` KV heads of 64,
    one query head each (no grouping), blocks shuffled."""

    def __init__(self, contexts: list[int], kv_heads: int, seed: int):
        self.kv_heads, self.D, self.block = kv_heads, 64, 16
        g = torch.Generator().manual_seed(seed)
        free = torch.randperm(sum(-(-n // self.block) for n in contexts) + 3, generator=g).tolist()
        self.tables = [[free.pop() for _ in range(-(-n // self.block))] for n in contexts]
        self.k_cache, self.v_cache = (
            torch.randn(len(free) + sum(map(len, self.tables)), self.block, kv_heads, self.D, generator=g).half()
            for _ in range(2))
        self.q = [torch.randn(n, kv_heads, self.D, generator=g) for n in contexts]

    def slot(self, s: int, p: int) -> int:
        return self.tables[s][p // self.block] * self.block + p % self.block

    def attend(self, chunks: list[tuple[int, int, int]]) -> tuple[torch.Tensor, ...]:
        """(seq, context length after the step, query length) per sequence -> each one's output rows."""
        kvh, D = self.kv_heads, self.D
        slots = [self.slot(s, p) for s, n, ql in chunks for p in range(n - ql, n)]
        width = max(len(self.tables[s]) for s, _, _ in chunks)
        qls = [ql for _, _, ql in chunks]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), seq_lens=torch.tensor([n for _, n, _ in chunks], dtype=torch.int32),
            query_start_loc=torch.tensor([0] + qls, dtype=torch.int32).cumsum(0, dtype=torch.int32),
            block_tables=torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s, _, _ in chunks],
                                      dtype=torch.int32),
            max_query_len=max(qls), max_seq_len=max(n for _, n, _ in chunks), query_lens_cpu=qls,
            seq_lens_cpu=[n for _, n, _ in chunks], block_size=self.block)
        qs = torch.cat([self.q[s][n - ql: n] for s, n, ql in chunks])
        k, v = (c.view(-1, kvh, D)[slots].float() for c in (self.k_cache, self.v_cache))
        out = CpuAttentionBackend().forward(qs, k, v, self.k_cache, self.v_cache, meta, D ** -0.5)
        return out.split(qls)

    def reference(self, s: int, n: int) -> torch.Tensor:
        """Float64 attention of sequence s's token n - 1 over its n keys."""
        rows = [self.slot(s, p) for p in range(n)]
        k, v = (c.view(-1, self.kv_heads, self.D)[rows].double() for c in (self.k_cache, self.v_cache))
        probs = (torch.einsum("hd,khd->hk", self.q[s][n - 1].double(), k) * self.D ** -0.5).softmax(-1)
        return torch.einsum("hk,khd->hd", probs, v).float()


@native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("variant", cpu_native.supported_variants())
def test_native_long_decode_rows_of_many_kv_heads(threads, variant, monkeypatch):
    """Eight KV heads of 64 (no grouping), decode rows of 18 and 11 chunks: where every block of
    a step is one decode token, a thread on the AVX-512 loops runs the span it claims chunk by
    chunk (every head's chunk, then the next chunk) instead of head by head. Against float64,
    and the same bits as the row beside a prefill chunk (which runs head by head) and alone."""
    monkeypatch.setattr(cpu_native, "_lib", cpu_native.load(variant))
    monkeypatch.setattr(cpu_native, "_tried", True)
    heads = ManyHeads([1100, 700], kv_heads=8, seed=11)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        decode = heads.attend([(0, 1100, 1), (1, 700, 1)])
        for s, n in enumerate([1100, 700]):
            torch.testing.assert_close(decode[s][0], heads.reference(s, n), atol=1e-5, rtol=1e-5)
        assert torch.equal(heads.attend([(0, 1100, 1)])[0], decode[0])
        beside_prefill = heads.attend([(1, 700, 9), (0, 1100, 1)])
        assert torch.equal(beside_prefill[1], decode[0]) and torch.equal(beside_prefill[0][-1], decode[1][0])
    finally:
        torch.set_num_threads(old_threads)


@native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("variant", cpu_native.supported_variants())
@pytest.mark.parametrize("kv_heads", [8, 12])
def test_native_short_decode_rows_claim_parts_of_a_spans_heads(threads, variant, kv_heads, monkeypatch):
    """A lone decode row of one or two spans (65-512 keys) of many KV heads: too few spans for a
    thread to claim every head of one, so threads claim runs of a span's heads (the rows' parts
    of those heads are one run of memory). Against float64; the same bits alone, in a batch with
    spans enough for whole claims, and beside a prefill chunk (one head a claim)."""
    monkeypatch.setattr(cpu_native, "_lib", cpu_native.load(variant))
    monkeypatch.setattr(cpu_native, "_tried", True)
    contexts = [200, 400, 90, 1100, 700]
    heads = ManyHeads(contexts, kv_heads=kv_heads, seed=5)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = heads.attend([(s, n, 1) for s, n in enumerate(contexts)])
        for s, n in enumerate(contexts[:3]):
            alone = heads.attend([(s, n, 1)])[0]
            torch.testing.assert_close(alone[0], heads.reference(s, n), atol=1e-5, rtol=1e-5)
            assert torch.equal(alone, batch[s])
            beside_prefill = heads.attend([(3, 1100, 7), (s, n, 1)])
            assert torch.equal(beside_prefill[1], alone)
    finally:
        torch.set_num_threads(old_threads)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_native_backend_writes_new_kv_and_skips_padding(dtype):
    """tl_kv_write puts each token's K/V at its slot (rounded to nearest in a float16 cache)
    and leaves slot -1 (padding) unwritten."""
    kv = PagedKV([20], backend=CpuAttentionBackend, dtype=dtype)
    q, k, v, meta = kv.batch([(0, 20, 4)])
    k_new, v_new = torch.randn_like(k), torch.randn_like(v)
    meta.slot_mapping = meta.slot_mapping.clone()
    meta.slot_mapping[1] = -1
    k_before = kv.k_cache.clone()
    CpuAttentionBackend().forward(q, k_new, v_new, kv.k_cache, kv.v_cache, meta, SCALE)
    flat_k, flat_v = kv.k_cache.view(-1, KV_HEADS, HEAD_DIM), kv.v_cache.view(-1, KV_HEADS, HEAD_DIM)
    for i, slot in enumerate(meta.slot_mapping.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], k_new[i].to(dtype)) and torch.equal(flat_v[slot], v_new[i].to(dtype))
    skipped = kv.tables[0][17 // BLOCK] * BLOCK + 17 % BLOCK  # position 17 is the chunk's second token
    assert torch.equal(flat_k[skipped], k_before.view(-1, KV_HEADS, HEAD_DIM)[skipped])


@native
@pytest.mark.parametrize("variant", cpu_native.supported_variants())
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
def test_native_caches_on_every_build(variant, dtype, monkeypatch):
    """Each instruction set's build (an AVX-512 machine runs the AVX2 one too: transposed float32
    tiles of the keys instead of 16-lane sums) against float64 over the values the cache holds:
    decode rows and a prefill chunk over a cached prefix."""
    monkeypatch.setattr(cpu_native, "_lib", cpu_native.load(variant))
    monkeypatch.setattr(cpu_native, "_tried", True)
    kv = PagedKV(CONTEXTS, seed=5, backend=CpuAttentionBackend, dtype=dtype)
    chunks = [(0, 37, 1), (3, 130, 1), (4, 48, 20), (6, 100, 1)]
    for (seq, ctx, q_len), out in zip(chunks, kv.attend(chunks)):
        torch.testing.assert_close(out, kv.reference(seq, ctx, q_len), atol=1e-5, rtol=1e-5)


@native
def test_native_int8_cache_rows_are_rounded_codes_and_a_scale():
    """tl_kv_write into an int8 cache: each block of 32 of a (token, KV head) row becomes
    round-to-nearest-even of x * (127 / max|x|), and the row's codes are followed by the blocks'
    max|x| / 127 as float32 bytes (computed here in torch); a block of zeros gets scale 0; slot
    -1 stays unwritten."""
    kv = PagedKV([20], backend=CpuAttentionBackend, dtype=torch.int8)
    q, k, v, meta = kv.batch([(0, 20, 5)])
    k_new, v_new = torch.randn_like(k) * 3, torch.randn_like(v)
    k_new[2, 1, :32] = 0.0  # a block of zeros
    v_new[3, 0, 5] = 50.0  # an outlier sets its row's scale
    meta.slot_mapping = meta.slot_mapping.clone()
    meta.slot_mapping[1] = -1
    k_before = kv.k_cache.clone()
    CpuAttentionBackend().forward(q, k_new, v_new, kv.k_cache, kv.v_cache, meta, SCALE)
    width = HEAD_DIM + HEAD_DIM // 32 * 4
    for new, cache in ((k_new, kv.k_cache), (v_new, kv.v_cache)):
        blocks = new.unflatten(-1, (HEAD_DIM // 32, 32))
        amax = blocks.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        codes = torch.round(blocks * inv).to(torch.int8).flatten(-2)
        scales = (amax / 127.0).float().squeeze(-1)
        flat = cache.view(-1, KV_HEADS, width)
        for i, slot in enumerate(meta.slot_mapping.tolist()):
            if slot < 0:
                continue
            assert torch.equal(flat[slot, :, :HEAD_DIM], codes[i])
            assert torch.equal(flat[slot, :, HEAD_DIM:].contiguous().view(torch.float32), scales[i])
    zero_row = kv.k_cache.view(-1, KV_HEADS, width)[meta.slot_mapping[2], 1]
    assert zero_row[:32].abs().sum() == 0 and zero_row[HEAD_DIM:HEAD_DIM + 4].abs().sum() == 0
    skipped = kv.tables[0][16 // BLOCK] * BLOCK + 16 % BLOCK  # position 16 is the chunk's second token
    assert torch.equal(kv.k_cache.view(-1, KV_HEADS, width)[skipped], k_before.view(-1, KV_HEADS, width)[skipped])
    # and the values read back are within half a code of what was written
    back = cache_values(kv.v_cache.view(-1, KV_HEADS, width)[meta.slot_mapping[0]], HEAD_DIM)
    step = v_new[0].unflatten(-1, (HEAD_DIM // 32, 32)).abs().amax(-1, keepdim=True) / 127
    assert ((back - v_new[0]).unflatten(-1, (HEAD_DIM // 32, 32)).abs() <= step / 2 * (1 + 1e-5)).all()


@native
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 8, 64), (8, 2, 128), (12, 2, 64), (16, 2, 64), (10, 2, 64),
                                                     (6, 2, 256), (4, 2, 40), (2, 1, 272)],
                         ids=["mha", "gqa4-d128", "gqa6", "gqa8", "gqa5", "gqa3-d256", "d40", "d272"])
def test_native_shapes_match_float64_attention(heads, kv_heads, head_dim, dtype):
    """Other group sizes and head sizes than SmolLM2's: head dims that are and are not a
    multiple of 16 (the AVX-512 kernel's vectors), groups that take one to four heads per pass
    over V and whose q . k runs in sets of one to four heads, a head dim past 256, decode rows and a prefill chunk over a cached prefix."""
    if dtype == torch.int8 and head_dim % 32:
        pytest.skip("an int8 cache needs head_dim % 32 == 0 (refused by resolve_kv_cache_dtype)")
    g = torch.Generator().manual_seed(7)
    block, num_blocks = 16, 40
    shape = (num_blocks, block, kv_heads, head_dim)
    k_cache, v_cache = (random_cache(shape, dtype, g) for _ in range(2))
    contexts, q_lens = [70, 5, 130], [1, 5, 9]
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block))] for n in contexts]
    slots = [tables[s][p // block] * block + p % block for s, n in enumerate(contexts) for p in range(n - q_lens[s], n)]
    flat = lambda c: cache_values(c.view(-1, kv_heads, c.shape[-1]), head_dim)  # noqa: E731
    k, v = flat(k_cache)[slots].float(), flat(v_cache)[slots].float()
    q = torch.randn(len(slots), heads, head_dim, generator=g)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0, 1, 6, 15], dtype=torch.int32),
        seq_lens=torch.tensor(contexts, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(contexts), query_lens_cpu=q_lens, seq_lens_cpu=contexts,
        block_size=block)
    scale = head_dim ** -0.5
    out = CpuAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, scale).split(q_lens)
    for s, (n, q_len) in enumerate(zip(contexts, q_lens)):
        rows = [tables[s][p // block] * block + p % block for p in range(n)]
        ks, vs = (flat(c)[rows].double().repeat_interleave(heads // kv_heads, dim=1) for c in (k_cache, v_cache))
        qs = q[sum(q_lens[:s]): sum(q_lens[:s + 1])].double()
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        causal = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
        ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), vs).float()
        torch.testing.assert_close(out[s], ref, atol=2e-5, rtol=1e-5)
