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
from tallow.output.offline import OfflineRun
from tallow.output.pipeline import OutputPipeline, make_sink


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
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then {token_id: logprob}
    # for each prompt token and the top alternatives there (vLLM's shape, logprobs as floats).
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class _Choice:
    """One sequence of a generate() call: its place in the results, its pipeline, its logprobs."""

    request: RequestOutput
    index: int
    seq: Sequence
    pipeline: OutputPipeline
    logprobs: list[dict[int, float]] | None

    def add_logprobs(self, out) -> None:
        """The logprobs of the output's tokens the pipeline took."""
        if self.logprobs is None or out.logprobs is None:
            return
        for j in range(self.pipeline.taken):
            d = {out.token_ids[j]: out.logprobs[j]}
            if out.top_logprobs:
                d.update({t: lp for t, lp in out.top_logprobs[j] if t not in d})
            self.logprobs.append(d)

    def result(self) -> CompletionOutput:
        result, finish_reason = self.pipeline.finish()
        stop_reason = result.stop_string if result.stopped else self.seq.stop_token_id
        return CompletionOutput(self.index, result.content, list(self.seq.output_ids), finish_reason,
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
        run = OfflineRun(self.engine)
        choices: dict[int, _Choice] = {}  # by seq_id, in submission order
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            # BOS in front where the model wants one (Gemma, Llama 2), as /v1/completions does
            ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
            seqs = self.engine.make_sequences(ids, params, request_id=str(i))
            results.append(RequestOutput(str(i), prompt if isinstance(prompt, str) else None, ids))
            for k, seq in enumerate(seqs):
                pipeline = run.add(seq, make_sink(self.tokenizer, seq.params))
                choices[seq.seq_id] = _Choice(results[-1], k, seq, pipeline,
                                              [] if params.logprobs is not None else None)
        for seq, out, _ in run.outputs():
            choices[seq.seq_id].add_logprobs(out)
            if out.prompt_logprobs is not None:
                choices[seq.seq_id].request.prompt_logprobs = [None] + [
                    {e.token_id: e.logprob, **{t: lp for t, lp in e.top if t != e.token_id}}
                    for e in out.prompt_logprobs]
        for choice in choices.values():
            choice.request.outputs.append(choice.result())
            choice.request.num_cached_tokens = max(choice.request.num_cached_tokens, choice.seq.num_cached_tokens)
        return results

    def chat(self, messages, sampling_params: SamplingParams | None = None, *, tools=None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             allow_special_tokens_in_content: bool = False) -> list[RequestOutput]:
        """messages: one conversation (a list of {role, content}) or a list of conversations.

        Special-token strings in the messages, tools and kwargs are plain text (a message cannot
        forge a turn with "<|im_end|>"), unless allow_special_tokens_in_content.
        """
        from tallow.chat_template import ChatTemplate

        tok = self.tokenizer
        template = ChatTemplate.for_tokenizer(tok, override=self.config.chat_template)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            prompt = template.render_prompt(conv, tools=tools, add_generation_prompt=add_generation_prompt,
                                            literal_special_tokens=not allow_special_tokens_in_content,
                                            **(chat_template_kwargs or {}))
            prompts.append(tok.encode(prompt.text, literal_spans=prompt.literal_spans))
        return self.generate(prompts, sampling_params)
