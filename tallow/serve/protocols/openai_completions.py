"""OpenAI (legacy) Completions: POST /v1/completions."""

from __future__ import annotations

from tallow.config import ServerConfig
from tallow.serve.executor import ChoiceUpdate, CompletionSummary, TokenLogprob, Usage
from tallow.serve.plan import Rejection, RequestPlan, parse_request, plan_completion, tokenize
from tallow.serve import structured
from tallow.serve.protocols.base import DONE, OpenAIChunks, StreamProtocol, finite, to_json
from tallow.output.events import ContentEvent
from tallow.serve.protocols.openai_schemas import CompletionRequest


class OpenAICompletions(OpenAIChunks, StreamProtocol):
    """Text completions; choice i answers prompt i // n. Echo prepends the prompt's text, and with
    logprobs the prompt tokens' logprobs (the first token's null, as OpenAI's legacy API gave them)."""

    id_prefix = "cmpl-"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the prompt as sent (a text prompt) or its tokens' text (token ids), as vLLM echoes it
        strings = self.plan.prompt_strings or [None] * len(self.plan.prompts)
        self.prompt_texts = [("" if not self.plan.echo else text if text is not None
                              else self.tokenizer.decode(ids, skip_special_tokens=False))
                             for ids, text in zip(self.plan.prompts, strings)]
        # Legacy logprobs give each token's character offset into the choice's text.
        self.text_offsets = [len(self.prompt_texts[i // self.plan.params.n]) for i in range(self.num_choices)]
        # Streaming echo with logprobs: the prompt's chunk waits for the choice's first update,
        # which brings the prompt logprobs.
        self.echo_logprobs = self.plan.echo and self.plan.params.logprobs is not None
        self._echo_unsent = set(range(self.num_choices)) if self.echo_logprobs else set()

    @classmethod
    def plan_request(cls, raw: bytes, engine, config: ServerConfig) -> RequestPlan | Rejection:
        req = parse_request(raw, CompletionRequest)
        if isinstance(req, Rejection):
            return req
        if req.suffix is not None:
            return Rejection.invalid("suffix is not supported", "suffix")
        max_tokens = req.max_tokens if "max_tokens" in req.model_fields_set else 16
        score_only = max_tokens == 0
        if score_only and not req.echo:
            return Rejection.invalid("max_tokens must be at least 1 (0 only with echo: the prompt is scored, "
                                     "nothing generated)", "max_tokens")
        given = _prompts(req.prompt)
        count = len(given)
        if count > config.max_prompts:
            return Rejection.invalid(f"prompt holds at most {config.max_prompts} prompts (--max-prompts), got {count}",
                                     "prompt")
        # a text with BOS in front where the model wants one, unless add_special_tokens is false
        prompts = [tokenize(engine.tokenizer, p, add_special_tokens=req.add_special_tokens) if isinstance(p, str)
                   else list(p) for p in given]
        vocab_size = engine.model_config.vocab_size
        if not prompts or any(not ids for ids in prompts):
            return Rejection.invalid("prompt must not be empty", "prompt")
        if any(not 0 <= t < vocab_size for ids in prompts for t in ids):
            return Rejection.invalid(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        grammar = structured.grammar_for(
            structured.one_format([structured.response_format(req.response_format), *structured.vllm_formats(req)]),
            engine.tokenizer)
        if isinstance(grammar, Rejection):
            return grammar
        return plan_completion(
            req, prompts, vocab_size=vocab_size, max_model_len=engine.max_model_len, config=config,
            max_tokens=1 if score_only else max_tokens, logprobs=req.logprobs, prompt_param="prompt",
            echo_logprobs=req.logprobs if req.echo else None, echo=req.echo, score_only=score_only,
            prompt_strings=[p if isinstance(p, str) else None for p in given] if req.echo else None,
            grammar=grammar)

    # ---- streaming ------------------------------------------------------------------
    def start(self) -> list[str]:
        if not self.plan.echo or self.echo_logprobs:
            return []
        return [self._chunk([self._choice(i, self.prompt_texts[i // self.plan.params.n])])
                for i in range(self.num_choices)]

    def add_events(self, update: ChoiceUpdate, usage: Usage) -> list[str]:
        frames = []
        if update.index in self._echo_unsent:
            self._echo_unsent.discard(update.index)
            echo = self._prompt_logprobs_legacy(update.index, update.prompt_logprobs)
            frames.append(self._chunk([self._choice(update.index, self.prompt_texts[update.index // self.plan.params.n],
                                                    echo)]))
        text = "".join(e.text for e in update.events if isinstance(e, ContentEvent))
        if not text and update.finish_reason is None and not update.logprobs:
            return frames
        logprobs = self._logprobs(update.index, update.logprobs)
        return frames + [self._chunk([self._choice(update.index, text, logprobs, update.finish_reason)], usage)]

    def finish(self, usage: Usage) -> list[str]:
        frames = [self._chunk([], usage, final=True)] if self.plan.include_usage else []
        return frames + [DONE]

    def _chunk(self, choices: list[dict], usage: Usage | None = None, final: bool = False) -> str:
        return self.chunk_frame("text_completion", to_json(choices), usage, final)

    @staticmethod
    def _choice(index: int, text: str, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    # ---- one body ---------------------------------------------------------------------
    def response(self, summary: CompletionSummary) -> dict:
        n = self.plan.params.n
        choices = []
        for c in summary.choices:
            logprobs = None
            if self.echo_logprobs:
                logprobs = _joined(self._prompt_logprobs_legacy(c.index, c.prompt_logprobs),
                                   self._logprobs(c.index, c.logprobs or []))
            else:
                logprobs = self._logprobs(c.index, c.logprobs or [])
            choice = self._choice(c.index, self.prompt_texts[c.index // n] + c.content, logprobs, c.finish_reason)
            if self.plan.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.prompt_logprobs_vllm(c.prompt_logprobs)
            choices.append(choice)
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.model_name, "choices": choices, "usage": summary.usage.to_openai()}

    def _prompt_logprobs_legacy(self, index: int, entries: list | None) -> dict:
        """The echoed prompt's part of a choice's legacy logprobs: its tokens, their logprobs (the
        first null) and top logprobs, and their offsets from the start of the text."""
        ids = self.plan.prompts[index // self.plan.params.n]
        entries = entries or []
        k = self.plan.params.logprobs

        def text(token_id: int) -> str:
            return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

        tokens, offsets, offset = [], [], 0
        for token_id in ids:
            tokens.append(text(token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        # (entries is shorter than the prompt only when the choice failed before its first token)
        missing = [None] * (len(ids) - 1 - len(entries))
        token_logprobs = [None] + [finite(e.logprob) for e in entries] + missing
        top = [None] + [_top(text, e.token_id, e.logprob, e.top[:k]) for e in entries] + missing
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _logprobs(self, index: int, entries: list[TokenLogprob]) -> dict | None:
        if self.plan.params.logprobs is None:
            return None
        tokens, offsets = [], []
        for entry in entries:
            tokens.append(self.token_text(entry.token_id))
            offsets.append(self.text_offsets[index])
            self.text_offsets[index] += len(tokens[-1])
        top = [_top(self.token_text, e.token_id, e.logprob, e.top) for e in entries]
        return {"tokens": tokens, "token_logprobs": [finite(e.logprob) for e in entries],
                "top_logprobs": top, "text_offset": offsets}


def _top(text, token_id: int, logprob: float, top) -> dict:
    """A position's legacy top_logprobs: the chosen token first, then the top k, by their text (up
    to k + 1 entries: "the API will always return the logprob of the sampled token", as OpenAI's
    and vLLM's; logprobs 0 gives the chosen token alone)."""
    entries = {text(token_id): finite(logprob)}
    for t, lp in top:
        entries.setdefault(text(t), finite(lp))
    return entries


def _joined(first: dict, then: dict | None) -> dict:
    """Two legacy logprobs objects of consecutive tokens as one."""
    if then is None:
        return first
    return {key: first[key] + then[key] for key in first}


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """Every accepted prompt shape as a list of prompts, each a text or token ids (a list of token
    ids is one prompt)."""
    return [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
