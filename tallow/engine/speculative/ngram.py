"""N-gram prompt lookup: the longest recent suffix found earlier in the sequence proposes
the tokens that followed it.

Per sequence an index maps each n-gram (ngram_min <= n <= ngram_max) to the position after
its latest occurrence; it grows with the tokens (each new token adds one n-gram per n), so
a step's lookup is a few dict reads, not a scan of the context. A match close to the end
(a loop of a few tokens) proposes the loop continued for the whole draft.

may_propose answers, before a sequence's last token is known on the host (asynchronous
scheduling: it is still being sampled), whether a proposal could follow it at all: a proposal
needs the last ngram_min tokens to have occurred before, so their first ngram_min - 1 tokens
(all known) must have occurred followed by some token. When they have not, no last token can
give a draft, and the step need not wait for it. That test is exact but weak: with ngram_min 2
it holds whenever the last known token occurred before, which in a long batch is nearly every
step. may_propose(exact=False) asks instead whether the sequence had a draft one token earlier
(the known tokens' suffix occurred before): a draft that starts on the pending token is then
proposed a step later, and a sequence that keeps finding nothing no longer holds up the batch."""

from __future__ import annotations

from tallow.errors import TallowError


class NgramIndex:
    __slots__ = ("tables", "indexed", "heads", "heads_indexed")

    def __init__(self, sizes: range):
        self.tables = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending before this position are in the tables
        # The (ngram_min - 1)-grams that some token followed (may_propose), by their end position.
        self.heads: set[tuple[int, ...]] = set()
        self.heads_indexed = 0  # heads ending before this position are in the set


class NgramProposer:
    def __init__(self, ngram_max: int, ngram_min: int):
        if not 1 <= ngram_min <= ngram_max:
            raise TallowError(f"ngram_min must be at least 1 and at most ngram_max ({ngram_max}), got {ngram_min}",
                              param="ngram_min")
        self.sizes = range(ngram_min, ngram_max + 1)

    def new_index(self) -> NgramIndex:
        return NgramIndex(self.sizes)

    def propose(self, index: NgramIndex, token_ids: list[int], k: int) -> list[int]:
        return self._propose(index, token_ids, len(token_ids), k)

    def _propose(self, index: NgramIndex, token_ids: list[int], end: int, k: int) -> list[int]:
        """The draft after token_ids[:end] (every one of them known)."""
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
            pos = tables[n].get(tuple(token_ids[end - n:end]))
            if pos is not None:  # (an n-gram is indexed once it ends before end - 1: pos < end)
                # What followed the match; where that runs into the end of the sequence, the
                # match says the text repeats with period end - pos: the draft goes on with it.
                draft = token_ids[pos:min(pos + k, end)]
                period = end - pos
                while len(draft) < k:
                    draft.append(draft[len(draft) - period])
                return draft
        return []

    def may_propose(self, index: NgramIndex, token_ids: list[int], k: int, exact: bool = True) -> bool:
        """Whether propose() could give a draft for token_ids once its last token is known.
        With every token known, whether it does. With the last one pending (negative): exact,
        whether its ngram_min - 1 known predecessors occurred earlier followed by a token, which
        any match of the ngram_min-gram suffix needs; not exact, whether the known tokens had a
        draft (the module docstring)."""
        end = len(token_ids)
        if k <= 0 or end < 2:
            return False
        if token_ids[-1] >= 0:
            return bool(self.propose(index, token_ids, k))
        if not exact:
            return bool(self._propose(index, token_ids, end - 1, 1))
        m = self.sizes[0] - 1
        if m == 0:
            return True
        known = end - 1  # tokens 0 .. known - 1 are known; the suffix of m of them ends at known - 1
        if known < m + 1:
            return False
        # A head followed by a token ends at e <= known - 2 (the token after it is known too).
        heads = index.heads
        for e in range(max(index.heads_indexed, m - 1), known - 1):
            heads.add(tuple(token_ids[e + 1 - m:e + 1]))
        index.heads_indexed = max(index.heads_indexed, known - 1)
        return tuple(token_ids[known - m:known]) in heads
