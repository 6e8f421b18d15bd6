"""SamplingParams: what a request asks of the sampler and the stop checks.

The batched Sampler lives in tallow/engine/sampler.py.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

from tallow.engine.grammar import GrammarSpec
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise TallowError(msg, param=param)

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
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", f"logprobs must be non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            bad("seed", f"seed must be a signed 64-bit integer, in [{INT64_MIN}, {INT64_MAX}], got {self.seed}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            bad("grammar", f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")
        for token, value in (self.logit_bias or {}).items():
            if not -math.inf < value < math.inf:
                bad("logit_bias", f"logit_bias values must be finite, got {value} for token {token}")

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
