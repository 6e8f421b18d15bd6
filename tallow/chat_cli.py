"""`tallow chat`: an interactive chat in the terminal, with a server (`--url`) or the model
loaded in this process (the shared output pipeline, as `tallow generate` and LLM use it).

Replies stream as they come; reasoning is shown dimmed. Ctrl+C during a reply stops it (the
server's request is closed, or the in-process sequence aborted) and returns to the prompt;
Ctrl+D or /exit leaves. Commands: /reset, /system TEXT, /save FILE, /help, /exit. Multi-line
input: end a line with a backslash to go on, or enclose the text in lines of three quotes."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator

HELP = """commands:
  /reset         forget the conversation (the system prompt stays)
  /system TEXT   set the system prompt (empty: none) and start over
  /save FILE     write the conversation to FILE as JSON
  /exit          leave (or Ctrl+D); Ctrl+C stops a reply
multi-line input: end a line with \\ to go on, or start and end a block with a line of \"\"\""""

DIM, RESET = "\x1b[2m", "\x1b[0m"


class LocalChat:
    """The model in this process: each turn through the chat template, an EngineCore and the
    output pipeline that splits reasoning out as the server's does."""

    def __init__(self, engine_config):
        from tallow.chat_template import ChatTemplate
        from tallow.engine.core import EngineCore
        from tallow.output.reasoning import reasoning_parser_for_template

        self.core = EngineCore(engine_config)
        self.template = ChatTemplate.for_tokenizer(self.core.tokenizer, override=engine_config.chat_template)
        self.reasoning_parser = reasoning_parser_for_template(getattr(self.template, "source", None))
        self.name = engine_config.model
        # Ctrl+C sets this (run_chat's handler) rather than raising inside an engine step: the
        # loop below sees it between steps and aborts the sequence.
        self.stop_requested = False

    def stream(self, messages: list[dict], options: dict) -> Iterator[tuple[str, str]]:
        from tallow.engine.sampling import SamplingParams
        from tallow.output.events import ContentEvent, ReasoningEvent
        from tallow.output.offline import OfflineRun
        from tallow.output.pipeline import make_sink

        tok = self.core.tokenizer
        prompt = self.template.render_prompt(messages, add_generation_prompt=True)
        ids = tok.encode(prompt.text, literal_spans=prompt.literal_spans)
        params = SamplingParams(**{k: v for k, v in options.items() if v is not None})
        seq = self.core.make_sequences(ids, params)[0]
        run = OfflineRun(self.core)
        pipeline = run.add(seq, make_sink(tok, params, reasoning_parser=self.reasoning_parser,
                                          prompt_text=prompt.text, split_reasoning=True))

        def kinds(events):
            for e in events:
                if isinstance(e, ReasoningEvent):
                    yield "reasoning", e.text
                elif isinstance(e, ContentEvent):
                    yield "content", e.text

        self.stop_requested = False
        try:
            for _, _, events in run.outputs():
                yield from kinds(events)
                if self.stop_requested:
                    raise KeyboardInterrupt
            result, _ = pipeline.finish()
            yield from kinds(result.events)
        finally:
            if not seq.is_finished:  # Ctrl+C: free the sequence, let the engine settle
                self.core.abort(seq)
                while self.core.has_work():
                    self.core.step()

    def close(self) -> None:
        self.core.shutdown()


class RemoteChat:
    """A running tallow server (or any OpenAI-compatible one) over /v1/chat/completions."""

    def __init__(self, url: str, api_key: str | None):
        import httpx

        self.url = url.rstrip("/")
        self.client = httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0),
                                   headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        r = self.client.get(self.url + "/v1/models")
        if r.status_code == 401:
            raise SystemExit(f"tallow chat: {self.url} needs an API key: pass --api-key")
        r.raise_for_status()
        self.name = r.json()["data"][0]["id"]

    def stream(self, messages: list[dict], options: dict) -> Iterator[tuple[str, str]]:
        body = {"model": self.name, "messages": messages, "stream": True,
                **{k: v for k, v in options.items() if v is not None}}
        with self.client.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                try:
                    message = r.json()["error"]["message"]
                except Exception:
                    message = r.text
                raise RuntimeError(f"{r.status_code}: {message}")
            for line in r.iter_lines():  # leaving early closes the response: the server aborts
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "error"))
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta") or {}
                    if delta.get("reasoning_content"):
                        yield "reasoning", delta["reasoning_content"]
                    if delta.get("content"):
                        yield "content", delta["content"]

    def close(self) -> None:
        self.client.close()


def read_message(prompt: str = ">>> ", more: str = "... ") -> str | None:
    """One message from the terminal (None at end of input). A line ending in a backslash goes
    on on the next line; a line of three quotes opens a block up to the next such line."""
    line = input(prompt)
    if line.strip() == '"""':
        lines = []
        while (line := input(more)).strip() != '"""':
            lines.append(line)
        return "\n".join(lines)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = input(more)
    lines.append(line)
    return "\n".join(lines)


def _stop_handler(backend):
    """SIGINT during a reply: the in-process backend stops between engine steps; a server's
    stream is left at once (KeyboardInterrupt out of the socket read closes the response)."""
    def handler(signum, frame):
        if hasattr(backend, "stop_requested"):
            backend.stop_requested = True
        else:
            raise KeyboardInterrupt
    return handler


def run_chat(backend, options: dict, system: str | None = None, out=sys.stdout) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    color = out.isatty()
    history: list[dict] = []
    out.write(f"tallow chat with {backend.name}: /help for commands, Ctrl+D to leave\n")
    out.flush()
    while True:
        try:
            text = read_message()
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n(Ctrl+D or /exit leaves)\n")
            continue
        stripped = text.strip()
        if not stripped:
            continue
        if stripped.startswith("/"):
            command, _, rest = stripped.partition(" ")
            if command in ("/exit", "/quit", "/bye"):
                return 0
            if command == "/help":
                out.write(HELP + "\n")
            elif command == "/reset":
                history.clear()
                out.write("(conversation cleared)\n")
            elif command == "/system":
                system = rest.strip() or None
                history.clear()
                out.write("(system prompt set; conversation cleared)\n" if system else "(no system prompt)\n")
            elif command == "/save":
                if not rest.strip():
                    out.write("usage: /save FILE\n")
                else:
                    msgs = ([{"role": "system", "content": system}] if system else []) + history
                    with open(rest.strip(), "w", encoding="utf-8") as f:
                        json.dump({"model": backend.name, "messages": msgs}, f, indent=2, ensure_ascii=False)
                    out.write(f"(saved {len(msgs)} messages to {rest.strip()})\n")
            else:
                out.write(f"unknown command {command}: /help lists them\n")
            out.flush()
            continue
        history.append({"role": "user", "content": text})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        reply, in_reasoning = [], False
        previous = signal.signal(signal.SIGINT, _stop_handler(backend))
        try:
            for kind, piece in backend.stream(messages, options):
                if kind == "reasoning":
                    if not in_reasoning:
                        out.write(DIM if color else "[thinking] ")
                        in_reasoning = True
                    out.write(piece)
                else:
                    if in_reasoning:
                        out.write(RESET if color else "\n[/thinking]\n")
                        in_reasoning = False
                    reply.append(piece)
                    out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            out.write((RESET if color and in_reasoning else "") + "\n[stopped]")
        except RuntimeError as e:
            out.write(f"\nerror: {e}")
            history.pop()
            out.write("\n")
            continue
        finally:
            signal.signal(signal.SIGINT, previous)
        if in_reasoning and color:
            out.write(RESET)
        out.write("\n")
        out.flush()
        history.append({"role": "assistant", "content": "".join(reply)})
