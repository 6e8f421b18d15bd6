"""SamplingParams: what a request asks of the sampler and the stop checks.

The batched Sampler lives in tallow/engine/sampler.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tallow.errors import TallowError


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
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

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
        if self.temperature < 0:
            bad("temperature", f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.min_tokens < 0:
            bad("min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", f"logprobs must be non-negative, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
