"""ToolCallRouter: a TokenRouter that withholds tool-call markup and hands it to a ToolParser.

The router streams content live and holds back only what may still turn out to be markup:
a tail that may begin a start tag, and the whitespace before it. Markup is withheld until the
parser decides: well-formed calls become ToolCalls (arguments as compact JSON), anything else
goes back into the content, in place. Every decision depends only on the text seen so far, so
the result is the same however the text is cut into tokens.

Arguments stream as the model writes them: while the parser has not decided, its partial()
names the calls whose opening is unambiguous (name complete, argument section opened) and the
arguments JSON certain so far; each new call goes out as a header delta (id, name), then its
arguments as they grow. A call so announced stays a call: when the parser decides, a well-formed
call ends with its exact final arguments (compact JSON, which the streamed text is a prefix of);
markup that breaks after a call was announced (bad JSON in the arguments, a missing closing tag,
generation cut) keeps the announced calls, their arguments the JSON certain so far completed
(close_json), and drops the rest of that markup. Markup that breaks before any call was announced
comes back as content, unless the token limit cut it (flush(cut=True)): then it is dropped, a
call begun and never finished. Both decisions depend only on the markup, so the streamed
deltas add up to the same calls however the text was cut.

Whitespace that separates markup from the content is dropped: "Let me look.\\n\\n<tool_call>..."
gives the content "Let me look."; text after a call keeps its separator only when content came
before the call.

Reasoning: the sink's thinking splitter runs after the router, so the router sees <think> blocks
itself and passes them through untouched (tool markup inside reasoning stays reasoning). Like
the splitter, it knows one reasoning block.
"""

from __future__ import annotations

from typing import Any

from tallow.output.detokenizer import Detokenizer
from tallow.output.events import ToolCall, ToolCallDelta
from tallow.output.partial_match import partial_suffix_len
from tallow.output.reasoning import ReasoningFormat
from tallow.output.tool_parsers.base import ToolParser, compact_json, skip_ws
from tallow.output.tool_parsers.streaming import PartialCall, close_json


class ToolCallRouter:
    """A TokenRouter (see tallow.output.sink) that turns tool-call markup into ToolCalls."""

    def __init__(self, detokenizer: Detokenizer, parser: ToolParser,
                 reasoning: ReasoningFormat | None = None, start_in_reasoning: bool = False,
                 max_calls: int | None = None, hidden_markers: tuple[str, ...] = ()):
        self._detokenizer = detokenizer
        self._hidden_markers = hidden_markers  # special tokens shown for parsing only
        self._max_calls = max_calls
        self.closed = False  # max_calls reached: all later text is dropped; generation should end
        self._parser = parser
        self._reasoning = reasoning
        self._in_reasoning = reasoning is not None and start_in_reasoning
        self._reasoning_done = False  # one block, as the thinking splitter
        self._buffer = ""  # text not decided yet
        self._in_markup = False
        self._markup_ws = ""  # whitespace before the markup: dropped unless the markup is content
        self._content_started = False  # non-whitespace content released outside reasoning
        self._after_call = False  # a call came last (only whitespace since)
        self._calls: list[ToolCall] = []
        self._deltas: list[tuple[int, ToolCallDelta]] = []  # (offset in the text this push released, delta)
        self._out: list[str] = []  # the text released by the current push
        self._streaming: list[list[str]] = []  # the current markup's announced calls: [id, name, arguments sent]
        self.repaired = False  # an announced call's arguments were completed by close_json (cut or broken)
        self._cut = False  # flush(cut=True): the token limit ended generation

    def push(self, token_id: int) -> str:
        return self._advance(self._detokenizer.push(token_id), final=False)

    def flush(self, cut: bool = False) -> str:
        self._cut = cut
        return self._advance(self._detokenizer.flush(), final=True)

    def take_reasoning(self) -> str:
        return ""  # reasoning passes through, tags included, to the thinking splitter

    def tool_calls(self) -> list[ToolCall]:
        return list(self._calls)

    def take_tool_deltas(self) -> list[ToolCallDelta]:
        """The tool-call deltas made since the last call (and forgets them)."""
        return [delta for _, delta in self.take_placed_tool_deltas()]

    def take_placed_tool_deltas(self) -> list[tuple[int, ToolCallDelta]]:
        """The deltas made since the last call, each with where it falls in the text the last
        push (or flush) released: deltas at offset k come after that text's first k characters
        (and forgets them)."""
        deltas, self._deltas = self._deltas, []
        return deltas

    # ---- the state machine ----------------------------------------------------------------

    def _advance(self, text: str, final: bool) -> str:
        if self.closed:
            return ""
        self._buffer += text
        out: list[str] = []
        self._out = out
        while True:
            if self.closed:
                self._buffer = ""
                return "".join(out)
            if self._in_reasoning:
                done = self._pass_reasoning(out, final)
            elif self._in_markup:
                done = self._parse_markup(out, final)
            else:
                done = self._scan_content(out, final)
            if done:
                return "".join(out)

    def _pass_reasoning(self, out: list[str], final: bool) -> bool:
        close = self._reasoning.close_tag
        at = self._buffer.find(close)
        if at == -1:
            keep = 0 if final else partial_suffix_len(self._buffer, (close,))
            out.append(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return True
        out.append(self._buffer[:at + len(close)])
        self._buffer = self._buffer[at + len(close):]
        self._in_reasoning, self._reasoning_done = False, True
        return False

    def _parse_markup(self, out: list[str], final: bool) -> bool:
        parsed = self._parser.parse(self._buffer, final)
        if parsed is None:
            self._stream(self._parser.partial(self._buffer))
            return True
        markup, self._buffer = self._buffer[:parsed.end], self._buffer[parsed.end:]
        ws, self._markup_ws = self._markup_ws, ""
        self._in_markup = False
        announced = self._allowed(self._parser.partial(markup))
        self._parser.reset()
        if len(announced) < len(self._streaming):  # cannot happen: partial() only grows
            announced = [PartialCall(name, sent, False) for _, name, sent in self._streaming]
        calls = self._final_calls(announced, parsed.calls)
        if calls is None:
            if not self._cut:  # markup the token limit cut short was a call begun: never content
                for marker in self._hidden_markers:
                    markup = markup.replace(marker, "")
                self._release(out, ws + markup)
        else:
            self._stream(announced)
            for k, (name, arguments) in enumerate(calls):
                self._add_call(k, name, arguments)
                if self._max_calls is not None and len(self._calls) >= self._max_calls:
                    self.closed = True
                    break
            self._after_call = True
        self._streaming = []
        return False

    def _allowed(self, partial: list[PartialCall]) -> list[PartialCall]:
        """The partial calls the router may announce (max_calls)."""
        if self._max_calls is None:
            return partial
        return partial[:max(self._max_calls - len(self._calls), 0)]

    def _final_calls(self, announced: list[PartialCall],
                     parsed: list[tuple[str, dict[str, Any]]] | None) -> list[tuple[str, str]] | None:
        """The decided markup's calls as (name, arguments JSON); None: it is content.

        announced: the partial calls of the whole markup (a function of the markup only)."""
        if not announced:
            return None if parsed is None else [(name, compact_json(args)) for name, args in parsed]
        if (parsed is not None and len(parsed) >= len(announced)
                and all(p.name == name for p, (name, _) in zip(announced, parsed))):
            calls = []
            for k, (name, args) in enumerate(parsed):
                arguments = compact_json(args)
                if k < len(announced) and not arguments.startswith(announced[k].arguments):
                    arguments = announced[k].arguments + close_json(announced[k].arguments)
                    self.repaired = True
                calls.append((name, arguments))
            return calls
        self.repaired = True
        return [(p.name, p.arguments + close_json(p.arguments)) for p in announced]

    def _stream(self, partial: list[PartialCall]) -> None:
        """Announce the new calls of the current markup and send what their arguments grew by."""
        for k, call in enumerate(self._allowed(partial)):
            index = len(self._calls) + k
            if k == len(self._streaming):
                fresh = ToolCall.create(call.name, "", self._parser.new_call_id())
                self._streaming.append([fresh.id, call.name, ""])
                self._place(ToolCallDelta(index, fresh.id, call.name, ""))
            sent = self._streaming[k][2]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                self._place(ToolCallDelta(index, None, None, call.arguments[len(sent):]))
                self._streaming[k][2] = call.arguments

    def _place(self, delta: ToolCallDelta) -> None:
        self._deltas.append((sum(map(len, self._out)), delta))

    def _scan_content(self, out: list[str], final: bool) -> bool:
        text = self._buffer
        at, tag = self._next_tag(text)
        if tag is None:
            # (cut by the token limit: a tail that may begin a tag is dropped with the markup)
            hold = partial_suffix_len(text, self._tags()) if not final or self._cut else 0
            body = text[:len(text) - hold]
            # Trailing whitespace waits to see whether markup follows; at the end it is
            # content, unless it follows a call.
            lead = body.rstrip()
            self._release(out, lead)
            self._buffer = text[len(lead):]
            if final:
                if not self._after_call and not hold:
                    self._release(out, self._buffer)
                self._buffer = ""
            return True
        before, self._buffer = text[:at], text[at:]
        if self._reasoning is not None and tag == self._reasoning.open_tag:
            self._release(out, before)
            out.append(tag)
            self._buffer = self._buffer[len(tag):]
            self._in_reasoning = True
            return False
        lead = before.rstrip()
        self._release(out, lead)
        self._markup_ws = before[len(lead):]
        self._in_markup = True
        return False

    def _tags(self) -> list[str]:
        tags = list(self._parser.start_tags)
        if self._reasoning is not None and not self._reasoning_done:
            tags.append(self._reasoning.open_tag)
        return tags

    def _next_tag(self, text: str) -> tuple[int, str | None]:
        """The earliest tag that opens markup or reasoning in text."""
        best, best_tag = len(text), None
        for tag in self._tags():
            at = text.find(tag)
            if at != -1 and at < best:
                best, best_tag = at, tag
        if not self._content_started:
            first = skip_ws(text, 0)
            if first < best and text[first] in self._parser.reply_start:
                best, best_tag = first, text[first]
        return best, best_tag

    def _release(self, out: list[str], text: str) -> None:
        """Release content; whitespace between a call and the first content is dropped."""
        if self._after_call and not self._content_started:
            text = text.lstrip()
        if text.strip():
            self._content_started, self._after_call = True, False
        out.append(text)

    def _add_call(self, k: int, name: str, arguments: str) -> None:
        """The current markup's call k, decided: the rest of its arguments, or all of it when
        it was not announced."""
        index = len(self._calls)
        if k < len(self._streaming):
            call_id, _, sent = self._streaming[k]
            if not arguments.startswith(sent):  # cannot happen: the announced text is a prefix
                arguments = sent + close_json(sent)
            call = ToolCall(call_id, name, arguments)
            if len(arguments) > len(sent):
                self._place(ToolCallDelta(index, None, None, arguments[len(sent):]))
        else:
            call = ToolCall.create(name, arguments, self._parser.new_call_id())
            for delta in ToolCallDelta.whole(index, call):
                self._place(delta)
        self._calls.append(call)
