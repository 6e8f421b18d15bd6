"""Validation: a request body -> RequestPlan, or a Rejection (status, message, param: the route renders
it in its protocol's error shape, serve/errors.py).

Each protocol adapter parses its body with `parse_request`, turns its messages or
prompts into token ids, then calls `plan_completion` for the checks every protocol
shares: limits that depend on the server or the model, the context fit, and the
SamplingParams the engine runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse

from tallow.config import ServerConfig
from tallow.engine.grammar import GrammarSpec
from tallow.engine.sampling import SamplingParams
from tallow.errors import TallowError
from tallow.serve.access_log import mark_phase
from tallow.serve.errors import error_response
from tallow.serve.protocols.openai_schemas import SamplingFields

Model = TypeVar("Model", bound=BaseModel)


@dataclass(frozen=True)
class Rejection:
    """A request refused before it runs: an HTTP status and OpenAI's error fields."""

    status: int
    message: str
    param: str | None = None
    type: str = "invalid_request_error"
    code: str | None = None

    @classmethod
    def invalid(cls, message: str, param: str | None = None, *, status: int = 400,
                type: str = "invalid_request_error", code: str | None = None) -> "Rejection":
        return cls(status, message, param, type, code)

    @classmethod
    def from_error(cls, error: TallowError) -> "Rejection":
        return cls(error.status, error.message, error.param, error.type, error.code)

    def response(self, protocol: str, headers: dict | None = None) -> JSONResponse:
        """This rejection in `protocol`'s error shape."""
        return error_response(protocol, self.status, self.message, self.type, self.param, self.code, headers)


@dataclass
class RequestPlan:
    """Everything the executor needs to run one request; each prompt gets params.n choices.

    params.max_tokens is the widest clamp; max_tokens[i] is prompt i's own clamp to the
    room its context leaves.
    """

    prompts: list[list[int]]
    params: SamplingParams
    max_tokens: list[int]
    requested_max_tokens: int | None
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    echo: bool = False
    # Chat only: the model's turn of the rendered prompt (ChatPrompt.model_turn) decides whether
    # the reply starts inside <think>.
    prompt_text: str = ""
    split_reasoning: bool = False
    reasoning_parser: str | None = None
    # Chat with tools: the parser that turns the model's tool-call markup into tool calls.
    tool_parser: str | None = None
    tools: list[dict[str, Any]] | None = None
    # parallel_tool_calls: false (Anthropic: disable_parallel_tool_use): generation ends at the
    # end of the first tool call.
    max_tool_calls: int | None = None
    # The model name the request asked for (the route answers 404 to another name than the served
    # one under --strict-model-names; otherwise the one model serves every name).
    model: str | None = None
    # Headers the route adds to the response (Responses: the hosted tools it dropped).
    response_headers: dict[str, str] = field(default_factory=dict)
    # vLLM's prompt_logprobs as asked (the response's prompt_logprobs field); params.prompt_logprobs
    # is what the engine computes (also for echo with logprobs on /v1/completions).
    prompt_logprobs: int | None = None
    # /v1/completions max_tokens 0 with echo: the engine computes one token, which is dropped.
    score_only: bool = False
    # /v1/completions echo: each prompt as sent, when it was text (None: token ids, echoed decoded)
    prompt_strings: list[str | None] | None = None

    def params_for(self, prompt_index: int) -> SamplingParams:
        return replace(self.params, max_tokens=self.max_tokens[prompt_index])


_TOKEN_ID = re.compile(r"0|[1-9][0-9]*")

# Union members and validator wrappers that pydantic puts in an error's location.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none)$|[\[\-]|^[A-Z]")


def parse_request(raw: bytes, schema: type[Model]) -> Model | Rejection:
    """Parse and type-check a JSON body; the first problem becomes a 400 naming its field.

    NaN, Infinity and -Infinity are not JSON, though Python's and pydantic's parsers take them
    as numbers: a body holding one is refused, naming where."""
    if b"NaN" in raw or b"Infinity" in raw:
        rejection = _non_finite_literal(raw)
        if rejection is not None:
            return rejection
    try:
        return schema.model_validate_json(raw)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        if error["type"] == "json_invalid":
            if "hex escape" in error["msg"]:
                surrogate = _lone_surrogate(raw)
                if surrogate is not None:
                    return surrogate
            return Rejection.invalid(f"The request body is not valid JSON: {error['msg']}")
        param = _field_path(error["loc"])
        if not param:
            return Rejection.invalid(f"The request body is invalid: {error['msg']}")
        return Rejection.invalid(f"{param}: {error['msg']}", param)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(raw: bytes) -> Rejection | None:
    """The 400 of a string holding a lone UTF-16 surrogate escape (\\ud800 without its pair):
    not text, so no field takes it; the message names the field instead of the parser's
    "end of hex escape"."""
    try:
        body = json.loads(raw)  # Python's parser keeps lone surrogates
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found is not None:
                where = f"{path}: " if path else ""
                return Rejection.invalid(f"{where}the string holds a lone UTF-16 surrogate "
                                         f"(\\u{ord(found[0]):04x}); text must be valid Unicode (a \\ud800-\\udbff "
                                         "escape must be followed by a \\udc00-\\udfff one)", path or None)
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, path))
                stack.append((v, f"{path}.{k}" if path else k))
        elif isinstance(value, list):
            stack += [(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return None


class _NonFinite(str):
    """A NaN / Infinity literal met while parsing (json.loads' parse_constant)."""


def _non_finite_literal(raw: bytes) -> Rejection | None:
    """The 400 of a body holding a NaN or Infinity literal (outside strings), or None."""
    try:
        body = json.loads(raw, parse_constant=_NonFinite)
    except (ValueError, RecursionError):
        return None  # not JSON at all: the schema's parse says so
    path = _find_non_finite(body, "")
    if path is None:
        return None
    literal, param = path
    where = f"{param}: " if param else ""
    return Rejection.invalid(f"{where}{literal} is not valid JSON: numbers must be finite", param or None)


def _find_non_finite(value: Any, path: str) -> tuple[str, str] | None:
    stack = [(value, path)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, _NonFinite):
            return str(value), path
        if isinstance(value, dict):
            stack += [(v, f"{path}.{k}" if path else k) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(v, f"{path}[{i}]") for i, v in reversed(list(enumerate(value)))]
    return None


def _field_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _TYPE_TAG.search(part):
            path += f".{part}" if path else part
    return path


def tokenize(tokenizer, text: str, **kwargs: Any) -> list[int]:
    """tokenizer.encode(text), marked in the request's trace: parsing ends, then tokenizing."""
    mark_phase("parse")
    ids = tokenizer.encode(text, **kwargs)
    mark_phase("tokenize")
    return ids


def plan_completion(req: SamplingFields, prompts: list[list[int]], *, vocab_size: int,
                    max_model_len: int, config: ServerConfig, max_tokens: int | None,
                    logprobs: int | None, prompt_param: str, grammar: GrammarSpec | None = None,
                    echo_logprobs: int | None = None, stop_param: str = "stop",
                    **plan_fields: Any) -> RequestPlan | Rejection:
    """Shared checks and SamplingParams for a parsed request whose prompts are tokenized; grammar:
    the checked constraint of the reply (tallow/serve/structured.py). echo_logprobs: the top k of
    the prompt's logprobs that /v1/completions' echo shows. stop_param: the request's name for its
    stop strings (Anthropic's stop_sequences)."""
    for name in ("truncate_prompt_tokens", "allowed_token_ids", "bad_words", "use_beam_search",
                 "return_tokens_as_token_ids"):
        if getattr(req, name, None) not in (None, False):
            return Rejection.invalid(f"{name} is not supported by this server (send the request without it)", name)
    if req.n > config.max_n:
        return Rejection.invalid(f"n must be at most {config.max_n}, got {req.n}", "n")
    if req.best_of is not None and req.best_of != req.n:
        if req.best_of < req.n:
            return Rejection.invalid(f"best_of ({req.best_of}) must be at least n ({req.n})", "best_of")
        return Rejection.invalid(f"best_of greater than n is not supported (got best_of = {req.best_of}, "
                                 f"n = {req.n}): ask for n choices and pick among them", "best_of")
    if logprobs is not None and logprobs > config.max_top_logprobs:
        param = "top_logprobs" if prompt_param == "messages" else "logprobs"
        return Rejection.invalid(f"{param} must be at most {config.max_top_logprobs}, got {logprobs}", param)
    asked = req.prompt_logprobs
    if asked is not None:
        if asked > config.max_top_logprobs:
            return Rejection.invalid(f"prompt_logprobs must be at most {config.max_top_logprobs}, got {asked}",
                                     "prompt_logprobs")
        if req.stream:
            return Rejection.invalid("prompt_logprobs is not available when stream is true", "prompt_logprobs")
    engine_prompt_logprobs = max((k for k in (asked, echo_logprobs) if k is not None), default=None)
    if engine_prompt_logprobs is not None and req.n > 1:
        what = "prompt_logprobs" if asked is not None else "echo with logprobs"
        return Rejection.invalid(f"{what} needs n = 1 (the prompt is scored once), got n = {req.n}", "n")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > config.max_stop_strings:
        return Rejection.invalid(f"{stop_param} holds at most {config.max_stop_strings} strings, got {len(stop)}",
                                 stop_param)
    if any(not s for s in stop):
        return Rejection.invalid(f"{stop_param}: the strings must not be empty", stop_param)
    logit_bias = _logit_bias(req.logit_bias, vocab_size, config.max_logit_bias)
    if isinstance(logit_bias, Rejection):
        return logit_bias
    if any(not 0 <= t < vocab_size for t in req.stop_token_ids or []):
        return Rejection.invalid(f"stop_token_ids must be token ids below {vocab_size}", "stop_token_ids")
    if max_tokens is not None and req.min_tokens > max_tokens:
        return Rejection.invalid(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})",
                                 "min_tokens")
    if req.stream_options is not None and not req.stream:
        # OpenAI's and vLLM's answer (null stream_options is no stream_options)
        return Rejection.invalid("Stream options can only be defined when `stream=True`.", "stream_options")

    clamped = []
    for ids in prompts:
        room = max_model_len - len(ids)
        if room < 1:
            return Rejection.invalid(
                f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                f"{len(ids)} tokens, which leaves no room for a completion. Shorten the prompt.",
                prompt_param, code="context_length_exceeded")
        if req.min_tokens > room:
            # Else the reply would run to the end of the context ignoring eos (max_tokens or not).
            return Rejection.invalid(
                f"min_tokens ({req.min_tokens}) must not exceed the room the context leaves for the completion "
                f"({room} tokens: this model's maximum context length is {max_model_len} tokens and the prompt "
                f"has {len(ids)})", "min_tokens")
        clamped.append(room if max_tokens is None else min(max_tokens, room))

    try:
        params = SamplingParams(
            n=req.n, max_tokens=max(clamped),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=min(max(req.top_k or 0, 0), vocab_size), min_p=req.min_p, repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            logit_bias=logit_bias, seed=req.seed, stop=stop, stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logprobs=logprobs,
            prompt_logprobs=engine_prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, grammar=grammar, speculative=req.speculative)
    except TallowError as e:
        return Rejection.from_error(e)
    options = req.stream_options
    return RequestPlan(
        prompts=prompts, params=params, max_tokens=clamped, requested_max_tokens=max_tokens,
        stream=req.stream, model=req.model, include_usage=bool(req.stream and options and options.include_usage),
        continuous_usage_stats=bool(req.stream and options and options.continuous_usage_stats),
        prompt_logprobs=asked, **plan_fields)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int,
                limit: int) -> dict[int, float] | None | Rejection:
    if not bias:
        return None
    if len(bias) > limit:
        return Rejection.invalid(f"logit_bias holds at most {limit} entries, got {len(bias)}", "logit_bias")
    out = {}
    for key, value in bias.items():
        # A token id in plain ASCII decimal: int() would also take "1_000", " 7 " and "٣".
        token_id = int(key) if _TOKEN_ID.fullmatch(key) and len(key) <= 20 else -1
        if not 0 <= token_id < vocab_size:
            return Rejection.invalid(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                                     "logit_bias")
        out[token_id] = value
    return out
