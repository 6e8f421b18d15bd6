"""SamplingParams: what a request asks of the sampler and the stop checks.

The batched Sampler lives in tallow/engine/sampler.py.
"""

from __future__ import annotations

import math
import operator
import struct
from dataclasses import dataclass, field, fields, replace
from typing import Any

from tallow.engine.grammar import GrammarSpec, compact_json, json_schema_object, json_schema_spec
from tallow.errors import TallowError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The smallest normal float32: a repetition penalty below it is 0 or subnormal in the sampler's
# float32 tensors, where x / r overflows for any logit.
FLOAT32_TINY = 1.1754943508222875e-38
FLOAT32_MAX = 3.4028234663852886e38


def as_float32(x: float) -> float:
    """x rounded to float32 as the sampler's tensors hold it (inf beyond float32's range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


class SamplingParamsError(TallowError, ValueError):
    """A SamplingParams field out of its range or of the wrong type: a TallowError (a 400 in the
    server) and a ValueError (what vLLM's SamplingParams raises)."""


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs (vllm.sampling_params.StructuredOutputsParams; GuidedDecodingParams
    before vLLM 0.12), given as SamplingParams(structured_outputs=...): exactly one of

      json         a JSON schema: a dict, its JSON text, or a pydantic model class (its
                   model_json_schema()). As the server reads schemas: objects that list properties
                   and say nothing of other keys are closed to them, keywords the backend cannot
                   enforce are ignored, and the JSON is written with ", " and ": ".
      regex        a pattern (llguidance's regex syntax)
      choice       a list of strings: the output is one of them
      grammar      a Lark grammar (llguidance's) or a GBNF grammar
      json_object  True: any JSON object

    It becomes SamplingParams.grammar (a GrammarSpec), as the server's structured_outputs does.
    """

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        set_ = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(set_) != 1:
            raise SamplingParamsError("structured_outputs: exactly one of json, regex, choice, grammar or "
                                      f"json_object must be set, got {set_ or 'none'}", param="structured_outputs")

    def to_grammar(self) -> GrammarSpec:
        def bad(msg: str) -> SamplingParamsError:
            return SamplingParamsError(f"structured_outputs: {msg}", param="structured_outputs")

        if self.json is not None:
            schema = self.json
            if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model
                schema = schema.model_json_schema()
            try:
                return json_schema_spec(json_schema_object(schema))
            except ValueError as e:
                raise bad(f"json: {e}") from None
        if self.regex is not None:
            if not isinstance(self.regex, str):
                raise bad("regex must be a string")
            return GrammarSpec("regex", self.regex)
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise bad("choice must be a non-empty list of strings")
            return GrammarSpec("choice", compact_json(list(self.choice)))
        if self.grammar is not None:
            if not isinstance(self.grammar, str):
                raise bad("grammar must be a string (Lark or GBNF)")
            return GrammarSpec("lark", self.grammar)
        return GrammarSpec("json_object", "")


# vLLM's name before 0.12 (SamplingParams(guided_decoding=GuidedDecodingParams(...))).
GuidedDecodingParams = StructuredOutputsParams


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the context limit
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # on prompt and output tokens (HF/vLLM semantics)
    presence_penalty: float = 0.0  # on output tokens (OpenAI semantics)
    frequency_penalty: float = 0.0  # on output tokens (OpenAI semantics)
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings: matched on text by the sink
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    # None: no logprobs; 0: the chosen token's logprob only; k: plus the top k alternatives.
    logprobs: int | None = None
    # The prompt tokens' logprobs (tallow/engine/prompt_logprobs.py): None: none; 0: each prompt
    # token's own logprob and rank; k: plus the top k there.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured output: the output follows this grammar (tallow/engine/grammar.py); None: free.
    grammar: GrammarSpec | None = None
    # A reasoning budget (Anthropic's thinking.budget_tokens): once the output holds this many
    # tokens inside an open reasoning block (opened by the prompt, reasoning_open, or by the
    # reasoning_start_ids in the output), the reasoning_end_ids are forced, one per step
    # (engine/forced_tokens.py), and the answer starts.
    reasoning_budget: int | None = None
    reasoning_start_ids: tuple[int, ...] = ()
    reasoning_end_ids: tuple[int, ...] = ()
    reasoning_open: bool = False
    # False: never speculate for this request (the `speculative: false` extra), whatever the server does.
    speculative: bool = True
    # vLLM's structured outputs: becomes `grammar` (at most one of them).
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM < 0.12's name for it

    def __post_init__(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise SamplingParamsError(msg, param=param)

        for name in ("n", "max_tokens", "top_k", "min_tokens", "seed", "logprobs", "prompt_logprobs",
                     "reasoning_budget"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                try:  # a numpy integer is an int; 2.0 or "5" is not
                    value = None if isinstance(value, bool) else operator.index(value)
                except TypeError:
                    value = None
                if value is None:
                    bad(name, f"{name} must be an int, but is of type {type(getattr(self, name)).__name__}")
                setattr(self, name, value)
        structured = [(k, v) for k, v in (("structured_outputs", self.structured_outputs),
                                           ("guided_decoding", self.guided_decoding)) if v is not None]
        if structured:
            name, so = structured[0]
            if isinstance(so, dict):
                so = StructuredOutputsParams(**so)
            if not isinstance(so, StructuredOutputsParams):
                bad(name, f"{name} must be a StructuredOutputsParams, got {type(so).__name__}")
            spec = so.to_grammar()
            # (dataclasses.replace of a SamplingParams passes both: the grammar made from it)
            if len(structured) > 1 or self.grammar not in (None, spec):
                bad(name, "set at most one of grammar, structured_outputs and guided_decoding")
            self.grammar = spec
            self.structured_outputs, self.guided_decoding = so, None
        if (isinstance(self.grammar, GrammarSpec) and self.grammar.kind == "json_schema"
                and not isinstance(self.grammar.text, str)):
            # GrammarSpec("json_schema", {...}): the schema's compact JSON text, its key order kept
            self.grammar = replace(self.grammar, text=compact_json(self.grammar.text))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise SamplingParamsError(msg, param=param)

        if self.n < 1:
            bad("n", f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        # Comparisons are written so that NaN fails them.
        if not 0 <= self.temperature < math.inf:
            bad("temperature", f"temperature must be non-negative and finite, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not as_float32(self.top_p) > 0.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}, which is 0 as a float32")
        if self.top_k > INT64_MAX:
            bad("top_k", f"top_k must be at most {INT64_MAX}, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:
            # The sampler divides by it in float32: 0, a subnormal or inf there gives inf or NaN.
            bad("repetition_penalty", f"repetition_penalty must be positive and finite as a float32 "
                f"(in [{FLOAT32_TINY:.6g}, {FLOAT32_MAX:.6g}]), got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.min_tokens < 0:
            bad("min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", f"logprobs must be non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            bad("seed", f"seed must be a signed 64-bit integer, in [{INT64_MIN}, {INT64_MAX}], got {self.seed}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            bad("grammar", f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            bad("logit_bias", f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
        for token, value in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                bad("logit_bias", f"logit_bias keys must be token ids (non-negative ints), got {token!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -math.inf < value < math.inf:
                bad("logit_bias", f"logit_bias values must be finite numbers, got {value!r} for token {token}")
        for token in self.stop_token_ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                bad("stop_token_ids", f"stop_token_ids must be token ids (non-negative ints), got {token!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def needs_host_tokens(self) -> bool:
        """Whether sampling reads the sequence's token ids on the host (penalties, a reasoning
        budget): asynchronous scheduling then waits for every step's tokens."""
        return self.needs_penalties or self.reasoning_budget is not None
