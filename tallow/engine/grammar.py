"""STUB of the grammar interface (the grammar-engine branch owns this module and replaces it):
the request side is written against it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class GrammarSpec:
    kind: Literal["json_schema", "json_object", "regex", "choice", "lark"]
    text: str
    start_after: tuple[int, ...] | None = None


class GrammarError(ValueError):
    """The backend's reason, fit for a 400."""


def check_grammar(spec: GrammarSpec, tokenizer) -> None:
    import llguidance

    kind = {"json_object": "json_schema"}.get(spec.kind, spec.kind)
    text = '{"type": "object"}' if spec.kind == "json_object" else spec.text
    try:
        grammar = llguidance.grammar_from(kind, text)
    except ValueError as e:
        raise GrammarError(str(e)) from e
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise GrammarError(error)
