"""LLM: the offline Python API, in the shape vLLM users know.

    from tallow import LLM, SamplingParams
    llm = LLM("default")
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from tallow.config import EngineConfig
from tallow.engine.core import EngineCore
from tallow.engine.request import Sequence
from tallow.engine.sampling import SamplingParams
from tallow.output.detokenizer import Detokenizer
from tallow.output.stop import StopMatcher


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # Per generated token: {token_id: logprob} for the chosen token and its top alternatives.
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0


class _Collector:
    """Turns one sequence's tokens into text with the serving path's detokenizer and stop matcher."""

    def __init__(self, seq: Sequence, tokenizer, index: int):
        p = seq.params
        self.seq = seq
        self.index = index
        self.detok = Detokenizer(tokenizer.token_bytes, tokenizer.special_token_ids, p.skip_special_tokens)
        self.stopper = StopMatcher(p.stop, p.include_stop_str_in_output)
        self.text = ""
        self.logprobs: list[dict[int, float]] | None = [] if p.logprobs is not None else None
        self.finish_reason: str | None = None

    def push(self, out) -> bool:
        """Returns True when a stop string ended the sequence."""
        for j, tok in enumerate(out.token_ids):
            if self.logprobs is not None and out.logprobs is not None:
                d = {tok: out.logprobs[j]}
                if out.top_logprobs:
                    d.update({i: lp for i, lp in out.top_logprobs[j] if i not in d})
                self.logprobs.append(d)
            if not self.stopper.stopped:
                self.text += self.stopper.push(self.detok.push(tok))
        if self.stopper.stopped:
            self.finish_reason = "stop"
            return True
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.text += self.stopper.push(self.detok.flush())
            if not self.stopper.stopped:
                self.text += self.stopper.flush()
        return False

    def result(self) -> CompletionOutput:
        seq = self.seq
        stop_reason = self.stopper.matched if self.stopper.stopped else seq.stop_token_id
        return CompletionOutput(self.index, self.text, list(seq.output_ids), self.finish_reason,
                                stop_reason, self.logprobs)


class LLM:
    def __init__(self, model: str = "default", **engine_kwargs):
        names = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_kwargs) - names
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        self.config = EngineConfig(model=model, **engine_kwargs)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token ids, or a list of token-id lists."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params list must match prompts in length")
        results: list[RequestOutput] = []
        collectors: dict[int, _Collector] = {}
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            seqs = self.engine.make_sequences(ids, params, request_id=str(i))
            results.append(RequestOutput(str(i), prompt if isinstance(prompt, str) else None, ids))
            for k, seq in enumerate(seqs):
                collectors[seq.seq_id] = _Collector(seq, self.tokenizer, k)
                self.engine.add(seq)
        pending = dict(collectors)
        while pending:
            for seq, out in self.engine.step():
                col = pending.get(seq.seq_id)
                if col is None:
                    continue
                if col.push(out):
                    self.engine.abort(seq)
                if col.finish_reason is not None:
                    del pending[seq.seq_id]
            if pending and not self.engine.has_work():
                raise RuntimeError("engine idle with unfinished sequences")
        by_request: dict[str, list[CompletionOutput]] = {}
        for col in collectors.values():
            by_request.setdefault(col.seq.request_id.split("-")[0], []).append(col.result())
        for r in results:
            r.outputs = sorted(by_request[r.request_id], key=lambda c: c.index)
            r.num_cached_tokens = max((c.seq.num_cached_tokens for c in collectors.values()
                                       if c.seq.request_id.split("-")[0] == r.request_id), default=0)
        return results

    def chat(self, messages, sampling_params: SamplingParams | None = None, *, tools=None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """messages: one conversation (a list of {role, content}) or a list of conversations."""
        from tallow.chat_template import ChatTemplate

        tok = self.tokenizer
        template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = template.render(conv, tools=tools, add_generation_prompt=add_generation_prompt,
                                   **(chat_template_kwargs or {}))
            prompts.append(tok.encode(text))
        return self.generate(prompts, sampling_params)
