"""N-gram prompt lookup: the longest recent suffix found earlier in the sequence proposes
the tokens that followed it.

Per sequence an index maps each n-gram (ngram_min <= n <= ngram_max) to the positions after its
occurrences; it grows with the tokens (each new token adds one n-gram per n), so a step's lookup
is a few dict reads and a bisection, not a scan of the context. A match close to the end (a loop
of a few tokens) proposes the loop continued for the whole draft.

Which occurrence: text that copies its input (a rewrite, a quote, an edit of code) runs through
the source in order, so among the longest suffix's occurrences the one nearest where the last
draft's source has moved to since (its position plus the tokens emitted after it) is taken; an
edit that replaces a few tokens resumes at the right place, where the latest occurrence may be a
repeated line further on. Before any draft, the latest occurrence.

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

from bisect import bisect_left

from tallow.errors import TallowError


class NgramIndex:
    __slots__ = ("tables", "indexed", "heads", "heads_indexed", "source", "source_end")

    def __init__(self, sizes: range):
        self.tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending before this position are in the tables (positions ascending)
        self.source = -1  # where the last draft was read from (-1: none yet)
        self.source_end = 0  # the sequence's length then
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
        end = len(token_ids)
        pos = self._match(index, token_ids, end) if k > 0 else -1
        if pos < 0:
            return []
        index.source, index.source_end = pos, end
        # What followed the match; where that runs into the end of the sequence, the match says
        # the text repeats with period end - pos: the draft goes on with it.
        draft = token_ids[pos:min(pos + k, end)]
        period = end - pos
        while len(draft) < k:
            draft.append(draft[len(draft) - period])
        return draft

    def _match(self, index: NgramIndex, token_ids: list[int], end: int) -> int:
        """Where the draft after token_ids[:end] (every one of them known) starts: the position
        after an occurrence of its longest suffix (the module docstring says which), or -1."""
        if end < 2:
            return -1
        tables = index.tables
        # Index every n-gram that ends before the last token (the suffix itself is not a match).
        for e in range(index.indexed, end - 1):
            for n, table in tables.items():
                if e + 1 >= n:
                    key = tuple(token_ids[e + 1 - n:e + 1])
                    found = table.get(key)
                    if found is None:
                        table[key] = [e + 1]
                    else:
                        found.append(e + 1)
        index.indexed = max(index.indexed, end - 1)
        for n in reversed(self.sizes):
            if n > end:
                continue
            found = tables[n].get(tuple(token_ids[end - n:end]))
            if found is None:
                continue
            if index.source < 0:
                return found[-1]
            expected = index.source + (end - index.source_end)
            i = bisect_left(found, expected)  # the nearest, the later of two as near
            if i == len(found):
                return found[-1]
            if i > 0 and expected - found[i - 1] < found[i] - expected:
                return found[i - 1]
            return found[i]
        return -1

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
            return self._match(index, token_ids, end) >= 0
        if not exact:
            return self._match(index, token_ids, end - 1) >= 0
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
