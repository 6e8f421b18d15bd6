"""Streamed frames of the OpenAI protocols: the directly written JSON (a chunk's constant head
rendered once, a content delta and the usage written by hand) is byte for byte what
json.dumps of the whole chunk gives, for every usage option and for awkward text."""

import json

import pytest

from tallow.engine.sampling import SamplingParams
from tallow.serve.executor import ChoiceUpdate, TokenLogprob, Usage
from tallow.serve.plan import RequestPlan
from tallow.serve.protocols.openai_chat import OpenAIChat
from tallow.serve.protocols.openai_completions import OpenAICompletions
from tallow.output.events import ContentEvent, ReasoningEvent

TEXTS = ["Hello", ' say "hi"\\n', "line\nbreak\ttab\r", "\x00\x1f\x7f", "héllo wörld", "日本語 ✓",
         "😀 \U0001f680", "\u2028\u2029", "</script>", ""]


def reference(payload: dict) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def chunk(request_id, object_name, model, created, choices, plan, usage, final=False):
    payload = {"id": request_id, "object": object_name, "created": created, "model": model, "choices": choices}
    if plan.include_usage or plan.continuous_usage_stats:
        show = final or plan.continuous_usage_stats
        payload["usage"] = usage.to_openai() if show else None
    return reference(payload)


class Tokens:
    special_token_ids = frozenset()

    @staticmethod
    def token_bytes(token_id):
        return bytes([token_id % 256])


@pytest.mark.parametrize("include_usage,continuous", [(False, False), (True, False), (True, True), (False, True)])
@pytest.mark.parametrize("model", ["m", 'we"ird/módel\\name'])
def test_chat_frames_are_the_json_of_their_chunk(include_usage, continuous, model):
    plan = RequestPlan([[1, 2, 3]], SamplingParams(), [16], None, stream=True, include_usage=include_usage,
                       continuous_usage_stats=continuous)
    protocol = OpenAIChat(plan, model, Tokens(), 'chatcmpl-"x"')
    usage = Usage(prompt_tokens=3, completion_tokens=0, cached_tokens=2)
    for k, text in enumerate(TEXTS):
        usage.completion_tokens = k + 1
        frames = protocol.add_events(ChoiceUpdate(0, [ContentEvent(text)], []), usage)
        assert frames == [chunk(protocol.request_id, "chat.completion.chunk", model, protocol.created,
                                [{"index": 0, "delta": {"content": text}, "logprobs": None,
                                  "finish_reason": None}], plan, usage)]
        assert json.loads(frames[0].removeprefix("data: "))["choices"][0]["delta"]["content"] == text
    # the general path (reasoning, several events, the last update) renders the same way
    frames = protocol.add_events(ChoiceUpdate(0, [ReasoningEvent("a\"b"), ContentEvent("ü")], [], "stop"), usage)
    assert frames == [
        chunk(protocol.request_id, "chat.completion.chunk", model, protocol.created,
              [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}], plan, usage)
        for delta, reason in [({"reasoning_content": 'a"b', "reasoning": 'a"b'}, None), ({"content": "ü"}, None),
                              ({}, "stop")]]
    assert protocol.finish(usage)[-1] == "data: [DONE]\n\n"
    if include_usage:
        assert protocol.finish(usage)[0] == chunk(protocol.request_id, "chat.completion.chunk", model,
                                                  protocol.created, [], plan, usage, final=True)


def test_chat_frames_with_logprobs_keep_them():
    plan = RequestPlan([[1]], SamplingParams(logprobs=0), [16], None, stream=True)
    protocol = OpenAIChat(plan, "m", Tokens(), "chatcmpl-1")
    frames = protocol.add_events(ChoiceUpdate(0, [ContentEvent("A")], [TokenLogprob(65, -0.5, [])]), Usage())
    content = json.loads(frames[0].removeprefix("data: "))["choices"][0]["logprobs"]["content"]
    assert content == [{"token": "A", "logprob": -0.5, "bytes": [65], "top_logprobs": []}]


@pytest.mark.parametrize("include_usage,continuous", [(False, False), (True, True)])
def test_completion_frames_are_the_json_of_their_chunk(include_usage, continuous):
    plan = RequestPlan([[1, 2]], SamplingParams(), [16], None, stream=True, include_usage=include_usage,
                       continuous_usage_stats=continuous)
    protocol = OpenAICompletions(plan, "m", Tokens(), "cmpl-1")
    usage = Usage(prompt_tokens=2, completion_tokens=1)
    for text in TEXTS[:-1]:
        frames = protocol.add_events(ChoiceUpdate(0, [ContentEvent(text)], []), usage)
        assert frames == [chunk("cmpl-1", "text_completion", "m", protocol.created,
                                [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}], plan, usage)]
