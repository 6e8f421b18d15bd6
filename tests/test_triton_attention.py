"""Triton paged attention against a plain torch reference.

Runs on CUDA (marked gpu) at model-like shapes in bf16/fp16/fp32, and a tiny fp32 subset runs
under Triton's interpreter on the CPU, in the triton_interp tier (tests/conftest.py sets
TRITON_INTERPRET=1 where triton is installed and CUDA is not; the interpreter cannot check
bf16, whose tl.dot it computes on the raw bits):

    pytest -m triton_interp tests/test_triton_attention.py     (or make test-triton)
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from tallow.attention.metadata import AttentionMetadata  # noqa: E402
from tallow.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tallow.attention.triton_decode import num_decode_splits  # noqa: E402
from triton_test_devices import CUDA, INTERPRETER  # noqa: E402
# Splits left empty take log2(0) = -inf on purpose; the interpreter's numpy warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def make_batch(device, dtype, query_lens, seq_lens, *, num_heads, num_kv_heads, head_dim,
               block_size, num_padding=0, seed=0):
    """Random q/k/v for a flat batch, a KV cache whose blocks are shuffled and already hold
    each sequence's prefix, and the metadata. Padding sequences (decode rows with seq_len 0
    and slot -1) go at the end."""
    g = torch.Generator().manual_seed(seed)
    query_lens = list(query_lens) + [1] * num_padding
    seq_lens = list(seq_lens) + [0] * num_padding
    num_tokens = sum(query_lens)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=g)
    width = max(max(blocks_per_seq), 1)
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    slots, used = [], 0
    for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        block_tables[b, : blocks_per_seq[b]] = order[used: used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        for pos in range(s_len - q_len, s_len):
            slots.append(-1 if s_len == 0 else
                         int(block_tables[b, pos // block_size]) * block_size + pos % block_size)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q = randn(num_tokens, num_heads, head_dim)
    k = randn(num_tokens, num_kv_heads, head_dim)
    v = randn(num_tokens, num_kv_heads, head_dim)
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    query_start_loc = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, block_size=block_size,
    )
    return q, k, v, k_cache, v_cache, meta


def reference(q, k, v, k_cache, v_cache, meta, scale):
    """Write k/v at their slots, then per sequence gather its context through the block
    table and run causal softmax attention in float32. Returns (out, k_cache, v_cache)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = meta.slot_mapping >= 0
    k_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping[keep]] = k[keep]
    v_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping[keep]] = v[keep]
    out = torch.zeros_like(q, dtype=torch.float32)
    group = q.shape[1] // num_kv_heads
    starts = meta.query_start_loc.tolist()
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if seq_len == 0:
            continue
        blocks = meta.block_tables[b, : math.ceil(seq_len / meta.block_size)].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        queries = q[starts[b]: starts[b] + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        positions = torch.arange(seq_len - q_len, seq_len, device=q.device)
        hidden = torch.arange(seq_len, device=q.device)[None, :] > positions[:, None]
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        out[starts[b]: starts[b] + q_len] = torch.einsum("hqk,khd->qhd", probs, values)
    return out, k_cache, v_cache


def check(device, dtype, query_lens, seq_lens, *, num_heads, num_kv_heads, head_dim,
          block_size, num_padding=0, num_sms=None, max_decode_splits=32, expect_splits=None):
    q, k, v, k_cache, v_cache, meta = make_batch(
        device, dtype, query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, num_padding=num_padding)
    scale = head_dim ** -0.5
    want, want_k_cache, want_v_cache = reference(q, k, v, k_cache, v_cache, meta, scale)
    backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, max_num_seqs=64,
                                     device=device, num_sms=num_sms,
                                     max_decode_splits=max_decode_splits)
    if expect_splits is not None:
        assert backend.decode_splits(len(meta.seq_lens_cpu)) == expect_splits
    got = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    # The cache write is a copy: exact, and nothing else (padding slots included) changes.
    assert torch.equal(k_cache, want_k_cache) and torch.equal(v_cache, want_v_cache)
    real = sum(meta.query_lens_cpu) - num_padding
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got[:real].float(), want[:real], atol=tol, rtol=tol)


# ---- the interpreter subset (tiny shapes; also run on CUDA) ------------------------------

SMALL = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
ODD = dict(num_heads=6, num_kv_heads=2, head_dim=24, block_size=4)  # group 3, head_dim 24


@pytest.mark.parametrize("device", [INTERPRETER, CUDA])
@pytest.mark.parametrize("shape", [SMALL, ODD], ids=["gqa2", "gqa3-d24"])
def test_decode_one_split(device, shape):
    # Contexts of 1, a whole block, one past a block, several tiles; plus a padding row.
    check(device, torch.float32, [1] * 5, [1, 4, 5, 17, 40], num_padding=1, num_sms=1,
          expect_splits=1, **shape)


@pytest.mark.parametrize("device", [INTERPRETER, CUDA])
def test_decode_split_k(device):
    # Many splits per sequence: long contexts are cut, short ones leave splits empty.
    check(device, torch.float32, [1] * 4, [1, 16, 70, 100], num_padding=1, num_sms=64,
          max_decode_splits=4, expect_splits=4, **SMALL)


@pytest.mark.parametrize("device", [INTERPRETER, CUDA])
def test_prefill_without_prefix(device):
    check(device, torch.float32, [37], [37], **SMALL)


@pytest.mark.parametrize("device", [INTERPRETER, CUDA])
@pytest.mark.parametrize("shape", [SMALL, ODD], ids=["gqa2", "gqa3-d24"])
def test_prefill_with_cached_prefix(device, shape):
    # A chunk of 20 new tokens after 30 cached ones (the prefix ends mid-block).
    check(device, torch.float32, [20], [50], **shape)


@pytest.mark.parametrize("device", [INTERPRETER, CUDA])
def test_mixed_batch(device):
    # Decode rows, a prefill chunk over a cached prefix, a fresh prompt, and padding.
    check(device, torch.float32, [1, 13, 1, 7], [9, 30, 1, 7], num_padding=2, **SMALL)


@pytest.mark.parametrize("device", [INTERPRETER, CUDA])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(2, 16), (3, 24)], ids=["kv2-d16", "kv3-d24"])
def test_kv_write_copies_each_row_to_its_slot(device, cache_dtype, heads):
    """write_kv_cache alone: k and v as strided views of a fused qkv output, float32 rows into
    a float32 or float16 cache (rounded as torch rounds), the padding slot -1 skipped and
    every other cache row left as it was."""
    from tallow.attention.triton_kv_write import write_kv_cache

    num_kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 4 + 2 * num_kv_heads, head_dim, generator=g).to(device)
    k, v = qkv[:, 4: 4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]
    slots = torch.tensor([3, 17, -1, 40, 8, 0])  # blocks of 4: different blocks and offsets
    k_cache = torch.randn(12, 4, num_kv_heads, head_dim, generator=g).to(device, cache_dtype)
    v_cache = torch.randn(12, 4, num_kv_heads, head_dim, generator=g).to(device, cache_dtype)
    want_k = k_cache.clone().view(-1, num_kv_heads, head_dim)
    want_v = v_cache.clone().view(-1, num_kv_heads, head_dim)
    real = slots >= 0
    want_k[slots[real]] = k[real.to(device)].to(cache_dtype)
    want_v[slots[real]] = v[real.to(device)].to(cache_dtype)
    write_kv_cache(k, v, k_cache, v_cache, slots.to(device))
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim), want_k)
    assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim), want_v)


def test_decode_splits_follow_batch_size():
    sms, kv_heads, cap = 132, 8, 32
    splits = [num_decode_splits(b, kv_heads, sms, cap) for b in (1, 2, 4, 8, 16, 32, 64, 256)]
    assert splits == sorted(splits, reverse=True) and splits[0] == cap and splits[-1] == 1
    for b, s in zip((1, 2, 4, 8, 16, 32, 64, 256), splits):
        assert s & (s - 1) == 0  # a power of two
        assert s == cap or b * kv_heads * s >= 2 * sms  # enough programs unless capped


# ---- CUDA only: model shapes, low precision, CUDA graphs --------------------------------

LLAMA = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
SMOLLM = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
MHA = dict(num_heads=8, num_kv_heads=8, head_dim=80, block_size=16)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [LLAMA, SMOLLM, MHA], ids=["llama", "smollm", "mha-d80"])
def test_decode_model_shapes(device, dtype, shape):
    lens = [1, 15, 16, 17, 513, 3000, 8192]
    check(device, dtype, [1] * len(lens), lens, num_padding=3, **shape)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [LLAMA, SMOLLM], ids=["llama", "smollm"])
def test_prefill_and_mixed_model_shapes(device, dtype, shape):
    check(device, dtype, [300], [1000], **shape)
    check(device, dtype, [513], [513], **shape)
    check(device, dtype, [1, 250, 1, 1, 129], [2000, 700, 1, 40, 129], num_padding=4, **shape)


@pytest.mark.parametrize("device", [CUDA])
def test_decode_replays_in_cuda_graph(device):
    """Capture a padded decode batch once, then replay with new lengths, slots and tables
    written into the same tensors: the result must match the reference for the new batch."""
    shape, dtype, num_seqs = LLAMA, torch.bfloat16, 5
    batches = [make_batch(device, dtype, [1] * num_seqs, lens, num_padding=2, seed=seed, **shape)
               for seed, lens in ((1, [7, 100, 1, 2048, 33]), (2, [3000, 16, 17, 1, 640]))]
    q, k, v = (t.clone() for t in batches[0][:3])
    k_cache = torch.zeros(max(b[3].shape[0] for b in batches), *batches[0][3].shape[1:], dtype=dtype,
                          device=device)
    v_cache = torch.zeros_like(k_cache)
    first = batches[0][5]
    width = max(b[5].block_tables.shape[1] for b in batches)
    meta = AttentionMetadata(**{
        **vars(first), "slot_mapping": first.slot_mapping.clone(), "query_start_loc": first.query_start_loc.clone(),
        "seq_lens": first.seq_lens.clone(),
        "block_tables": torch.zeros(first.block_tables.shape[0], width, dtype=torch.int32, device=device)})
    scale = shape["head_dim"] ** -0.5
    backend = TritonAttentionBackend(shape["num_heads"], shape["num_kv_heads"], shape["head_dim"],
                                     max_num_seqs=8, device=device)
    assert backend.decode_splits(num_seqs + 2) > 1

    def load(batch):
        """Write a batch into the static tensors; return its metadata for the reference."""
        bq, bk, bv, bk_cache, bv_cache, bmeta = batch
        for static, new in ((q, bq), (k, bk), (v, bv)):
            static.copy_(new)
        k_cache.zero_()[: bk_cache.shape[0]].copy_(bk_cache)
        v_cache.zero_()[: bv_cache.shape[0]].copy_(bv_cache)
        meta.block_tables.zero_()[:, : bmeta.block_tables.shape[1]].copy_(bmeta.block_tables)
        for name in ("slot_mapping", "query_start_loc", "seq_lens"):
            getattr(meta, name).copy_(getattr(bmeta, name))
        return AttentionMetadata(**{**vars(bmeta), "block_tables": meta.block_tables.clone()})

    load(batches[0])
    backend.forward(q, k, v, k_cache, v_cache, meta, scale)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    for batch in (batches[1], batches[0]):
        batch_meta = load(batch)
        want, want_k_cache, _ = reference(q, k, v, k_cache, v_cache, batch_meta, scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache, want_k_cache)
        torch.testing.assert_close(out[:num_seqs].float(), want[:num_seqs], atol=2e-2, rtol=2e-2)
