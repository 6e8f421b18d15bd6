"""Grammar-constrained decoding (structured output) on llguidance.

What a request carries is a GrammarSpec (SamplingParams.grammar). The engine side:

- GrammarBackend (one per tokenizer and vocabulary width, `grammar_backend`): the llguidance
  tokenizer, a small thread pool that compiles grammars off the engine thread, and an LRU cache
  of compiled grammars keyed by (kind, text) and bounded by (estimated) bytes. `check_grammar`
  (the planning thread) validates a spec in about a millisecond and starts its compile, so the
  engine usually finds it compiled.
- GrammarState (one per sequence, `Sequence.grammar`): the sequence's llguidance matcher, a copy
  of the compiled grammar's. A sequence whose grammar is still compiling waits in the scheduler's
  queue; the step never waits for a compile.
- Token bitmasks: `fill_bitmasks` writes one bit per vocabulary token for each constrained row
  (llguidance, in native code, in parallel over the rows); `apply_bitmasks` sets the forbidden
  logits to -inf on the logits' device (CUDA: the words copied without a sync and unpacked
  there; CPU: a 0/-inf bias read per mask byte from a table). The sampler applies them after
  logit_bias, min_tokens and the penalties, before temperature / top-k / top-p / min-p, so
  reported logprobs are those of the masked distribution (as vLLM's).
- Jump-forward ("fill"): after a sampled token, when the grammar allows exactly one
  continuation for several tokens (llguidance's compute_ff_tokens), those tokens are appended
  without sampling; the next step computes them as a chunk. The sequence counts them (`fill`).
  Forced tokens follow the grammar's canonical tokenization, so the output can differ from
  masked sampling without jump-forward, where the model may spell a fixed key in other tokens.
  A chunk of k forced tokens costs about one decode step where decoding is memory-bound (GPU,
  CPU at batch 1); at larger CPU batches the forward is compute-bound and the gain is smaller.
- Asynchronous scheduling: a grammar row's mask needs its previous token, which the step still
  running samples. The engine queues the step's forward, resolves the step before (the matchers
  consume its tokens) while the device computes, then fills the masks and samples (vLLM's
  order: EngineCore._step_async). Forced tokens found then are appended and the row launched
  for the sequence is dropped; the next step computes them (one chunk, or one token per step
  in decode-graph steps while many sequences run: config.jump_forward_chunk_max_seqs).

Backend choice: llguidance (no dependencies, native mask computation) over xgrammar (pulls
transformers and triton); benchmarks/grammar_backends.py has the measurements.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

    from tallow.tokenizer import Tokenizer

log = logging.getLogger(__name__)

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


@dataclass(frozen=True)
class GrammarSpec:
    r"""A constraint on a sequence's output.

    kind / text:
      json_schema  the schema as compact JSON text in the client's key order:
                   json.dumps(schema, separators=(",", ":")), NOT sort_keys=True: llguidance
                   writes an object's properties in the order the schema lists them, so sorted
                   text would reorder the output's keys (a pydantic model's fields alphabetically)
      json_object  "" (any JSON object)
      regex        the pattern (llguidance's regex syntax: Rust's regex crate, no look-around); \d
                   is an ASCII digit, as in JSON schema patterns (Rust's own \d takes any
                   Unicode digit, and a small model picks exotic ones)
      choice       a JSON list of strings: the output is exactly one of them
      lark         an llguidance Lark grammar (may embed %json{...} sub-schemas), or a GBNF
                   grammar (llama.cpp's), which llguidance converts to Lark
    start_after: token ids of the end-of-reasoning marker: the output is free until it ends with
      these ids, then the grammar applies (None: from the first output token).

    JSON is generated compactly with ", " and ": " separators and no other whitespace (so
    fixed keys are forced tokens); a schema's own "x-guidance" object overrides that (e.g.
    {"x-guidance": {"lenient": true}} ignores keywords llguidance cannot enforce instead of
    rejecting the schema).
    """

    kind: GrammarKind
    text: str
    start_after: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r} (expected one of {', '.join(KINDS)})")
        if self.start_after is not None:
            object.__setattr__(self, "start_after", tuple(int(t) for t in self.start_after))
            if not self.start_after:
                raise GrammarError("start_after must hold at least one token id (or be None)")

    @property
    def key(self) -> tuple[str, str]:
        """What the compile cache is keyed by (start_after is per sequence, not compiled)."""
        return (self.kind, self.text)


class GrammarError(ValueError):
    """A grammar the backend rejects (or one over a limit); the message is the reason, fit for a 400."""


@dataclass(frozen=True)
class GrammarLimits:
    max_text_bytes: int = 1 << 20  # the spec's text (a schema, pattern or grammar)
    compile_timeout_s: float = 10.0  # a sequence whose grammar takes longer ends with "error"
    cache_bytes: int = 64 << 20  # the compiled-grammar cache (estimated bytes)
    max_grammar_size: int = 500_000  # llguidance: symbols in the grammar's productions
    initial_lexer_fuel: int = 1_000_000  # llguidance: regex analysis at compile (~50k/ms)
    step_lexer_fuel: int = 200_000  # llguidance: lexer work per mask (~14k/ms)
    step_max_items: int = 50_000  # llguidance: Earley items per mask (~20k/ms)


# JSON output: compact, one space after separators, no other whitespace (a schema's "x-guidance"
# object overrides these). Without free whitespace, a fixed key is a run of forced tokens and a
# small model cannot pad the output with newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def compact_json(value: Any) -> str:
    """JSON text without spaces, in the value's own key order (llguidance writes an object's
    properties in the order its schema lists them)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def json_schema_object(value: Any) -> Any:
    """A JSON schema as given (an object, its JSON text, true / false) as the object it stands for:
    true is {} (any value), false {"not": {}} (no value). ValueError: not JSON, nested too deeply,
    or not a schema."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except RecursionError:
            raise ValueError("the JSON schema is nested too deeply") from None
        except ValueError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if value is True or value is False:
        return {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise ValueError("a JSON schema must be an object")
    return value


def json_schema_spec(schema: dict, *, strict: bool = False) -> GrammarSpec:
    """A JSON schema object as every front end's GrammarSpec (the server's response formats and the
    Python API's structured_outputs alike): objects that list properties closed to other keys
    (closed_objects), keywords the backend cannot enforce ignored unless strict, the schema's own
    x-guidance options over JSON_OPTIONS; compact JSON text in the schema's key order."""
    options = {**JSON_OPTIONS, "lenient": not strict}
    if isinstance(schema.get("x-guidance"), dict):
        options.update(schema["x-guidance"])
    return GrammarSpec("json_schema", compact_json({**closed_objects(schema), "x-guidance": options}))


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec (not validated yet); GrammarError for malformed text."""
    import llguidance as llg

    kind, text = spec.kind, spec.text
    try:
        if kind == "json_schema":
            schema = json.loads(text)
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a JSON schema must be an object (or true/false)")
            return llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=JSON_OPTIONS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(ascii_digits(text))
        if kind == "choice":
            choices = json.loads(text)
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) for c in choices)):
                raise GrammarError("choice must be a non-empty list of strings")
            # Lark string literals take JSON's escapes.
            alternatives = " | ".join(json.dumps(c) if c else '""' for c in dict.fromkeys(choices))
            return llg.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        # Lark, or llama.cpp's GBNF (converted by llguidance).
        return llg.grammar_from("grammar", text)
    except GrammarError:
        raise
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise GrammarError(f"invalid {kind}: {e}") from None


def ascii_digits(pattern: str) -> str:
    """The pattern with each \\d an ASCII digit: [0-9] (0-9 inside a character class)."""
    if "\\d" not in pattern:
        return pattern
    out: list[str] = []
    depth = 0  # character classes nest in Rust's syntax ([a-z&&[^aeiou]])
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            nxt = pattern[i + 1]
            out.append(("0-9" if depth else "[0-9]") if nxt == "d" else c + nxt)
            i += 2
            continue
        if c == "[":
            depth += 1
            out.append(c)
            i += 1
            # A "]" first in a class (after an optional "^") is a literal.
            if i < n and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < n and pattern[i] == "]":
                out.append("]")
                i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


# Schema keywords whose value is a map of names to subschemas, one subschema, or a list of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedItems", "unevaluatedProperties",
               "not", "if", "then", "else", "contains", "propertyNames")
_SCHEMA_LIST = ("anyOf", "oneOf", "prefixItems")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema):
    """The JSON schema with every object that lists `properties` and says nothing of other keys
    closed to them (additionalProperties: false), as xgrammar's default (vLLM's default backend)
    and OpenAI's strict mode read schemas. A pydantic model's schema says nothing of extra keys;
    left open, a small model invents keys until max_tokens. A schema that wants other keys says
    so (additionalProperties: true or a schema, patternProperties). allOf branches stay as written
    (closing each would make their conjunction unsatisfiable). Returns a new object; the input is
    not modified."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _SCHEMA_ONE or key in _SCHEMA_LIST:
            out[key] = closed_objects(value)
    if (isinstance(schema.get("properties"), dict) and "allOf" not in schema
            and not any(k in schema for k in _OPEN_KEYS) and schema.get("type", "object") == "object"):
        out["additionalProperties"] = False
    return out


class _Entry:
    __slots__ = ("future", "nbytes")

    def __init__(self, future: Future, nbytes: int):
        self.future, self.nbytes = future, nbytes


class GrammarBackend:
    """llguidance for one tokenizer and vocabulary width: validation, the compile pool and
    cache, and batched bitmask filling. Thread-safe (the planning threads check and start
    compiles, the engine thread takes matchers and fills masks)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None,
                 limits: GrammarLimits | None = None, compile_workers: int = 2):
        import llguidance as llg

        self.limits = limits or GrammarLimits()
        # Logits are as wide as the model's vocabulary; tokens past the tokenizer's are never allowed.
        self.vocab_size = max(vocab_size or 0, tokenizer.vocab_size)
        eos = sorted(tokenizer.eos_token_ids)
        self.ll_tokenizer = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                            eos_token=eos or None)
        self.words = (self.vocab_size + 31) // 32  # int32 words of one row's bitmask
        self._ll_limits = llg.LLParserLimits(
            max_grammar_size=self.limits.max_grammar_size, initial_lexer_fuel=self.limits.initial_lexer_fuel,
            step_lexer_fuel=self.limits.step_lexer_fuel, step_max_items=self.limits.step_max_items,
            verbose_errors=False)
        self._pool = ThreadPoolExecutor(max_workers=compile_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self.cache_bytes = 0
        self._executor = None  # llguidance's thread pool for masks, made on first use
        # A hook for tests: called in the compile thread before each compile.
        self.compile_delay_hook = None

    # ---- validation and compilation -------------------------------------------------------
    def _checked_grammar(self, spec: GrammarSpec) -> str:
        import llguidance as llg

        size = len(spec.text.encode("utf-8", "surrogatepass"))
        if size > self.limits.max_text_bytes:
            raise GrammarError(f"the {spec.kind} is {size} bytes, over the limit of {self.limits.max_text_bytes}")
        grammar = grammar_text(spec)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer,
                                                                          limits=self._ll_limits)
        if is_error:
            raise GrammarError(f"invalid {spec.kind}: {_clean(messages[0])}")
        return grammar

    def check(self, spec: GrammarSpec) -> None:
        """Raise GrammarError if the spec cannot be compiled; start compiling it otherwise."""
        with self._lock:
            entry = self._cache.get(spec.key)
            if entry is not None:
                self._cache.move_to_end(spec.key)
        if entry is not None:
            if entry.future.done() and entry.future.exception() is not None:
                raise entry.future.exception()
            return
        self._checked_grammar(spec)
        self.compile(spec)

    def compile(self, spec: GrammarSpec) -> Future:
        """The compiled grammar of spec (a Future of an llguidance LLMatcher in its start state,
        to copy from), from the cache or a new compile in the pool."""
        key = spec.key
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                return entry.future
            # Estimated bytes: llguidance does not report its own; the grammar text dominates
            # for schemas, plus the lexer's state cache that grows while it runs.
            entry = _Entry(Future(), 64 * 1024 + 16 * len(spec.text))
            self._cache[key] = entry
            self.cache_bytes += entry.nbytes
            self._evict()
        self._pool.submit(self._compile, spec, entry)
        return entry.future

    def _compile(self, spec: GrammarSpec, entry: _Entry) -> None:
        import llguidance as llg

        future = entry.future
        if not future.set_running_or_notify_cancel():
            return
        try:
            if self.compile_delay_hook is not None:
                self.compile_delay_hook(spec)
            t0 = time.perf_counter()
            grammar = self._checked_grammar(spec)
            matcher = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self._ll_limits)
            if matcher.is_error():
                raise GrammarError(f"invalid {spec.kind}: {_clean(matcher.get_error())}")
            if self._admits_nothing(matcher):
                raise GrammarError(f"the {spec.kind} admits no output (no value matches it)")
            log.debug("compiled a %s grammar of %d bytes in %.1f ms", spec.kind, len(spec.text),
                      1e3 * (time.perf_counter() - t0))
        except GrammarError as e:
            self._forget(spec.key, entry)
            future.set_exception(e)
        except Exception as e:  # the backend failed: the request fails, never the engine
            self._forget(spec.key, entry)
            future.set_exception(GrammarError(f"the {spec.kind} could not be compiled: {e}"))
        else:
            future.set_result(matcher)

    def _admits_nothing(self, matcher) -> bool:
        """An empty language: the start state is not accepting and allows no token but the end
        (llguidance lets a grammar that cannot go on end): a reply would be "" that breaks it."""
        if matcher.is_accepting():
            return False
        mask = np.zeros((1, (self.vocab_size + 31) // 32), dtype=np.int32)
        self.fill_bitmask(matcher, mask, 0)
        for eos in self.ll_tokenizer.eos_tokens:
            mask[0, eos // 32] &= ~np.int32(np.uint32(1 << (eos % 32)).view(np.int32))
        return not mask.any()

    def _forget(self, key, entry: _Entry) -> None:
        """A failed compile is not cached (the next request with it gets a fresh reason)."""
        with self._lock:
            if self._cache.get(key) is entry:
                del self._cache[key]
                self.cache_bytes -= entry.nbytes

    def _evict(self) -> None:
        while self.cache_bytes > self.limits.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self.cache_bytes -= old.nbytes

    def cache_size(self) -> int:
        with self._lock:
            return len(self._cache)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self.cache_bytes = 0

    # ---- masks -----------------------------------------------------------------------------
    def fill_bitmasks(self, matchers: list, out: np.ndarray) -> None:
        """Row j of out [M, words] int32 <- matchers[j]'s allowed next tokens, one bit per token
        (bit b of word w: token 32 w + b)."""
        import llguidance as llg
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

        if len(matchers) == 1:
            fill_next_token_bitmask(matchers[0], out, 0)
            return
        if self._executor is None:
            self._executor = llg.LLExecutor(num_threads=max(1, min(8, os.cpu_count() or 1)))
        fill_next_token_bitmask_par(self._executor, [(m, j) for j, m in enumerate(matchers)], out)

    def fill_bitmask(self, matcher, out: np.ndarray, row: int) -> None:
        """Row `row` of out <- one matcher's allowed next tokens (fill_bitmasks' layout)."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(matcher, out, row)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _clean(message: str) -> str:
    return message.replace("<non-verbose/>", "").strip().removeprefix("WARNING: ")


# One backend per tokenizer object (the engine's, which the planning threads also hold).
_backends: "weakref.WeakKeyDictionary[Tokenizer, GrammarBackend]" = weakref.WeakKeyDictionary()
_backends_lock = threading.Lock()


# The model's vocabulary width (its logits) per tokenizer, told by the engine at start-up.
_vocab_widths: "weakref.WeakKeyDictionary[Tokenizer, int]" = weakref.WeakKeyDictionary()


def register_vocab_width(tokenizer: Tokenizer, vocab_size: int) -> None:
    """The engine's model has logits this wide (the backend's masks must cover them)."""
    with _backends_lock:
        _vocab_widths[tokenizer] = vocab_size


def grammar_backend(tokenizer: Tokenizer) -> GrammarBackend:
    """The GrammarBackend of a tokenizer, made on first use (about 0.3 s: llguidance reads the
    vocabulary), usually by check_grammar on a planning thread rather than on the engine's."""
    with _backends_lock:
        backend = _backends.get(tokenizer)
        width = _vocab_widths.get(tokenizer)
        if backend is None or (width is not None and backend.vocab_size < width):
            try:
                backend = GrammarBackend(tokenizer, width)
            except Exception as e:  # llguidance cannot read this tokenizer
                raise GrammarError(f"structured output is not available with this model's tokenizer: {e}") from e
            _backends[tokenizer] = backend
        return backend


def check_grammar(spec: GrammarSpec, tokenizer: Tokenizer) -> None:
    """Raise GrammarError (the backend's reason) when spec cannot constrain this tokenizer's
    model; otherwise start compiling it, so the engine usually finds it ready. About a
    millisecond for a typical schema; call it where a request is planned (a 400 on error)."""
    grammar_backend(tokenizer).check(spec)


class GrammarState:
    """One sequence's grammar: its compile, then its own matcher (a copy of the compiled one's).

    The matcher has consumed exactly the sequence's output tokens since the grammar applies (all
    of them, or those after the start_after marker), forced ones included; a recompute preemption
    keeps the output, so it keeps the matcher too. release() drops it (the sequence ended)."""

    __slots__ = ("spec", "backend", "future", "matcher", "active", "fill", "submitted", "unsent", "error")

    def __init__(self, spec: GrammarSpec, backend: GrammarBackend):
        self.spec = spec
        self.backend = backend
        self.future: Future | None = backend.compile(spec)
        self.submitted = time.monotonic()
        self.matcher = None
        self.active = spec.start_after is None  # whether the grammar applies yet
        self.fill = 0  # tokens appended by jump-forward
        self.error: str | None = None  # why advance() returned "error"
        self.unsent: list[int] = []  # forced before the first sampled token, not in an output yet

    @property
    def ready(self) -> bool:
        """The compile has ended (the sequence may be scheduled once bind() said yes)."""
        return self.matcher is not None or self.future is None or self.future.done()

    def bind(self) -> str | None:
        """After the compile ended: take a matcher for this sequence; the compile's error message
        when it failed (the sequence cannot run)."""
        if self.future is None:
            return "the sequence has ended"
        error = self.future.exception()
        if error is not None:
            return str(error)
        self.matcher = self.future.result().deep_copy()
        return None

    def start_forced(self, room: int) -> list[int]:
        """Jump-forward before the first sampled token (a grammar that applies from the start):
        the tokens its start state forces, consumed, when fewer than room and not the whole
        output (a grammar they complete is left to sampling); else none."""
        m = self.matcher
        if m is None or not self.active:
            return []
        forced = m.compute_ff_tokens()
        if not forced or len(forced) >= room:
            return []
        probe = m.deep_copy()
        if not probe.consume_tokens(forced) or probe.is_stopped():
            return []
        m.consume_tokens(forced)
        return forced

    def overdue(self, now: float) -> bool:
        return now - self.submitted > self.backend.limits.compile_timeout_s

    @property
    def constrains(self) -> bool:
        """The next token is masked by the grammar."""
        return self.active and self.matcher is not None

    def _opens_at(self, tokens: list[int], end: int, num_prompt_tokens: int) -> bool:
        """Whether tokens[:end] ends with the start_after marker inside the output (the grammar
        applies from the token after it)."""
        marker = self.spec.start_after
        k = len(marker)
        return end - num_prompt_tokens >= k and tuple(tokens[end - k:end]) == marker

    def advance(self, token_ids: list[int], num_prompt_tokens: int, jump_forward: bool,
                new: int = 1) -> tuple[str | None, list[int]]:
        """After `new` tokens were appended to the sequence (token_ids: prompt and output, the
        last `new` of them new: one sampled token, or a verified speculative run): consume them.
        Returns (finish reason or None, tokens forced next: append them without sampling;
        the matcher has consumed them). "stop": the grammar is complete (nothing but the end
        can follow); "error": a token was not one the grammar allows (self.error says why: the
        matcher's error, such as a limit it ran into)."""
        m = self.matcher
        if m is None:
            return None, []
        for end in range(len(token_ids) - new + 1, len(token_ids) + 1):
            if not self.active:
                if self._opens_at(token_ids, end, num_prompt_tokens):
                    self.active = True  # the grammar applies from the next token on
                continue
            if not m.consume_token(token_ids[end - 1]):
                self.error = (_clean(m.get_error()) if m.is_error()
                              else f"token {token_ids[end - 1]} is not one it allows")
                return "error", []
            if m.is_stopped():
                return "stop", []
        if not self.active:
            return None, []
        if m.is_stopped():
            return "stop", []
        if not jump_forward:
            return None, []
        forced = m.compute_ff_tokens()
        if forced and not m.consume_tokens(forced):
            self.error = _clean(m.get_error()) if m.is_error() else "its forced tokens were refused"
            return "error", []
        return ("stop" if forced and m.is_stopped() else None), forced

    def _draft_start(self, token_ids: list[int], num_prompt_tokens: int, draft: list[int]) -> int:
        """The first draft position the grammar constrains: 0 when it applies already; else the
        position after the draft token that completes the start_after marker (len(draft) + 1:
        none does)."""
        if self.active:
            return 0
        tokens = token_ids + list(draft)
        for j in range(len(draft)):
            if self._opens_at(tokens, len(token_ids) + j + 1, num_prompt_tokens):
                return j + 1
        return len(draft) + 1

    def draft_prefix(self, token_ids: list[int], num_prompt_tokens: int, draft: list[int]) -> int:
        """How many leading tokens of a speculative draft (proposed after token_ids) may be
        verified: it ends before the first token the grammar rejects and before the token that
        would complete it (that one is left to the target's own pick, which ends the run, as a
        plain step ends the sequence there). A copy of the matcher is advanced; this one is not."""
        m = self.matcher
        start = self._draft_start(token_ids, num_prompt_tokens, draft)
        if m is None or start > len(draft):
            return len(draft)
        if m.is_stopped():
            return 0
        probe = m.deep_copy()
        for j in range(start, len(draft)):
            if not probe.consume_token(draft[j]) or probe.is_stopped():
                return j
        return len(draft)

    def draft_masks(self, token_ids: list[int], num_prompt_tokens: int,
                    draft: list[int]) -> tuple[list[int], np.ndarray] | None:
        """The masks of the len(draft) + 1 positions a verified draft scores (position j: the
        token after token_ids + draft[:j]), from a copy of the matcher advanced over the draft
        (which draft_prefix cut to tokens it accepts): (the constrained positions, their bitmasks
        [n, words] int32), or None when none is constrained."""
        m = self.matcher
        start = self._draft_start(token_ids, num_prompt_tokens, draft)
        if m is None or start > len(draft):
            return None
        positions = list(range(start, len(draft) + 1))
        words = np.empty((len(positions), self.backend.words), dtype=np.int32)
        probe = m.deep_copy()
        for row, j in enumerate(positions):
            if j > start and not probe.consume_token(draft[j - 1]):
                raise ValueError(f"draft token {draft[j - 1]} is not one the grammar allows")
            self.backend.fill_bitmask(probe, words, row)
        return positions, words

    def release(self) -> None:
        self.matcher = None
        self.future = None


def grammar_bitmasks(states: list[GrammarState | None]) -> tuple[list[int], np.ndarray] | None:
    """The rows whose next token a grammar constrains and their bitmasks [M, words] int32 (one
    bit per token, llguidance's layout), filled in native code; None when no row is constrained."""
    rows = [i for i, g in enumerate(states) if g is not None and g.matcher is not None and g.active]
    if not rows:
        return None
    backend = states[rows[0]].backend
    words = np.empty((len(rows), backend.words), dtype=np.int32)
    backend.fill_bitmasks([states[i].matcher for i in rows], words)
    return rows, words


_SHIFTS: dict = {}


def unpack_bitmasks(words: torch.Tensor, width: int) -> torch.Tensor:
    """[M, W] int32 bitmasks (on any device) -> [M, width] bool, token t allowed at [., t].

    Bit b of word w is token 32 w + b; on a little-endian device byte k of a word holds its bits
    8 k .. 8 k + 7, so the bytes unpacked low bit first give the tokens in order."""
    import torch

    shifts = _SHIFTS.get(words.device)
    if shifts is None:
        shifts = _SHIFTS[words.device] = torch.arange(8, dtype=torch.uint8, device=words.device)
    octets = words.view(torch.uint8)  # [M, 4 W]
    bits = (octets.unsqueeze(-1) >> shifts) & 1  # [M, 4 W, 8]
    return bits.view(words.shape[0], -1)[:, :width].bool()


def apply_bitmasks(logits: torch.Tensor, rows: list[int], words: np.ndarray, in_place: bool) -> torch.Tensor:
    """Forbidden tokens of the constrained rows -> -inf. words (host) goes to the logits' device
    with a non-blocking copy (through pinned memory on CUDA) and is unpacked there: no host sync.
    in_place: the logits may be changed (else a changed copy is returned)."""
    import torch

    device = logits.device
    width = logits.shape[1]
    every_row = len(rows) == logits.shape[0]
    index = None
    if not every_row:
        index = torch.tensor(rows, dtype=torch.int64)
        if device.type != "cpu":
            index = index.pin_memory().to(device, non_blocking=True)
    x = logits if every_row else logits.index_select(0, index)
    if device.type == "cpu":
        # An additive bias (0 allowed, -inf forbidden) read from a table by each mask byte:
        # np.take over the bytes is ~8x faster than unpacking bits then masked_fill on the CPU.
        bias = np.take(_BYTE_BIAS, words.view(np.uint8), axis=0).reshape(len(rows), -1)[:, :width]
        bias = torch.from_numpy(bias)
        if every_row:
            return x.add_(bias) if in_place else x + bias
        masked = x.add_(bias)
    else:
        w = torch.from_numpy(words).pin_memory().to(device, non_blocking=True)
        forbidden = ~unpack_bitmasks(w, width)
        if every_row:
            return x.masked_fill_(forbidden, -math.inf) if in_place else x.masked_fill(forbidden, -math.inf)
        masked = x.masked_fill_(forbidden, -math.inf)
    if not in_place:
        logits = logits.clone()
    return logits.index_copy_(0, index, masked)


# [256, 8] float32: for a mask byte, the bias of its 8 tokens (low bit first): 0 or -inf.
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") > 0,
                      np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
