"""Hold-back for incremental matching: how much of a text's tail may still begin a pattern."""

from __future__ import annotations

from collections.abc import Iterable


def partial_suffix_len(text: str, patterns: Iterable[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some pattern."""
    longest = 0
    for pattern in patterns:
        for n in range(min(len(pattern) - 1, len(text)), longest, -1):
            if text.endswith(pattern[:n]):
                longest = n
                break
    return longest
