"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info.

Shapes as vLLM serves them (lm-eval's `local-completions` reads them as its "remote" tokenizer:
`tokenizer_info`'s eos_token / bos_token / pad_token / chat_template, `/tokenize` with
`{"prompt", "add_special_tokens": false}`, `/detokenize` with `{"tokens"}`):

- /tokenize: `{"prompt": str}` (add_special_tokens default true) or a chat request `{"messages",
  "add_generation_prompt", "tools", "chat_template_kwargs"}` (add_special_tokens default false: the
  template writes them), rendered exactly as /v1/chat/completions renders it ->
  `{"count", "max_model_len", "tokens", "token_strs"}` (token_strs, the vocabulary entries, only
  with return_token_strs).
- /detokenize: `{"tokens": [ids]}` -> `{"prompt": text}` (special tokens kept, as transformers'
  decode does by default).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tallow.config import ServerConfig
from tallow.errors import TallowError
from tallow.serve.chat_prompt import render_chat
from tallow.serve.plan import Rejection, parse_request, tokenize
from tallow.serve.protocols.openai_schemas import ChatMessage, Int64, ToolDefinition, WireModel


class TokenizeRequest(WireModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(WireModel):
    model: str | None = None
    tokens: list[Int64]


def tokenize_request(raw: bytes, engine, config: ServerConfig) -> dict | Rejection:
    req = parse_request(raw, TokenizeRequest)
    if isinstance(req, Rejection):
        return req
    if (req.prompt is None) == (req.messages is None):
        return Rejection.invalid("give either prompt (a string) or messages (a chat), not both or neither",
                                 "prompt" if req.prompt is None else "messages")
    if req.prompt is not None:
        extra = next((f for f in ("tools", "chat_template_kwargs") if getattr(req, f) is not None), None)
        if extra is not None:
            return Rejection.invalid(f"{extra} applies to messages only", extra)
    tokenizer = engine.tokenizer
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tokenize(tokenizer, req.prompt, add_special_tokens=add_special)
    else:
        if req.continue_final_message and req.add_generation_prompt:
            return Rejection.invalid("continue_final_message and add_generation_prompt cannot both be true "
                                     "(set add_generation_prompt to false)", "continue_final_message")
        if len(req.messages) > config.max_messages:
            return Rejection.invalid(f"messages holds at most {config.max_messages} entries", "messages")
        tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
        try:
            prompt = render_chat(engine.chat_template, [m.to_template() for m in req.messages], config,
                                 tools=tools, template_kwargs=req.chat_template_kwargs,
                                 add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message)
        except TallowError as e:
            return Rejection.from_error(e)
        ids = tokenize(tokenizer, prompt.text, add_special_tokens=bool(req.add_special_tokens),
                       literal_spans=prompt.literal_spans)
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
            "token_strs": [tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None}


def detokenize_request(raw: bytes, engine) -> dict | Rejection:
    req = parse_request(raw, DetokenizeRequest)
    if isinstance(req, Rejection):
        return req
    vocab_size = engine.model_config.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab_size), None)
    if bad is not None:
        return Rejection.invalid(f"tokens[{bad}]: token ids must be in [0, {vocab_size}), got {req.tokens[bad]}",
                                 f"tokens[{bad}]")
    return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def tokenizer_info(engine) -> dict:
    """What vLLM's /tokenizer_info gives (a tokenizer's init settings and its chat template); lm-eval
    reads eos_token, bos_token, pad_token and chat_template."""
    tokenizer = engine.tokenizer

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.id_to_token(token_id)

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        "pad_token": text(tokenizer.pad_token_id),
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "add_bos_token": tokenizer.add_bos,
        "model_max_length": engine.max_model_len,
        "vocab_size": engine.model_config.vocab_size,
        "chat_template": getattr(engine.chat_template, "source", None) or tokenizer.chat_template,
    }

