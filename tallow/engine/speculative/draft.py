"""DraftModelProposer: a smaller model with the target's vocabulary proposes each draft.

It runs on its own ModelRunner with its own paged KV cache (blocks of its own shape, as many
as the target's, carved from the same memory budget by EngineCore) and its own
KVCacheManager (no prefix cache). Each speculating sequence has a DraftShadow: the draft
model's view of it (its tokens, block table, computed count). Before the scheduler runs,
prepare() brings the shadows of every sequence about to decode up to date, rolling back the
slots of draft tokens the target rejected, and runs up to K batched greedy draft steps over
them all (the first also computes the tokens the target accepted since; on CUDA the one-token
steps after it replay the draft runner's decode graphs). A greedy draft is a point mass, so the
verifier's rule is the same as for n-gram drafts.
"""

from __future__ import annotations

import torch

from tallow.engine.kv_cache import KVCacheManager
from tallow.engine.scheduler import ScheduledSeq, SchedulerOutput

_ids = iter(range(1 << 62))


class DraftShadow:
    __slots__ = ("seq_id", "token_ids", "block_table", "num_computed_tokens", "synced", "draft", "for_length",
                 "pending_row")
    # What the target's runner reads of a sequence beyond the above: a shadow never asks for
    # prompt logprobs (plan_prompt_rows) and has no grammar.
    prompt_logprobs = None
    grammar = None

    def __init__(self):
        self.seq_id = -1 - next(_ids)  # never a real sequence's id
        self.token_ids: list[int] = []
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.synced = 0  # the target's length when the draft was made
        self.draft: list[int] = []
        self.for_length = -1  # the target's length the draft follows
        self.pending_row = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    def __init__(self, runner, block_size: int):
        self.runner = runner
        self.kv = KVCacheManager(runner.num_blocks, block_size, enable_prefix_caching=False)

    def new_index(self) -> DraftShadow:
        return DraftShadow()

    def propose(self, shadow: DraftShadow, token_ids: list[int], k: int) -> list[int]:
        if shadow.for_length != len(token_ids):
            return []
        return shadow.draft[:k]

    def release(self, shadow: DraftShadow) -> None:
        self.kv.free(shadow)
        shadow.num_computed_tokens = 0
        shadow.for_length = -1

    @torch.inference_mode()
    def prepare(self, wanted: list[tuple[object, int]]) -> None:
        """wanted: (sequence, draft length) of the sequences whose next row samples."""
        active = []
        for seq, k in wanted:
            shadow = seq.spec.index
            tokens = seq.token_ids
            # Roll back to the longest prefix the target kept: its tokens up to the last sync,
            # then the draft tokens it accepted.
            m = min(shadow.synced, shadow.num_computed_tokens, len(tokens) - 1)
            old = shadow.token_ids
            while m < shadow.num_computed_tokens and m < len(tokens) - 1 and old[m] == tokens[m]:
                m += 1
            shadow.num_computed_tokens = m
            self.kv.trim(shadow)
            shadow.token_ids = list(tokens)
            shadow.synced = len(tokens)
            shadow.draft = []
            shadow.for_length = len(tokens)
            active.append((shadow, k))
        if self.runner.graphs is not None:
            # Rolled-back shadows may hold other blocks at the same places: restage every table.
            self.runner.graphs.forget_tables()
        step = 0
        while active:
            rows = []
            for shadow, k in active:
                n = len(shadow.token_ids) - shadow.num_computed_tokens
                if not self.kv.allocate_slots(shadow, n):
                    continue  # the draft pool is full: this sequence's draft ends here
                rows.append((ScheduledSeq(shadow, shadow.num_computed_tokens, n), k))
            if not rows:
                break
            logits = self.runner.logits(SchedulerOutput([r for r, _ in rows], [], 0))
            picks = logits.argmax(dim=-1).tolist()
            active = []
            for (row, k), token in zip(rows, picks):
                shadow = row.seq
                shadow.num_computed_tokens += row.num_new_tokens
                shadow.token_ids.append(token)
                shadow.draft.append(token)
                if len(shadow.draft) < k:
                    active.append((shadow, k))
            step += 1
