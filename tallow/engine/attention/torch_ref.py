"""Paged attention in plain torch: the reference backend, on any device.

Everything derived from the batch layout (which cache slots to write, the trimmed block
tables, the masks) is computed once per step and reused by every layer: the backend keeps
a plan for the last AttentionMetadata object it saw, so a step's metadata must not be
mutated in place once the forward pass has started.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tallow.engine.attention.metadata import AttentionMetadata


@dataclass
class _SeqPlan:
    start: int  # first query row in the flat batch
    end: int
    context_len: int  # cached prefix + new tokens
    block_table: torch.Tensor | None  # [num_blocks]; None: no cached prefix, attend the new tokens only
    mask: torch.Tensor | None  # [query_len, context_len] bool; None: plain causal


@dataclass
class _StepPlan:
    meta: AttentionMetadata
    slots: torch.Tensor  # cache slots to write
    rows: torch.Tensor | None  # rows of k/v that go to `slots`; None: all rows
    decode: bool  # one query token per sequence and no padding rows
    # decode-only batches: one gather over all sequences
    blocks: torch.Tensor | None = None  # [B * blocks covering max_seq_len], row-major
    context_len: int = 0  # B == 1: the context
    # mixed batches: one SDPA call per sequence
    seqs: list[_SeqPlan] | None = None


def _make_plan(meta: AttentionMetadata, num_tokens: int) -> _StepPlan:
    valid = meta.slot_mapping >= 0  # one host sync per step, not per layer
    if bool(valid.all()):
        slots, rows = meta.slot_mapping, None
    else:
        rows = valid.nonzero().squeeze(1)
        slots = meta.slot_mapping[rows]
    bs = meta.block_size
    if meta.is_decode_only and num_tokens == meta.num_seqs:
        num_blocks = -(-meta.max_seq_len // bs)
        blocks = meta.block_tables[:, :num_blocks].flatten()
        plan = _StepPlan(meta, slots, rows, decode=True, blocks=blocks)
        plan.context_len = meta.seq_lens_cpu[0]
        return plan
    seqs = []
    start = 0
    for b, (q_len, ctx) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        table = mask = None
        if ctx > q_len:
            table = meta.block_tables[b, : -(-ctx // bs)]
            dev = table.device
            mask = (torch.arange(ctx, device=dev)[None, :]
                    <= torch.arange(ctx - q_len, ctx, device=dev)[:, None])
        seqs.append(_SeqPlan(start, start + q_len, ctx, table, mask))
        start += q_len
    return _StepPlan(meta, slots, rows, decode=False, seqs=seqs)


def _attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token of one sequence: q [H, D] over its context k, v [ctx, kv_heads, D].

    The query heads sharing a KV head become that head's query rows, so GQA needs no repeat
    of K/V. Every decode row, in any batch, goes through this one call.
    """
    H, D = q.shape
    kv_heads = k.shape[1]
    out = F.scaled_dot_product_attention(q.view(kv_heads, H // kv_heads, D), k.transpose(0, 1),
                                         v.transpose(0, 1), scale=scale)
    return out.reshape(H, D)


class TorchAttentionBackend:
    """Paged attention with torch ops: one gather per decode step, one SDPA call per sequence."""

    def __init__(self) -> None:
        self._plan: _StepPlan | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = self._plan
        if plan is None or plan.meta is not meta:
            plan = self._plan = _make_plan(meta, q.shape[0])
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_new, v_new = (k, v) if plan.rows is None else (k[plan.rows], v[plan.rows])
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slots, k_new)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slots, v_new)
        if plan.decode:
            return self._decode(q, k_cache, v_cache, plan, scale)
        return self._mixed(q, k, v, k_cache, v_cache, plan, scale)

    @staticmethod
    def _decode(q, k_cache, v_cache, plan: _StepPlan, scale: float) -> torch.Tensor:
        # One gather for the whole batch, then each sequence attends over exactly its own
        # context with the same call a lone sequence makes: a row's result never depends on
        # what it is batched with (a padded, masked batch call would change the summation
        # order and so the low bits, which greedy decoding can amplify).
        B, H, D = q.shape
        kv_heads = k_cache.shape[2]
        k = k_cache.index_select(0, plan.blocks).view(B, -1, kv_heads, D)
        v = v_cache.index_select(0, plan.blocks).view(B, -1, kv_heads, D)
        if B == 1:
            return _attend_decode(q[0], k[0, : plan.context_len], v[0, : plan.context_len], scale).view(1, H, D)
        out = torch.empty_like(q)
        for b, ctx in enumerate(plan.meta.seq_lens_cpu):
            out[b] = _attend_decode(q[b], k[b, :ctx], v[b, :ctx], scale)
        return out

    @staticmethod
    def _mixed(q, k, v, k_cache, v_cache, plan: _StepPlan, scale: float) -> torch.Tensor:
        out = torch.zeros_like(q)
        kv_heads, D = k_cache.shape[2], k_cache.shape[3]
        for s in plan.seqs:
            if s.end - s.start == 1 and s.block_table is not None:  # a decode row in a mixed batch
                ks = k_cache.index_select(0, s.block_table).view(-1, kv_heads, D)[: s.context_len]
                vs = v_cache.index_select(0, s.block_table).view(-1, kv_heads, D)[: s.context_len]
                out[s.start] = _attend_decode(q[s.start], ks, vs, scale)
                continue
            if s.block_table is None:  # the whole context is in this batch
                ks, vs = k[s.start:s.end], v[s.start:s.end]
            else:
                ks = k_cache.index_select(0, s.block_table).view(-1, kv_heads, D)[: s.context_len]
                vs = v_cache.index_select(0, s.block_table).view(-1, kv_heads, D)[: s.context_len]
            out[s.start:s.end] = F.scaled_dot_product_attention(
                q[s.start:s.end].transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                attn_mask=s.mask, is_causal=s.mask is None, scale=scale, enable_gqa=True,
            ).transpose(0, 1)
        return out
