"""Paged attention in plain torch: the reference backend, on any device.

Everything derived from the batch layout (which cache slots to write, the trimmed block
tables, the masks; a sliding window's masks once per window size) is computed once per step
and reused by every layer: the backend keeps
a plan for the last AttentionMetadata object it saw, so a step's metadata must not be
mutated in place once the forward pass has started.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tallow.attention.metadata import AttentionMetadata


@dataclass
class _SeqPlan:
    start: int  # first query row in the flat batch
    end: int
    context_len: int  # cached prefix + new tokens
    block_table: torch.Tensor | None  # [num_blocks]; None: no cached prefix, attend the new tokens only
    mask: torch.Tensor | None  # [query_len, context_len] bool; None: plain causal
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> mask

    def windowed(self, window: int, dev: torch.device) -> torch.Tensor:
        """The mask of a sliding-window layer: query position p sees keys p - window + 1 .. p."""
        mask = self.window_masks.get(window)
        if mask is None:
            q_len, ctx = self.end - self.start, self.context_len
            keys = torch.arange(ctx, device=dev)[None, :]
            pos = torch.arange(ctx - q_len, ctx, device=dev)[:, None]
            mask = self.window_masks[window] = (keys <= pos) & (keys > pos - window)
        return mask


@dataclass
class _DecodeGroup:
    """Decode rows whose contexts span the same number of blocks: one gather of K and of V,
    two batched matmuls."""

    rows: torch.Tensor | None  # their query rows in the flat batch; None: all rows, in order
    # [G * kv_heads * num_blocks * block_size]: the rows of cache.view(-1, head_dim) that hold
    # their contexts, head-major ([G, kv_heads, ctx] order), so one gather lays K or V out for
    # batched matmuls over (row, KV head).
    cache_rows: torch.Tensor
    first_block: int | None  # a lone row whose blocks are consecutive: K/V read in place from here
    mask: torch.Tensor  # [G, 1, 1, num_blocks * block_size] float: 0 within the context, -inf past it
    lens: torch.Tensor  # [G, 1] the rows' context lengths
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> mask

    def windowed(self, window: int) -> torch.Tensor:
        """mask with the keys before a sliding window's start at -inf as well."""
        mask = self.window_masks.get(window)
        if mask is None:
            pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            mask = self.mask.masked_fill((pos < self.lens - window)[:, None, None, :], float("-inf"))
            self.window_masks[window] = mask
        return mask


@dataclass
class _StepPlan:
    meta: AttentionMetadata
    slots: torch.Tensor  # cache slots to write
    rows: torch.Tensor | None  # rows of k/v that go to `slots`; None: all rows
    decode_groups: list[_DecodeGroup]  # rows with one query token and a cached prefix
    seqs: list[_SeqPlan]  # the other sequences (prefill chunks): one SDPA call each


def _decode_groups(meta: AttentionMetadata, rows: list[int], seqs: list[int], num_tokens: int,
                   kv_heads: int) -> list[_DecodeGroup]:
    """Group decode rows (query row rows[i] of sequence seqs[i]) by their number of blocks."""
    bs = meta.block_size
    by_blocks: dict[int, list[int]] = {}
    for i, b in enumerate(seqs):
        by_blocks.setdefault(-(-meta.seq_lens_cpu[b] // bs), []).append(i)
    groups = []
    dev = meta.block_tables.device
    for num_blocks, members in by_blocks.items():
        index = torch.tensor([seqs[i] for i in members], device=dev)
        blocks = meta.block_tables.index_select(0, index)[:, None, :num_blocks, None].long()
        offsets = torch.arange(bs, device=dev)[None, None, None, :]
        heads = torch.arange(kv_heads, device=dev)[None, :, None, None]
        cache_rows = ((blocks * bs + offsets) * kv_heads + heads).flatten()
        first = None
        if len(members) == 1:
            table = blocks.flatten()
            if bool((table == torch.arange(num_blocks, device=dev) + table[0]).all()):
                first = int(table[0])
        pos = torch.arange(num_blocks * bs, device=dev)
        lens = meta.seq_lens.index_select(0, index).unsqueeze(1)
        mask = torch.zeros(len(members), 1, 1, num_blocks * bs, device=dev)
        mask.masked_fill_((pos >= lens)[:, None, None, :], float("-inf"))
        group_rows = [rows[i] for i in members]
        whole = group_rows == list(range(num_tokens))
        groups.append(_DecodeGroup(None if whole else torch.tensor(group_rows, device=dev), cache_rows, first,
                                   mask, lens))
    return groups


def _make_plan(meta: AttentionMetadata, num_tokens: int, kv_heads: int) -> _StepPlan:
    valid = meta.slot_mapping >= 0  # one host sync per step, not per layer
    if bool(valid.all()):
        slots, rows = meta.slot_mapping, None
    else:
        rows = valid.nonzero().squeeze(1)
        slots = meta.slot_mapping[rows]
    bs = meta.block_size
    decode_rows, decode_seqs, seqs = [], [], []
    start = 0
    for b, (q_len, ctx) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q_len == 1 and ctx > 1:
            decode_rows.append(start)
            decode_seqs.append(b)
        else:
            table = mask = None
            if ctx > q_len:
                table = meta.block_tables[b, : -(-ctx // bs)]
                dev = table.device
                mask = (torch.arange(ctx, device=dev)[None, :]
                        <= torch.arange(ctx - q_len, ctx, device=dev)[:, None])
            seqs.append(_SeqPlan(start, start + q_len, ctx, table, mask))
        start += q_len
    groups = _decode_groups(meta, decode_rows, decode_seqs, num_tokens, kv_heads)
    return _StepPlan(meta, slots, rows, groups, seqs)


class TorchAttentionBackend:
    """Paged attention with torch ops: decode rows in a few batched calls, prefill chunks one by one.

    A decode row's result does not depend on what it is batched with: its context is padded
    to whole blocks and masked past its length, and it is batched only with rows of the same
    number of blocks, so every row goes through the same per-row arithmetic (batched matmuls
    and a softmax whose reductions run within a row) whatever its neighbours. A batch padded
    to its longest context would change a row's summation, and so its low bits, which greedy
    decoding can amplify.
    """

    supports_sliding_window = True

    def __init__(self) -> None:
        self._plan: _StepPlan | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        """sliding_window: each query attends to its last `sliding_window` positions only (the
        keys before are masked)."""
        plan = self._plan
        if plan is None or plan.meta is not meta:
            plan = self._plan = _make_plan(meta, q.shape[0], k_cache.shape[2])
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_new, v_new = (k, v) if plan.rows is None else (k[plan.rows], v[plan.rows])
        # The CPU's quantized linears return float32 whatever the model's dtype: the new K/V are
        # written in the cache's dtype, and read back in the queries' (see _as).
        k_new, v_new = k_new.to(k_cache.dtype), v_new.to(v_cache.dtype)
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slots, k_new)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slots, v_new)
        if not plan.seqs and len(plan.decode_groups) == 1 and plan.decode_groups[0].rows is None:
            return _attend_decode(q, k_cache, v_cache, plan.decode_groups[0], scale, sliding_window)
        out = torch.zeros_like(q)
        for group in plan.decode_groups:
            out.index_copy_(0, group.rows, _attend_decode(q.index_select(0, group.rows), k_cache, v_cache,
                                                         group, scale, sliding_window))
        for s in plan.seqs:
            out[s.start:s.end] = _attend_prefill(q[s.start:s.end], k[s.start:s.end], v[s.start:s.end],
                                                 k_cache, v_cache, s, scale, sliding_window)
        return out


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`: the cache's K/V where the queries are in another dtype (float32 queries
    from the CPU's quantized linears over a bfloat16 / float16 cache)."""
    return x if x.dtype == dtype else x.to(dtype)


def _attend_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _DecodeGroup,
                   scale: float, window: int | None = None) -> torch.Tensor:
    """q [G, H, D]: one query token per row, over the contexts of the group's G rows.

    The query heads sharing a KV head become that head's query rows, so GQA needs no repeat
    of K/V. Plain batched matmuls and a softmax, not SDPA: the CPU flash kernel's result for
    one row changes with the batch size when it runs on several threads. The gathered K/V
    are contiguous [G, kv_heads, ctx, D] for any G, so the matmuls see one layout (and one
    kernel) whatever the batch.
    """
    G, H, D = q.shape
    kv_heads = k_cache.shape[2]
    if group.first_block is None:
        k = k_cache.view(-1, D).index_select(0, group.cache_rows).view(G, kv_heads, -1, D)
        v = v_cache.view(-1, D).index_select(0, group.cache_rows).view(G, kv_heads, -1, D)
    else:  # strided views of the cache, the same values (and results) as the gather
        num_blocks = group.mask.shape[-1] // k_cache.shape[1]
        k, v = (c.narrow(0, group.first_block, num_blocks).view(1, -1, kv_heads, D).transpose(1, 2)
                for c in (k_cache, v_cache))
    k, v = _as(k, q.dtype), _as(v, q.dtype)
    scores = torch.matmul(q.view(G, kv_heads, H // kv_heads, D), k.transpose(2, 3))
    mask = group.mask if window is None else group.windowed(window)
    probs = scores.mul_(scale).add_(mask).softmax(dim=-1)
    return torch.matmul(probs, v).view(G, H, D)


def _attend_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, s: _SeqPlan, scale: float, window: int | None = None) -> torch.Tensor:
    """The query tokens of one sequence's chunk, causally over its context."""
    if s.block_table is None:  # the whole context is in this batch
        ks, vs = k, v
    else:
        kv_heads, D = k_cache.shape[2], k_cache.shape[3]
        ks = k_cache.index_select(0, s.block_table).view(-1, kv_heads, D)[: s.context_len]
        vs = v_cache.index_select(0, s.block_table).view(-1, kv_heads, D)[: s.context_len]
    ks, vs = _as(ks, q.dtype), _as(vs, q.dtype)
    mask = s.mask if window is None or window >= s.context_len else s.windowed(window, q.device)
    if mask is not None and mask.dtype.is_floating_point and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
    ).transpose(0, 1)
