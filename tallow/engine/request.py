"""Sequence: one generation stream, its ids, params, state and block table."""

from __future__ import annotations

import itertools
import time
from enum import Enum

from tallow.engine.sampling import SamplingParams

_ids = itertools.count()

# The last token of a sequence whose step is still running on the device (asynchronous
# scheduling): the next step reads its id from that step's sampled ids on the device, and
# the scheduler writes the real id in when the step's results reach the host.
PENDING_TOKEN = -1


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A prompt and what has been generated for it.

    num_computed_tokens counts the tokens whose K/V are in the cache. After a recompute
    preemption it drops to 0 and the whole of token_ids (prompt and output so far) is
    prefilled again; the prefix cache usually makes that cheap.
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams, *,
                 eos_token_ids: frozenset[int] | set[int] = frozenset(),
                 max_model_len: int | None = None, request_id: str | None = None,
                 prefill_after: "Sequence | None" = None):
        if not prompt_ids:
            raise ValueError("prompt must hold at least one token")
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.prompt_ids = list(prompt_ids)
        self.token_ids = list(prompt_ids)  # prompt + output
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first admission (reported as cached_tokens).
        self.num_cached_tokens = 0
        self._cached_reported = False
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
        # With "error" caused by the request itself (its grammar failed to compile in time or
        # left no token to take): why, for the client's 400.
        self.error: str | None = None
        self.stop_token_id: int | None = None  # the stop token id that finished it, if any
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        self.max_model_len = max_model_len
        # n>1 siblings wait until this sequence has prefilled its prompt, then share its blocks.
        self.prefill_after = prefill_after
        # Per-request torch.Generator for seeded sampling, made by the sampler on first use.
        self.generator = None
        # Output token counts for penalties, kept by the sampler.
        self.sampler_state = None
        # Asynchronous scheduling: the row of the in-flight step that samples the pending
        # last token, and whether the sequence ends with that token whatever it is (its
        # length limit), so it is not scheduled again.
        self.pending_row = -1
        self.stopping = False
        # Structured output: the sequence's GrammarState (tallow/engine/grammar.py), made by
        # EngineCore.add when params.grammar is set.
        self.grammar = None
        # Prompt logprobs (params.prompt_logprobs): the PromptLogprobs of tokens 1.. gathered chunk
        # by chunk, the next position whose row still has to score its successor, and whether
        # they went out with the first output (tallow/engine/prompt_logprobs.py).
        self.prompt_logprobs: list | None = [] if params.prompt_logprobs is not None else None
        self.prompt_logprobs_next = 0
        self.prompt_logprobs_sent = False
        # Speculation (tallow/engine/speculative/state.py): the SpecState of a sequence that
        # speculates, set when it is queued; None otherwise.
        self.spec = None

    # ---- derived -------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked and not all computed: no prefix-cache hit may skip their rows."""
        return self.prompt_logprobs is not None and self.prompt_logprobs_next < self.num_prompt_tokens - 1

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len

    @max_model_len.setter
    def max_model_len(self, value: int | None) -> None:
        # The output limit depends only on it, the params and the prompt: kept, as check_stop
        # reads it for every sequence at every step.
        self._max_model_len = value
        limit = self.params.max_tokens if self.params.max_tokens is not None else 1 << 62
        if value is not None:
            limit = min(limit, value - self.num_prompt_tokens)
        self.max_output_tokens = max(limit, 0)  # output tokens allowed by max_tokens and the context

    # ---- update ----------------------------------------------------------------------
    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop(self) -> str | None:
        """After a token was appended: the finish reason, or None to go on."""
        p = self.params
        tokens = self.token_ids
        n_out = len(tokens) - self.num_prompt_tokens
        tok = tokens[-1]
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_token_ids:
                self.stop_token_id = tok
                return "stop"
            if tok in p.stop_token_ids:
                self.stop_token_id = tok
                return "stop"
        if n_out >= self.max_output_tokens:
            return "length"
        return None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
