"""Tool-call arguments streamed as the model writes them, over HTTP, for every tool-call parser and
every protocol: the real openai and anthropic SDKs' stream helpers against a live server on the
replay: test fixture model (scripted replies through the real tokenizer, engine and sink).

For each format the model writes a call with a file's worth of arguments: the client must see
many argument pieces before the call ends, they must add up (as the SDK accumulates them) to the
final arguments, which equal the non-streamed response's; a malformed call streams no argument
piece and comes back as content."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest

from serve_utils import LiveServer, replay_engine
from tallow.config import ServerConfig
from tallow.output.tool_parsers import TOOL_PARSERS
import tallow.testing  # noqa: F401  (registers the replay: model source)

FILE = ('def main():\n    print("héllo, \'world\'")  # a \\ backslash, a tab\t, 🌧 and </b> tags\n'
        '    return {"x": [1, 2]}\n') * 2
ARGS = {"path": "src/a.py", "content": FILE, "mode": 420}
WRITE = {"type": "function", "function": {"name": "write_file", "description": "Write a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                     "mode": {"type": "integer"}}, "required": ["path", "content"]}}}

CALLS = {
    "hermes": 'Writing it.\n<tool_call>\n{"name": "write_file", "arguments": %s}\n</tool_call>' % json.dumps(ARGS),
    "llama3_json": '<|python_tag|>{"name": "write_file", "parameters": %s}' % json.dumps(ARGS, ensure_ascii=False),
    "mistral": '[TOOL_CALLS]write_file[ARGS]%s' % json.dumps(ARGS),
    "qwen3_coder": ('Writing it.\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n'
                    f'<parameter=content>\n{FILE}\n</parameter>\n<parameter=mode>\n420\n</parameter>\n'
                    '</function>\n</tool_call>'),
    "pythonic": '[write_file(path="src/a.py", content=%r, mode=420)]' % FILE,
}
CONTENT = {"hermes": "Writing it.", "qwen3_coder": "Writing it."}
MALFORMED = {
    "hermes": 'Sure. <tool_call>\n{"nam": "write_file", "arguments": {"path": "x"}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"answer": "write_file", "parameters": {"path": "x"}}',
    "mistral": '[TOOL_CALLS] write_file please',
    "qwen3_coder": 'Sure. <tool_call>\n<function=write_file>\nnot a parameter\n</function>\n</tool_call>',
    "pythonic": '[write_file("src/a.py")]',
}


def script(parser: str) -> dict:
    return {"replies": [{"match": "[write]", "reply": CALLS[parser]},
                        {"match": "[malformed]", "reply": MALFORMED[parser]}]}


@pytest.fixture(scope="module", params=list(TOOL_PARSERS))
def server(request):
    parser = request.param
    engine = replay_engine(script(parser))
    try:
        with LiveServer(engine, ServerConfig(tool_call_parser=parser)) as live:
            live.parser = parser
            yield live
    finally:
        asyncio.run(engine.shutdown())


def chat_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


ANTHROPIC_TOOL = {"name": "write_file", "description": "Write a file.",
                  "input_schema": WRITE["function"]["parameters"]}
# strict false, as Codex sends its tools: on /v1/responses a tool without it is held to its schema
# by a grammar, and the scripted calls escape non-ASCII text (\u00e9), which llguidance's JSON
# strings do not take (\u escapes only for control characters): the replay would be steered off it.
RESPONSES_TOOL = {"type": "function", "name": "write_file", "description": "Write a file.",
                  "parameters": WRITE["function"]["parameters"], "strict": False}


def _many(pieces: list[str], arguments: str) -> None:
    """Pieces before the call ends: at least one per few tokens of the arguments (its JSON is about
    one token per 3-4 characters; an escape or a tag between parameters holds a few tokens back)."""
    assert "".join(pieces) == arguments
    assert len(pieces) >= len(arguments) / 25, (len(pieces), len(arguments))


def test_openai_chat_streams_the_arguments(server):
    client = chat_client(server)
    whole = client.chat.completions.create(model="m", messages=ask("[write] it"), tools=[WRITE])
    (call,) = whole.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("write_file", ARGS)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert (whole.choices[0].message.content or "") == CONTENT.get(server.parser, "")

    pieces, order = [], []
    with client.chat.completions.stream(model="m", messages=ask("[write] it"), tools=[WRITE]) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.append(event.arguments_delta)
                order.append("delta")
            elif event.type == "tool_calls.function.arguments.done":
                order.append("done")
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls
    assert streamed.function.name == "write_file" and final.choices[0].finish_reason == "tool_calls"
    assert streamed.function.arguments == call.function.arguments  # the SDK's accumulation
    _many(pieces, call.function.arguments)
    assert order[-1] == "done" and "done" not in order[:-1]
    assert (final.choices[0].message.content or "") == CONTENT.get(server.parser, "")


def test_anthropic_streams_input_json(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
    kwargs = dict(model="m", max_tokens=2000, tools=[ANTHROPIC_TOOL], messages=ask("[write] it"))
    whole = client.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use" and whole.content[-1].input == ARGS
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [e.delta.partial_json for e in events
              if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    snapshots = [e.snapshot for e in events if e.type == "input_json"]  # the helper's partial parses
    assert final.content[-1].type == "tool_use" and final.content[-1].input == ARGS
    assert snapshots[-1] == ARGS and len(snapshots) == len(pieces)
    _many(pieces, json.dumps(ARGS, ensure_ascii=False, separators=(",", ":")))
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == (["text"] if server.parser in CONTENT else []) + ["tool_use"]


def test_responses_streams_function_call_arguments(server):
    client = chat_client(server)
    kwargs = dict(model="m", input="[write] it", tools=[RESPONSES_TOOL])
    whole = client.responses.create(**kwargs)
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert json.loads(call.arguments) == ARGS
    pieces, events = [], []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            events.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                pieces.append(event.delta)
        final = stream.get_final_response()
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert streamed.arguments == call.arguments and streamed.name == "write_file"
    _many(pieces, call.arguments)
    first = events.index("response.function_call_arguments.delta")
    done = events.index("response.function_call_arguments.done")
    assert events[first - 1] == "response.output_item.added" and events[done + 1] == "response.output_item.done"
    assert events.count("response.function_call_arguments.done") == 1


def test_a_malformed_call_streams_no_argument_piece_and_is_content(server):
    text = MALFORMED[server.parser]
    client = chat_client(server)
    whole = client.chat.completions.create(model="m", messages=ask("[malformed] it"), tools=[WRITE])
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].message.content == text
    chunks = list(client.chat.completions.create(model="m", messages=ask("[malformed] it"), tools=[WRITE],
                                                 stream=True))
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text

    claude = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
    with claude.messages.stream(model="m", max_tokens=500, tools=[ANTHROPIC_TOOL],
                                messages=ask("[malformed] it")) as stream:
        events = list(stream)
    assert not any(e.type == "content_block_start" and e.content_block.type == "tool_use" for e in events)
    assert stream.get_final_message().content[0].text == text

    with client.responses.stream(model="m", input="[malformed] it", tools=[RESPONSES_TOOL]) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert not any(t.startswith("response.function_call_arguments") for t in types)
    assert final.output_text == text


def test_a_call_cut_by_max_tokens_is_the_arguments_so_far(server):
    """Generation cut inside a call that was already announced: the call stays, its arguments the
    JSON certain so far, completed, the same streamed and not; finish_reason says length."""
    client = chat_client(server)
    kwargs = dict(model="m", messages=ask("[write] it"), tools=[WRITE], max_tokens=60)
    whole = client.chat.completions.create(**kwargs).choices[0]
    pieces = []
    with client.chat.completions.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.append(event.arguments_delta)
        final = stream.current_completion_snapshot.choices[0]  # get_final_completion() raises on "length"
    assert whole.finish_reason == final.finish_reason == "length"
    (call,) = whole.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.arguments == final.message.tool_calls[0].function.arguments == "".join(pieces)
    assert args["path"] == "src/a.py" and FILE.startswith(args["content"]) and args["content"] != FILE
