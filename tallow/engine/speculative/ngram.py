"""N-gram prompt lookup: the longest recent suffix found earlier in the sequence proposes
the tokens that followed it.

Per sequence an index maps each n-gram (ngram_min <= n <= ngram_max) to the position after
its latest occurrence; it grows with the tokens (each new token adds one n-gram per n), so
a step's lookup is a few dict reads, not a scan of the context. A match close to the end
(a loop of a few tokens) proposes the loop continued for the whole draft."""

from __future__ import annotations

from tallow.errors import TallowError


class NgramIndex:
    __slots__ = ("tables", "indexed")

    def __init__(self, sizes: range):
        self.tables = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending before this position are in the tables


class NgramProposer:
    def __init__(self, ngram_max: int, ngram_min: int):
        if not 1 <= ngram_min <= ngram_max:
            raise TallowError(f"ngram_min must be at least 1 and at most ngram_max ({ngram_max}), got {ngram_min}",
                              param="ngram_min")
        self.sizes = range(ngram_min, ngram_max + 1)

    def new_index(self) -> NgramIndex:
        return NgramIndex(self.sizes)

    def propose(self, index: NgramIndex, token_ids: list[int], k: int) -> list[int]:
        end = len(token_ids)
        if k <= 0 or end < 2:
            return []
        tables = index.tables
        # Index every n-gram that ends before the last token (the suffix itself is not a match).
        for e in range(index.indexed, end - 1):
            for n, table in tables.items():
                if e + 1 >= n:
                    table[tuple(token_ids[e + 1 - n:e + 1])] = e + 1
        index.indexed = max(index.indexed, end - 1)
        for n in reversed(self.sizes):
            if n > end:
                continue
            pos = tables[n].get(tuple(token_ids[end - n:]))
            if pos is not None:
                # What followed the match; where that runs into the end of the sequence, the
                # match says the text repeats with period end - pos: the draft goes on with it.
                draft = token_ids[pos:pos + k]
                period = end - pos
                while len(draft) < k:
                    draft.append(draft[len(draft) - period])
                return draft
        return []
