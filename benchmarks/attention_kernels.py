"""Triton attention kernels (and tallow.ops) on CUDA against the torch reference backend and
torch SDPA on a contiguous cache. Llama-3-8B shapes: 32 heads, 8 KV heads, head_dim 128,
block 16, bfloat16. Needs a CUDA GPU and triton; no model weights.

    python benchmarks/attention_kernels.py --out results/attention_kernels.json
    python benchmarks/attention_kernels.py --quick      # a few shapes only

Decode rows: effective bandwidth = bytes of K/V read (B * ctx * 8 * 128 * 2 * 2) / time,
and its share of --peak-gbps. "triton" times the backend's forward (KV write + attention)
launched eagerly, "graph" the same forward replayed from a CUDA graph (how the engine
runs decode), "1 split" the decode kernel without split-K. "err" is the largest absolute
difference between Triton's and SDPA's outputs.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def timer(rep_ms: int):
    import triton.testing

    def us(fn, graph: bool = False) -> float:
        if graph:
            return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3
        return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e3

    return us


def paged_batch(query_lens, seq_lens, dtype, device):
    """Random q/k/v, a KV cache with shuffled blocks, and the metadata of one flat batch."""
    import torch

    from tallow.attention.metadata import AttentionMetadata

    blocks = [-(-n // BLOCK) for n in seq_lens]
    perm = torch.randperm(sum(blocks), device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    slots, used = [], 0
    for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        tables[b, : blocks[b]] = perm[used: used + blocks[b]]
        used += blocks[b]
        pos = torch.arange(s_len - q_len, s_len, device=device)
        slots.append(tables[b, pos // BLOCK].long() * BLOCK + pos % BLOCK)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, dtype=dtype, device=device)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v = torch.randn_like(k)
    k_cache = torch.randn(used, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    qsl = torch.tensor([0] + list(query_lens), device=device).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables=tables,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens), block_size=BLOCK)
    return q, k, v, k_cache, v_cache, meta


def contiguous_kv(k_cache, v_cache, meta, seq):
    """One sequence's context as [1, kv_heads, ctx, head_dim] tensors."""
    ctx = meta.seq_lens_cpu[seq]
    table = meta.block_tables[seq, : -(-ctx // BLOCK)].long()
    return tuple(c[table].reshape(-1, KV_HEADS, HEAD_DIM)[:ctx].transpose(0, 1).unsqueeze(0).contiguous()
                 for c in (k_cache, v_cache))


def bench_decode(batch, ctx, us, peak_gbps, device):
    import torch
    import torch.nn.functional as F

    from tallow.attention.torch_ref import TorchAttentionBackend
    from tallow.attention.triton_backend import TritonAttentionBackend
    from tallow.attention.triton_decode import decode_attention

    q, k, v, k_cache, v_cache, meta = paged_batch([1] * batch, [ctx] * batch, torch.bfloat16, device)
    scale = HEAD_DIM ** -0.5
    backend = TritonAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, max_num_seqs=256, device=device)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    # SDPA over a contiguous copy; the query heads of one KV head become its query rows.
    kc, vc = (c[meta.block_tables.long()].view(batch, -1, KV_HEADS, HEAD_DIM)[:, :ctx].transpose(1, 2).contiguous()
              for c in (k_cache, v_cache))
    qg = q.view(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)

    def sdpa():
        return F.scaled_dot_product_attention(qg, kc, vc, scale=scale)

    err = (out.float() - sdpa().reshape(batch, HEADS, HEAD_DIM).float()).abs().max().item()
    one = torch.empty_like(q)
    reference = TorchAttentionBackend()
    row = {"batch": batch, "ctx": ctx, "splits": backend.decode_splits(batch)}
    row["triton_us"] = us(lambda: backend.forward(q, k, v, k_cache, v_cache, meta, scale))
    row["graph_us"] = us(lambda: backend.forward(q, k, v, k_cache, v_cache, meta, scale), graph=True)
    row["1split_us"] = us(lambda: decode_attention(q, k_cache, v_cache, one, meta.query_start_loc, meta.seq_lens,
                                                   meta.block_tables, scale, 1))
    row["torch_ref_us"] = us(lambda: reference.forward(q, k, v, k_cache, v_cache, meta, scale))
    row["sdpa_us"] = us(sdpa)
    kv_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * 2
    row["kv_MB"] = kv_bytes / 1e6
    row["graph_GBps"] = kv_bytes / row["graph_us"] / 1e3
    row["pct_peak"] = 100 * row["graph_GBps"] / peak_gbps
    row["sdpa_GBps"] = kv_bytes / row["sdpa_us"] / 1e3
    row["err"] = err
    return row


def bench_prefill(prefix, new, us, device):
    import torch
    import torch.nn.functional as F

    from tallow.attention.torch_ref import TorchAttentionBackend
    from tallow.attention.triton_backend import TritonAttentionBackend

    ctx = prefix + new
    q, k, v, k_cache, v_cache, meta = paged_batch([new], [ctx], torch.bfloat16, device)
    scale = HEAD_DIM ** -0.5
    backend = TritonAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, max_num_seqs=256, device=device)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    kc, vc = contiguous_kv(k_cache, v_cache, meta, 0)
    qh = q.transpose(0, 1).unsqueeze(0)
    mask = None
    if prefix:  # bottom-right aligned causal mask; is_causal would align it top-left
        mask = torch.arange(ctx, device=device)[None, :] <= torch.arange(prefix, ctx, device=device)[:, None]

    def sdpa():
        return F.scaled_dot_product_attention(qh, kc, vc, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=True)

    err = (out.float() - sdpa()[0].transpose(0, 1).float()).abs().max().item()
    reference = TorchAttentionBackend()
    row = {"prefix": prefix, "new": new}
    row["triton_us"] = us(lambda: backend.forward(q, k, v, k_cache, v_cache, meta, scale))
    row["torch_ref_us"] = us(lambda: reference.forward(q, k, v, k_cache, v_cache, meta, scale))
    row["sdpa_us"] = us(sdpa)
    flops = 4 * HEADS * HEAD_DIM * sum(prefix + i + 1 for i in range(new))
    row["triton_TFLOPs"] = flops / row["triton_us"] / 1e6
    row["sdpa_TFLOPs"] = flops / row["sdpa_us"] / 1e6
    row["triton_GBps"] = ctx * KV_HEADS * HEAD_DIM * 2 * 2 / row["triton_us"] / 1e3
    row["err"] = err
    return row


def bench_kv_write(num_tokens, us, device):
    import torch

    from tallow.attention.triton_kv_write import write_kv_cache

    _, k, v, k_cache, v_cache, meta = paged_batch([num_tokens], [num_tokens], torch.bfloat16, device)
    slots = meta.slot_mapping

    def index_copy():
        k_cache.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, k)
        v_cache.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, v)

    moved = 2 * 2 * num_tokens * KV_HEADS * HEAD_DIM * 2  # read + write, K and V
    row = {"op": "kv_write", "tokens": num_tokens}
    row["triton_us"] = us(lambda: write_kv_cache(k, v, k_cache, v_cache, slots))
    row["torch_us"] = us(index_copy)
    row["triton_GBps"] = moved / row["triton_us"] / 1e3
    return row


def bench_ops(num_tokens, us, device):
    import torch

    from tallow.ops.norm import torch_add_rms_norm
    from tallow.ops.rotary import torch_apply_rotary
    from tallow.ops.triton_norm import triton_rms_norm
    from tallow.ops.triton_rotary import triton_apply_rotary

    hidden = 4096
    x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device=device)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, dtype=torch.bfloat16, device=device)
    qkv = torch.randn(num_tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    q, k = qkv[:, :HEADS], qkv[:, HEADS: HEADS + KV_HEADS]
    positions = torch.randint(0, 8192, (num_tokens,), device=device)
    cache = torch.randn(8192, HEAD_DIM, device=device)
    norm = {"op": "add_rms_norm", "tokens": num_tokens,
            "triton_us": us(lambda: triton_rms_norm(x, residual, weight, 1e-5)),
            "torch_us": us(lambda: torch_add_rms_norm(x, residual, weight, 1e-5))}
    rope = {"op": "rotary", "tokens": num_tokens,
            "triton_us": us(lambda: triton_apply_rotary(q, k, positions, cache)),
            "torch_us": us(lambda: torch_apply_rotary(q, k, positions, cache))}
    return [norm, rope]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--peak-gbps", type=float, default=4150.0, help="HBM bandwidth to compare against")
    ap.add_argument("--rep-ms", type=int, default=100, help="measuring time per timing")
    ap.add_argument("--quick", action="store_true", help="batch 1/32 x ctx 2048 and prefill 2048 only")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("attention_kernels.py needs a CUDA GPU")
    device = torch.device("cuda")
    torch.manual_seed(0)
    us = timer(args.rep_ms)
    batches, contexts = ((1, 32), (2048,)) if args.quick else ((1, 32, 256), (512, 2048, 8192))
    prefills = ((0, 2048),) if args.quick else ((0, 2048), (6144, 2048))

    decode = []
    for batch in batches:
        for ctx in contexts:
            decode.append(bench_decode(batch, ctx, us, args.peak_gbps, device))
            print(f"decode batch {batch} ctx {ctx}: {decode[-1]['graph_us']:.1f} us", file=sys.stderr)
            torch.cuda.empty_cache()
    prefill = [bench_prefill(prefix, new, us, device) for prefix, new in prefills]
    ops = [bench_kv_write(n, us, device) for n in (256, 2048)]
    ops += [r for n in (32, 2048) for r in bench_ops(n, us, device)]

    print(f"\nDecode attention, Llama-3-8B shapes, bf16 ({torch.cuda.get_device_name(0)}; "
          f"% of {args.peak_gbps:.0f} GB/s; times in us)")
    print(table(decode, ["batch", "ctx", "splits", "kv_MB", "triton_us", "graph_us", "graph_GBps", "pct_peak",
                         "1split_us", "torch_ref_us", "sdpa_us", "sdpa_GBps", "err"]))
    print("\nPrefill attention (one sequence; times in us)")
    print(table(prefill, ["prefix", "new", "triton_us", "triton_TFLOPs", "triton_GBps", "torch_ref_us", "sdpa_us",
                          "sdpa_TFLOPs", "err"]))
    print("\nKV write and fused ops (times in us)")
    print(table(ops, ["op", "tokens", "triton_us", "torch_us", "triton_GBps"]))
    write_json(args.out, {"benchmark": "attention_kernels", "peak_gbps": args.peak_gbps,
                          "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
                          "decode": decode, "prefill": prefill, "ops": ops})


if __name__ == "__main__":
    main()
