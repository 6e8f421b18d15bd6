"""StreamProtocol: the seam between the executor and one wire protocol."""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod

from tallow.config import ServerConfig
from tallow.serve.errors import OPENAI, error_body
from tallow.serve.executor import ChoiceUpdate, CompletionSummary, Usage
from tallow.serve.plan import Rejection, RequestPlan

DONE = "data: [DONE]\n\n"
# JSON has no -inf; a logprob this low reads as "impossible" to every client.
MIN_LOGPROB = -9999.0


# One encoder for every frame (json.dumps with options builds a new encoder per call).
to_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
# A str as to_json writes it.
json_string = json.encoder.encode_basestring


def sse(payload: dict) -> str:
    return f"data: {to_json(payload)}\n\n"


def usage_json(usage: Usage) -> str:
    """to_json(usage.to_openai()), written directly: a streamed chunk carries it with every token
    under continuous_usage_stats."""
    fill = f',"fill":{usage.fill}' if usage.fill else ""
    spec = usage.speculation
    if spec is not None:
        fill += f',"speculation":{{"proposed":{spec["proposed"]},"accepted":{spec["accepted"]}}}'
    return (f'{{"prompt_tokens":{usage.prompt_tokens},"completion_tokens":{usage.completion_tokens},'
            f'"total_tokens":{usage.total_tokens},"prompt_tokens_details":{{"cached_tokens":{usage.cached_tokens}}}'
            f'{fill}}}')


class OpenAIChunks:
    """Streamed chunks of the OpenAI protocols, {"id", "object", "created", "model", "choices"
    [, "usage"]}: the constant head is rendered once per request, not once per token."""

    plan: RequestPlan
    _head: str | None = None

    def chunk_frame(self, object_name: str, choices_json: str, usage: Usage | None, final: bool) -> str:
        head = self._head
        if head is None:
            head = self._head = (f'data: {{"id":{json_string(self.request_id)},"object":"{object_name}",'
                                 f'"created":{self.created},"model":{json_string(self.model_name)},"choices":')
        plan = self.plan
        if plan.include_usage or plan.continuous_usage_stats:
            show = usage is not None and (final or plan.continuous_usage_stats)
            return f'{head}{choices_json},"usage":{usage_json(usage) if show else "null"}}}\n\n'
        return f"{head}{choices_json}}}\n\n"


def finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class StreamProtocol(ABC):
    """One wire protocol: its body -> a RequestPlan, a run's updates -> SSE frames, a summary -> JSON.

    Streaming calls start() once, add_events() for each ChoiceUpdate (the update carrying a
    finish_reason closes its choice), then finish() once, or error() if the run fails midway.
    Each returns the frames to send, in order.
    """

    id_prefix: str
    # The shape of this protocol's error bodies (serve/errors.py), and the status of "the server
    # is at capacity".
    error_protocol = OPENAI
    queue_full_status = 429

    def __init__(self, plan: RequestPlan, model_name: str, tokenizer, request_id: str):
        self.plan = plan
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.request_id = request_id
        self.created = int(time.time())
        self.num_choices = len(plan.prompts) * plan.params.n

    @classmethod
    @abstractmethod
    def plan_request(cls, raw: bytes, engine, config: ServerConfig) -> RequestPlan | Rejection: ...

    @abstractmethod
    def start(self) -> list[str]: ...

    @abstractmethod
    def add_events(self, update: ChoiceUpdate, usage: Usage) -> list[str]: ...

    @abstractmethod
    def finish(self, usage: Usage) -> list[str]: ...

    def error(self, message: str, status: int = 500) -> list[str]:
        """The frames of an error after the stream started (status: the error's own, a 400 for
        what the request itself caused)."""
        return [sse(error_body(self.error_protocol, status, message)), DONE]

    @abstractmethod
    def response(self, summary: CompletionSummary) -> dict: ...

    def token_bytes(self, token_id: int) -> bytes:
        """What a token adds to the text: nothing for a special token the text skips."""
        if self.plan.params.skip_special_tokens and token_id in self.tokenizer.special_token_ids:
            return b""
        return self.tokenizer.token_bytes(token_id)

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def prompt_logprobs_vllm(self, entries: list | None) -> list | None:
        """vLLM's prompt_logprobs: null for the first prompt token, then per token a dict keyed by
        token id (the prompt token's own entry, then the top k asked) of {logprob, rank,
        decoded_token}."""
        k = self.plan.prompt_logprobs
        if entries is None or k is None:
            return None
        out: list[dict | None] = [None]
        for e in entries:
            position = {str(e.token_id): self._vllm_logprob(e.token_id, e.logprob, e.rank)}
            for rank, (token_id, logprob) in enumerate(e.top[:k], 1):
                position.setdefault(str(token_id), self._vllm_logprob(token_id, logprob, rank))
            out.append(position)
        return out

    def _vllm_logprob(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": finite(logprob), "rank": rank,
                "decoded_token": self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")}
