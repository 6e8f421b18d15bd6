"""LLM: the offline Python API, in the shape vLLM users know.

    from tallow import LLM, SamplingParams
    llm = LLM("default")
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)

Prompts are vLLM's: a string, a list of token ids, a TextPrompt {"prompt": "..."} or a
TokensPrompt {"prompt_token_ids": [...]}, alone or in a list. Logprobs are vLLM's shape: per
position a {token_id: Logprob} dict, the chosen token first.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from tallow.config import EngineConfig
from tallow.engine.core import EngineCore
from tallow.engine.grammar import GrammarError, check_grammar
from tallow.engine.request import Sequence
from tallow.engine.sampling import SamplingParams, SamplingParamsError
from tallow.errors import TallowError
from tallow.output.offline import OfflineRun
from tallow.output.pipeline import OutputPipeline, make_sink

# The keys of vLLM's TextPrompt / TokensPrompt that tallow honours ("prompt" beside
# "prompt_token_ids" is the text the ids came from: it is reported as RequestOutput.prompt).
_PROMPT_KEYS = ("prompt", "prompt_token_ids")

# vLLM's LLM(...) options that change nothing in tallow: accepted and ignored (as tallow/cli.py's
# ACCEPTED_NO_OPS for the server's flags). tokenizer and tokenizer_mode are checked in LLM.__init__.
ACCEPTED_NO_OPS = {
    "trust_remote_code": "tallow runs no code from model folders",
    "swap_space": "tallow does not swap the KV cache to the CPU",
    "disable_log_stats": "tallow logs no periodic stats",
    "download_dir": "tallow loads local models or the embedded default (cache_dir holds its caches)",
}


class RequestError(TallowError, RuntimeError):
    """A request of a generate() / chat() call that the engine ended with finish_reason "error"
    (a grammar that failed while decoding, an engine step that failed). The message names each
    failed request and its reason; .outputs holds every RequestOutput of the call (the failed
    ones too, finish_reason "error"), so the other requests' results are not lost."""

    def __init__(self, message: str, outputs: list):
        super().__init__(message, status=500, type="server_error")
        self.outputs = outputs


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log-probability at a position (vLLM's vllm.sequence.Logprob).

    rank: 1-based, in the whole distribution (1: the most likely). The top-k alternatives rank
    1..k by their place in the top list, as vLLM's, and so does a chosen token among them.
    Outside the top list, a prompt token has the engine's rank (1 + the tokens strictly more
    likely) and a sampled token None: tallow's sampler does not compute a sampled token's rank.
    decoded_token: the token decoded alone (skip_special_tokens=False).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # Per generated token: {token_id: Logprob} for the chosen token (first) and its top alternatives.
    logprobs: list[dict[int, Logprob]] | None = None
    # The sum of the chosen tokens' logprobs when logprobs were asked (SamplingParams.logprobs), else None.
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then {token_id: Logprob}
    # for each prompt token (first) and the top alternatives there (vLLM's shape).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = True  # generate() returns finished requests only


class _Decoder:
    """decoded_token of Logprobs: each token id decoded alone (as vLLM does), once per call."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def position(self, token_id: int, logprob: float, rank: int | None,
                 top: list[tuple[int, float]] | None) -> dict[int, Logprob]:
        """One position's {token_id: Logprob}: the chosen token first, then the top list, whose
        entries rank by their place in it (vLLM's: a chosen token in the top list takes that rank)."""
        d = {token_id: Logprob(logprob, rank, self(token_id))}
        for place, (t, lp) in enumerate(top or (), 1):
            d[t] = Logprob(lp, place, self(t))
        return d


@dataclass
class _Choice:
    """One sequence of a generate() call: its place in the results, its pipeline, its logprobs."""

    request: RequestOutput
    index: int
    seq: Sequence
    pipeline: OutputPipeline
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None

    def add_logprobs(self, out, decoder: _Decoder) -> None:
        """The logprobs of the output's tokens the pipeline took. The engine gives no rank for a
        sampled token (tallow/engine/sampler.py), so the chosen token's is None unless the top
        list holds it."""
        if self.logprobs is None or out.logprobs is None:
            return
        for j in range(self.pipeline.taken):
            lp = out.logprobs[j]
            self.logprobs.append(decoder.position(out.token_ids[j], lp, None,
                                                  out.top_logprobs[j] if out.top_logprobs else None))
            self.cumulative_logprob += lp

    def result(self) -> CompletionOutput:
        result, finish_reason = self.pipeline.finish()
        # vLLM's: the stop string, or the stop_token_ids token that ended it; None for EOS
        token = self.seq.stop_token_id
        if token is not None and not self.seq.params.ignore_eos and token in self.seq.eos_token_ids:
            token = None
        stop_reason = result.stop_string if result.stopped else token
        return CompletionOutput(self.index, result.content, list(self.seq.output_ids), finish_reason,
                                stop_reason, self.logprobs, self.cumulative_logprob)


def _token_ids(ids, where: str) -> list[int]:
    try:
        return [operator.index(t) for t in ids]
    except TypeError:
        raise TypeError(f"{where}: token ids must be integers") from None


def _parse_prompt(prompt) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of one prompt; exactly one is None unless a TokensPrompt has both."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        unknown = [k for k in prompt if k not in _PROMPT_KEYS]
        if unknown:
            raise ValueError(f"prompt key(s) {', '.join(map(repr, unknown))} not supported: tallow's LLM takes "
                             '{"prompt": str} (TextPrompt) or {"prompt_token_ids": [int, ...]} (TokensPrompt)')
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f'a prompt dict\'s "prompt" must be a string, not {type(text).__name__}')
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                raise TypeError('"prompt_token_ids" must be a list of token ids')
            return text, _token_ids(ids, '"prompt_token_ids"')
        if text is None:
            raise ValueError('a prompt dict needs "prompt" (TextPrompt) or "prompt_token_ids" (TokensPrompt)')
        return text, None
    return None, _token_ids(prompt, "prompt")


def _parse_prompts(prompts) -> list[tuple[str | None, list[int] | None]]:
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    return [_parse_prompt(p) for p in prompts]


def _check_lora(lora_request) -> None:
    if lora_request is not None:
        raise ValueError("LoRA is not supported by tallow: lora_request must be None")


class LLM:
    def __init__(self, model: str = "default", **engine_kwargs):
        """model and engine_kwargs: EngineConfig's fields. vLLM's trust_remote_code, swap_space,
        disable_log_stats and download_dir are accepted and change nothing (ACCEPTED_NO_OPS);
        tokenizer must be None or the model itself, tokenizer_mode "auto" (tallow always uses the
        model's own tokenizer)."""
        for name in ACCEPTED_NO_OPS:
            engine_kwargs.pop(name, None)
        tokenizer = engine_kwargs.pop("tokenizer", None)
        if tokenizer is not None and tokenizer != model:
            raise ValueError(f"tokenizer={tokenizer!r}: tallow uses the model's own tokenizer; another one "
                             "would change what the token ids mean (leave tokenizer unset)")
        tokenizer_mode = engine_kwargs.pop("tokenizer_mode", "auto")
        if tokenizer_mode != "auto":
            raise ValueError(f"tokenizer_mode={tokenizer_mode!r}: tallow has one tokenizer implementation "
                             "(tokenizer_mode 'auto' only)")
        names = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_kwargs) - names
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        self.config = EngineConfig(model=model, **engine_kwargs)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self) -> "TokenizerView":
        """The model's tokenizer with the methods vLLM scripts call on theirs (transformers')."""
        return TokenizerView(self)

    def _check_params(self, params: SamplingParams, where: str) -> None:
        """What SamplingParams cannot check alone: token ids in the vocabulary, and the grammar
        (compiled here, as the server's planning does: an error before anything runs)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{where}: sampling_params must be SamplingParams, not {type(params).__name__}")
        vocab = self.engine.model_config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            bad = sorted(t for t in ids if not 0 <= t < vocab)
            if bad:
                raise SamplingParamsError(f"{where}: token id(s) {bad} in {name} are outside the vocabulary "
                                          f"(0..{vocab - 1})", param=name)
        if params.grammar is not None:
            try:
                check_grammar(params.grammar, self.tokenizer)
            except GrammarError as e:
                raise GrammarError(f"{where}: the grammar ({params.grammar.kind}) cannot be used: {e}") from None

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool | Callable = True, lora_request=None) -> list[RequestOutput]:
        """Run every prompt to the end: a RequestOutput per prompt, in order.

        prompts: one prompt or a list of them, each a string, a list of token ids, a TextPrompt
        {"prompt": str} or a TokensPrompt {"prompt_token_ids": [int, ...]} (vLLM's; any other key,
        such as multi_modal_data, is a ValueError). A string is tokenized with the model's special
        tokens (BOS where it wants one); token ids are used as given.
        sampling_params: one for every prompt, or a list with one per prompt.
        use_tqdm: accepted for vLLM's signature and ignored (tallow draws no progress bar).
        lora_request: None only (tallow has no LoRA).
        """
        _check_lora(lora_request)
        parsed = _parse_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                       else [sampling_params] * len(parsed))
        if len(params_list) != len(parsed):
            raise ValueError("sampling_params list must match prompts in length")
        results: list[RequestOutput] = []
        requests = []
        checked: set[int] = set()
        for i, params in enumerate(params_list):
            if id(params) not in checked:
                self._check_params(params, f"request {i}")
                checked.add(id(params))
        # Every prompt is checked (make_sequences) before any reaches the engine.
        for i, ((text, ids), params) in enumerate(zip(parsed, params_list)):
            if ids is None:
                # BOS in front where the model wants one (Gemma, Llama 2), as /v1/completions does
                ids = self.tokenizer.encode(text, add_special_tokens=True)
            requests.append((params, self.engine.make_sequences(ids, params, request_id=str(i))))
            results.append(RequestOutput(str(i), text, ids))
        run = OfflineRun(self.engine)
        choices: dict[int, _Choice] = {}  # by seq_id, in submission order
        try:
            for result, (params, seqs) in zip(results, requests):
                asked = params.logprobs is not None
                for k, seq in enumerate(seqs):
                    pipeline = run.add(seq, make_sink(self.tokenizer, seq.params))
                    choices[seq.seq_id] = _Choice(result, k, seq, pipeline, [] if asked else None,
                                                  0.0 if asked else None)
        except BaseException:
            for choice in choices.values():  # a prompt the engine refused: none of the call runs
                self.engine.abort(choice.seq)
            raise
        decoder = _Decoder(self.tokenizer)
        errors: dict[int, str] = {}  # seq_id: why the engine ended it with "error"
        for seq, out, _ in run.outputs():
            choice = choices[seq.seq_id]
            if out.finish_reason == "error":
                errors[seq.seq_id] = out.error or "the engine failed it"
            choice.add_logprobs(out, decoder)
            if out.prompt_logprobs is not None:
                choice.request.prompt_logprobs = [None] + [
                    decoder.position(e.token_id, e.logprob, e.rank, e.top) for e in out.prompt_logprobs]
        for choice in choices.values():
            choice.request.outputs.append(choice.result())
            choice.request.num_cached_tokens = max(choice.request.num_cached_tokens, choice.seq.num_cached_tokens)
        if errors:
            # The whole call's results go with the error (the others ran to their end).
            raise RequestError("; ".join(f"request {choices[s].request.request_id} (choice {choices[s].index}) "
                                         f"failed: {why}" for s, why in errors.items()), results)
        return results

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | Callable = True, lora_request=None, chat_template: str | None = None, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools=None,
             chat_template_kwargs: dict | None = None,
             allow_special_tokens_in_content: bool = False) -> list[RequestOutput]:
        """messages: one conversation (a list of {role, content}) or a list of conversations.

        chat_template: a jinja template's text or a file's path, used instead of the model's (and
        of EngineConfig.chat_template) for this call. continue_final_message: the prompt ends where
        the last message's text ends, for the model to continue it (an assistant prefill); it needs
        add_generation_prompt=False (both true is a ValueError, as vLLM's). use_tqdm is ignored
        (no progress bar); lora_request must be None.

        Special-token strings in the messages, tools and kwargs are plain text (a message cannot
        forge a turn with "<|im_end|>"), unless allow_special_tokens_in_content.
        """
        _check_lora(lora_request)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                             "(set add_generation_prompt=False)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text, ids = self._render_chat(conv, chat_template, tools=tools, add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message,
                                          literal_special_tokens=not allow_special_tokens_in_content,
                                          **(chat_template_kwargs or {}))
            # The rendered text is RequestOutput.prompt (vLLM's); the ids are what it tokenized to.
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _render_chat(self, conversation, chat_template: str | None, **kwargs) -> tuple[str, list[int]]:
        """One conversation through the chat template (chat_template, else EngineConfig's, else the
        model's): the prompt text and its ids (client text holding special tokens' strings kept text
        unless literal_special_tokens=False)."""
        from tallow.chat_template import ChatTemplate

        override = chat_template if chat_template is not None else self.config.chat_template
        prompt = ChatTemplate.for_tokenizer(self.tokenizer, override=override).render_prompt(list(conversation),
                                                                                           **kwargs)
        return prompt.text, self.tokenizer.encode(prompt.text, literal_spans=prompt.literal_spans)


class TokenizerView:
    """LLM.get_tokenizer(): the model's tokenizer with transformers' methods that vLLM scripts use.
    encode() adds the model's special tokens (BOS where it wants one) unless add_special_tokens=False;
    apply_chat_template renders with the LLM's chat template (EngineConfig.chat_template or the
    model's). .tokenizer is tallow's own Tokenizer."""

    def __init__(self, llm: LLM):
        self._llm = llm
        self.tokenizer = llm.tokenizer

    def __getattr__(self, name: str):
        # eos_token_id, bos_token_id, eos_token, bos_token, vocab_size, ...: the Tokenizer's own
        return getattr(self.__dict__["tokenizer"], name)

    @property
    def pad_token_id(self) -> int | None:
        return getattr(self.tokenizer, "pad_token_id", None)

    @property
    def chat_template(self) -> str | None:
        return self._llm.config.chat_template or self.tokenizer.chat_template

    def __len__(self) -> int:
        return self.tokenizer.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True, **_) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = False, **_) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False, **_) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def __call__(self, text, add_special_tokens: bool = True, **_) -> dict:
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.tokenizer.id_to_token(ids)
        return [self.tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.tokenizer.token_to_id(tokens)
        return [self.tokenizer.token_to_id(t) for t in tokens]

    def apply_chat_template(self, conversation, tools=None, *, tokenize: bool = True,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            chat_template: str | None = None, **kwargs):
        """transformers' defaults (tokenize=True, add_generation_prompt=False); other keyword
        arguments reach the template (enable_thinking=...)."""
        text, ids = self._llm._render_chat(conversation, chat_template, tools=tools,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, **kwargs)
        return ids if tokenize else text
