"""Proposer: what a speculating sequence's draft comes from."""

from __future__ import annotations

from typing import Protocol

from tallow.errors import TallowError


class Proposer(Protocol):
    """Proposes up to k tokens that may follow token_ids.

    new_index() gives the per-sequence state the proposer keeps (None when it keeps none);
    propose() may update it. A proposal depends only on the sequence's own tokens, so a
    seeded request's text does not depend on the batch it runs in."""

    def new_index(self) -> object: ...

    def propose(self, index: object, token_ids: list[int], k: int) -> list[int]: ...


def make_proposer(method: str, *, ngram_max: int, ngram_min: int) -> Proposer:
    if method == "ngram":
        from tallow.engine.speculative.ngram import NgramProposer

        return NgramProposer(ngram_max, ngram_min)
    if method == "draft":
        raise TallowError("speculative_method 'draft': the engine builds its proposer (a draft model)",
                          param="speculative_method")
    raise TallowError(f"speculative_method must be 'ngram' or 'draft', got {method!r}", param="speculative_method")
