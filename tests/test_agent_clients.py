"""Claude Code and Codex as they speak: their recorded requests (tests/data/clients, captured from
the real CLIs, see the README there) against a live server over the replay model, shortened to
fit its 8k context with every field and shape kept; the whole bodies get a context-length 400 in
each protocol's own shape. And what those requests need: Anthropic's mid-conversation system
messages, the thinking budget, context_management, usage agreement; Responses' namespace,
custom and hosted tools, encrypted reasoning, store: false; model names."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from openapi_schemas import validate, validate_event
from serve_utils import AGENT_REPLAY_SCRIPT, FakeEngine, LiveServer, replay_server

from tallow.config import ServerConfig
from tallow.serve.protocols.anthropic import AnthropicMessages
from tallow.serve.protocols.anthropic_schemas import MessagesInput
from tallow.serve.protocols.responses import OpenAIResponses
from tallow.serve.protocols.responses_tools import DROPPED_TOOLS_HEADER, ToolError, build_tool_set
from tallow.serve.plan import Rejection
from tallow.serve.reasoning_blob import ReasoningSealer
from tallow.serve.responses_store import ResponsesStore

CLIENTS = Path(__file__).parent / "data" / "clients"
QWEN3_TEMPLATE = json.loads(AGENT_REPLAY_SCRIPT.read_text())["chat_template"]

REASONING = "<think>\n" + "hmm " * 40 + "\n</think>\n\n"
SCRIPT = {"chat_template": QWEN3_TEMPLATE, "replies": [
    {"match": '"name": "Bash"', "reply": "<think>\nThe user wants a command run.\n</think>\n\n<tool_call>\n"
     '{"name": "Bash", "arguments": {"command": "echo hi", "description": "Print hi"}}\n</tool_call>'},
    {"match": '"name": "exec_command"', "reply": "<think>\nRun the command.\n</think>\n\n<tool_call>\n"
     '{"name": "exec_command", "arguments": {"cmd": "echo hi"}}\n</tool_call>'},
    {"match": "<tool_response>", "reply": "hi"},
    {"match": "spawn a helper", "reply": '<tool_call>\n{"name": "multi_agent_v1__spawn_agent", '
     '"arguments": {"message": "count the files"}}\n</tool_call>'},
    {"match": "patch the file", "reply": '<tool_call>\n{"name": "apply_patch", '
     '"arguments": {"input": "*** Begin Patch\\n*** End Patch"}}\n</tool_call>'},
    {"match": "ponder", "reply": REASONING + "The answer is 42."},
    # After the reasoning budget forced </think>: the answer (not starting with the "\n" that ends
    # every generation prompt, which would make it the reply under way everywhere).
    {"match": "</think>", "reply": "The answer is 42."},
    {"reply": "Hello."},
]}


@pytest.fixture(scope="module")
def server():
    with replay_server(SCRIPT) as live:
        yield live


def recorded(name: str) -> dict:
    return json.loads((CLIENTS / f"{name}.json").read_text())


def shorten(value, limit: int = 160):
    """Every string longer than `limit` cut to it (every field and shape kept)."""
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit]
    if isinstance(value, list):
        return [shorten(v, limit) for v in value]
    if isinstance(value, dict):
        return {k: shorten(v, limit) for k, v in value.items()}
    return value


CLAUDE_TOOLS = ("Agent", "Bash", "Read", "Edit", "Write", "WebFetch")


def short_claude(name: str) -> dict:
    body = copy.deepcopy(recorded(name)["body"])
    body["tools"] = [t for t in body["tools"] if t["name"] in CLAUDE_TOOLS]
    return shorten(body)


def short_codex(name: str) -> dict:
    return shorten(recorded(name)["body"])


def post(server, record: dict, body: dict, **kwargs) -> httpx.Response:
    headers = {k: v for k, v in record["headers"].items() if k != "accept"}
    return httpx.post(server.base_url + record["path"], json=body, headers=headers, timeout=60, **kwargs)


def sse_events(text: str) -> list[tuple[str, dict]]:
    events = []
    for frame in text.split("\n\n"):
        lines = frame.strip().splitlines()
        if not lines:
            continue
        name = next(line[7:] for line in lines if line.startswith("event: "))
        data = json.loads(next(line[6:] for line in lines if line.startswith("data: ")))
        assert data["type"] == name
        events.append((name, data))
    return events


def check_anthropic_stream(events: list[tuple[str, dict]]) -> dict:
    """Anthropic's event grammar; returns the message the events build."""
    events = [e for e in events if e[0] != "ping"]
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    assert events[-2][0] == "message_delta"
    message = events[0][1]["message"]
    open_index = None
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(message["content"])
            open_index = data["index"]
            message["content"].append(copy.deepcopy(data["content_block"]) | {"_json": ""})
        elif name == "content_block_delta":
            assert data["index"] == open_index
            block, delta = message["content"][open_index], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":  # a thinking block's, before its stop
                assert block["type"] == "thinking" and not block["signature"] and delta["signature"]
                block["signature"] = delta["signature"]
            else:
                assert delta["type"] == "input_json_delta"
                block["_json"] += delta["partial_json"]
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            open_index = None
    assert open_index is None
    for block in message["content"]:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["_json"])
        del block["_json"]
    final = events[-2][1]
    message["stop_reason"] = final["delta"]["stop_reason"]
    start_usage, final_usage = events[0][1]["message"]["usage"], final["usage"]
    for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        assert start_usage[key] == final_usage[key], key
    message["usage"] = final_usage
    return message


# ---- Claude Code ----------------------------------------------------------------------------


def test_claude_code_recorded_turns(server):
    first = recorded("claude_code_turn1")
    assert first["path"] == "/v1/messages?beta=true"
    assert "mid-conversation-system" in first["headers"]["anthropic-beta"]
    body = short_claude("claude_code_turn1")
    assert [m["role"] for m in body["messages"]] == ["user", "system"]
    assert body["thinking"] == {"type": "adaptive"} and body["context_management"]["edits"]
    r = post(server, first, body)
    assert r.status_code == 200, r.text
    message = check_anthropic_stream(sse_events(r.text))
    assert [b["type"] for b in message["content"]] == ["thinking", "tool_use"]
    assert message["content"][1]["name"] == "Bash"
    assert message["content"][1]["input"] == {"command": "echo hi", "description": "Print hi"}
    assert message["stop_reason"] == "tool_use" and message["model"] == server.app.state.model_name

    second = recorded("claude_code_turn2")
    body = short_claude("claude_code_turn2")
    assert body["messages"][-1]["content"][0]["type"] == "tool_result"
    r = post(server, second, body)
    assert r.status_code == 200, r.text
    message = check_anthropic_stream(sse_events(r.text))
    assert [b.get("text") for b in message["content"] if b["type"] == "text"] == ["hi"]
    assert message["stop_reason"] == "end_turn"


def test_claude_code_whole_body_is_a_context_length_error(server):
    record = recorded("claude_code_turn1")
    r = post(server, record, record["body"])
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    # Anthropic's wording, which Claude Code and LiteLLM recognise as a context overflow
    n = int(re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", body["error"]["message"])[1])
    assert body["error"]["message"].endswith(f"> {server.engine.max_model_len - 1} maximum")
    counted = httpx.post(server.base_url + "/v1/messages/count_tokens", json=record["body"], timeout=60)
    assert counted.status_code == 200 and counted.json()["input_tokens"] == n >= server.engine.max_model_len


def _plan_messages(server, body: dict, config: ServerConfig | None = None):
    return AnthropicMessages.plan_request(json.dumps(body).encode(), server.engine, config or ServerConfig())


def test_system_messages_inside_messages(server):
    body = {"model": "m", "max_tokens": 20, "system": "TOP", "messages": [
        {"role": "user", "content": "first question"},
        {"role": "system", "content": "MIDDLE NOTE"},
        {"role": "user", "content": "second question"}]}
    plan = _plan_messages(server, body)
    prompt = server.engine.tokenizer.decode(plan.prompts[0], skip_special_tokens=False)
    # Qwen3's template renders a system turn in place.
    assert prompt.index("first question") < prompt.index("<|im_start|>system\nMIDDLE NOTE<|im_end|>") \
        < prompt.index("second question")

    class NoMidSystem:  # a template that refuses a system turn anywhere but first
        def render(self, messages, **kwargs):
            from tallow.errors import TallowError

            if any(m["role"] == "system" for m in messages[1:]):
                raise TallowError("the template failed: System message must be at the beginning.")
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    class Engine:
        tokenizer, model_config, max_model_len = server.engine.tokenizer, server.engine.model_config, 8192
        chat_template = NoMidSystem()

    plan = AnthropicMessages.plan_request(json.dumps(body).encode(), Engine(), ServerConfig())
    prompt = server.engine.tokenizer.decode(plan.prompts[0], skip_special_tokens=False)
    assert prompt == "<system>TOP\n\nMIDDLE NOTE<user>first question<user>second question<assistant>"


def test_context_management_clear_thinking():
    def turn(k):
        return [{"role": "user", "content": f"q{k}"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": f"t{k}", "signature": ""},
                                                  {"type": "text", "text": f"a{k}"}]}]

    messages = turn(1) + turn(2) + turn(3) + [{"role": "user", "content": "q4"}]

    def reasoning(edits):
        req = MessagesInput.model_validate({"messages": messages, "context_management": {"edits": edits}})
        return [m.get("reasoning_content") for m in req.template_messages() if m["role"] == "assistant"]

    assert reasoning([]) == ["t1", "t2", "t3"]
    assert reasoning([{"type": "clear_thinking_20251015", "keep": "all"}]) == ["t1", "t2", "t3"]
    assert reasoning([{"type": "clear_thinking_20251015"}]) == [None, None, "t3"]
    assert reasoning([{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}]) == [
        None, "t2", "t3"]


def test_unsupported_context_edit_is_a_400(server):
    body = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}],
            "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}
    rejection = _plan_messages(server, body)
    assert isinstance(rejection, Rejection) and rejection.param == "context_management.edits[0].type"


def _messages(server, **body) -> dict:
    r = httpx.post(server.base_url + "/v1/messages", json={"model": "claude-haiku-4-5", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return check_anthropic_stream(sse_events(r.text)) if body.get("stream") else r.json()


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_budget_cuts_the_reasoning(server, stream):
    ask = [{"role": "user", "content": "ponder this"}]
    tok = server.engine.tokenizer
    scripted_thought = REASONING.removeprefix("<think>").split("</think>")[0]
    # Within the budget: the scripted reasoning whole.
    whole = _messages(server, max_tokens=200, messages=ask, stream=stream,
                      thinking={"type": "enabled", "budget_tokens": 150})
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in whole["content"]] == [
        ("thinking", scripted_thought), ("text", "The answer is 42.")]
    # Cut at the budget: the end tag forced, then the answer.
    budget = 12
    cut = _messages(server, max_tokens=200, messages=ask, stream=stream,
                    thinking={"type": "enabled", "budget_tokens": budget})
    (kind, thought), (kind2, answer) = [(b["type"], b.get("thinking", b.get("text"))) for b in cut["content"]]
    assert (kind, kind2, answer) == ("thinking", "text", "The answer is 42.")
    assert thought and scripted_thought.startswith(thought) and len(thought) < len(scripted_thought)
    # The budget counts every output token before the forced tag (<think> included).
    assert len(tok.encode("<think>" + thought)) <= budget
    assert cut["usage"]["output_tokens"] == budget + len(tok.encode("</think>")) + len(
        tok.encode("The answer is 42.")) + 1  # + eos


def test_adaptive_thinking_turns_reasoning_on(server):
    reply = _messages(server, max_tokens=200, messages=[{"role": "user", "content": "ponder this"}],
                      thinking={"type": "adaptive"})
    assert [b["type"] for b in reply["content"]] == ["thinking", "text"]


def test_usage_agrees_between_message_start_and_the_final_delta(server):
    body = dict(max_tokens=20, stream=True, system="You are terse. " * 20,
                messages=[{"role": "user", "content": "say hello"}])
    first = _messages(server, **body)
    second = _messages(server, **body)  # check_anthropic_stream compares the two usages
    assert second["usage"]["cache_read_input_tokens"] > 0
    assert (first["usage"]["input_tokens"] + first["usage"]["cache_read_input_tokens"]
            == second["usage"]["input_tokens"] + second["usage"]["cache_read_input_tokens"])


# ---- Codex ----------------------------------------------------------------------------------


def check_responses_stream(events: list[tuple[str, dict]]) -> dict:
    """Every item and content part opened is closed, in order, every event conforms to OpenAI's
    schema; returns the final response."""
    for _, data in events:
        validate_event(data)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert [n for n, _ in events[:2]] == ["response.created", "response.in_progress"]
    open_items, open_parts, done_items = {}, set(), []
    for name, data in events[2:-1]:
        if name == "response.output_item.added":
            assert not open_items
            open_items[data["output_index"]] = data["item"]
        elif name == "response.content_part.added":
            open_parts.add((data["output_index"], data["content_index"]))
        elif name == "response.content_part.done":
            open_parts.remove((data["output_index"], data["content_index"]))
        elif name == "response.output_item.done":
            assert not open_parts
            open_items.pop(data["output_index"])
            done_items.append(data["item"])
    assert not open_items
    final_name, final = events[-1]
    response = final["response"]
    assert final_name == {"completed": "response.completed", "incomplete": "response.incomplete"}[response["status"]]
    assert response["output"] == done_items
    return response


def test_codex_recorded_turns_and_the_encrypted_reasoning_round_trip(server):
    first = recorded("codex_turn1")
    body = short_codex("codex_turn1")
    assert {t["type"] for t in body["tools"]} == {"function", "namespace", "web_search"}
    assert body["store"] is False and body["include"] == ["reasoning.encrypted_content"]
    assert body["reasoning"]["summary"] == "auto" and body["prompt_cache_key"] and body["client_metadata"]
    r = post(server, first, body)
    assert r.status_code == 200, r.text
    assert r.headers[DROPPED_TOOLS_HEADER] == "web_search"
    response = check_responses_stream(sse_events(r.text))
    reasoning, call = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"]
    assert reasoning["summary"] == [{"type": "summary_text", "text": reasoning["content"][0]["text"]}]
    assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call", "exec_command",
                                                                          {"cmd": "echo hi"})
    # store: false: nothing kept.
    assert httpx.get(server.base_url + f"/v1/responses/{response['id']}").status_code == 404

    second = recorded("codex_turn2")
    body = short_codex("codex_turn2")
    recorded_reasoning = next(k for k, item in enumerate(body["input"]) if item["type"] == "reasoning")
    # As recorded, the reasoning item holds the logging proxy's blob: not this server's, a 400.
    r = post(server, second, body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == f"input[{recorded_reasoning}].encrypted_content"
    # With the item this server sent (Codex sends back what it got): the second turn runs, and the
    # reasoning is read back (the prompt holds it: Qwen3 renders it after the last user turn).
    body["input"][recorded_reasoning] = {**reasoning, "content": None}
    body["input"][recorded_reasoning + 1]["call_id"] = call["call_id"]
    body["input"][recorded_reasoning + 2]["call_id"] = call["call_id"]
    plan = OpenAIResponses.with_store(ResponsesStore(60, 1 << 20), server.app.state.reasoning_sealer).plan_request(
        json.dumps(body).encode(), server.engine, ServerConfig())
    assert "Run the command." in server.engine.tokenizer.decode(plan.prompts[0], skip_special_tokens=False)
    r = post(server, second, body)
    assert r.status_code == 200, r.text
    response = check_responses_stream(sse_events(r.text))
    assert [item["type"] for item in response["output"]] == ["message"]
    assert response["output"][0]["content"][0]["text"] == "hi"


def test_codex_whole_body_is_a_context_length_error(server):
    record = recorded("codex_turn1")
    r = post(server, record, record["body"])
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"
    assert "maximum context length" in error["message"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def test_sdk_stream_helper_accepts_the_event_chain(client):
    body = short_codex("codex_turn1")
    with client.responses.stream(model=body["model"], input=body["input"], tools=body["tools"],
                                 reasoning=body["reasoning"], store=False, include=body["include"],
                                 extra_body={"client_metadata": body["client_metadata"],
                                             "prompt_cache_key": body["prompt_cache_key"]}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 2
    assert types.count("response.content_part.added") == types.count("response.content_part.done") == 1
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert final.output[1].name == "exec_command"
    # Cut by max_output_tokens: response.incomplete, the open item closed as incomplete.
    with client.responses.stream(model="m", input="ponder this", max_output_tokens=5) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[-1].status == "incomplete"


SPAWN = {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent.",
         "parameters": {"type": "object", "properties": {"message": {"type": "string"}}}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [SPAWN]}
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}


@pytest.mark.parametrize("stream", [False, True])
def test_namespace_calls_map_back(server, client, stream):
    kwargs = dict(model="gpt-5-codex", input="spawn a helper", tools=[NAMESPACE, {"type": "web_search"}])
    if stream:
        with client.responses.stream(**kwargs) as s:
            events = list(s)
            response = s.get_final_response()
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert json.loads(deltas) == {"message": "count the files"}
    else:
        response = client.responses.create(**kwargs)
    [call] = response.output
    assert (call.type, call.namespace, call.name) == ("function_call", "multi_agent_v1", "spawn_agent")
    assert json.loads(call.arguments) == {"message": "count the files"}
    assert response.model == server.app.state.model_name  # the model that answered, not the one named
    # The next turn sends the call back with its namespace: the model sees the flat name again.
    follow = {"model": "m", "tools": [NAMESPACE], "input": [
        {"role": "user", "content": "spawn a helper"},
        {"type": "function_call", "call_id": call.call_id, "namespace": "multi_agent_v1", "name": "spawn_agent",
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "done"}]}
    plan = OpenAIResponses.with_store(ResponsesStore(60, 1 << 20)).plan_request(
        json.dumps(follow).encode(), server.engine, ServerConfig())
    prompt = server.engine.tokenizer.decode(plan.prompts[0], skip_special_tokens=False)
    assert prompt.count("multi_agent_v1__spawn_agent") == 2  # the tools section and the earlier call
    assert client.responses.create(**follow).output_text == "hi"


@pytest.mark.parametrize("stream", [False, True])
def test_custom_tool_calls_come_back_as_custom_tool_call_items(server, stream):
    body = {"model": "m", "input": "patch the file", "tools": [APPLY_PATCH], "stream": stream}
    r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        events = sse_events(r.text)
        response = check_responses_stream(events)
        names = [n for n, _ in events]
        assert "response.custom_tool_call_input.done" in names
        assert "response.function_call_arguments.delta" not in names
        delta = "".join(d["delta"] for n, d in events if n == "response.custom_tool_call_input.delta")
        assert delta == "*** Begin Patch\n*** End Patch"
    else:
        response = r.json()
        validate("Response", response)
    [call] = response["output"]
    assert (call["type"], call["name"], call["input"]) == ("custom_tool_call", "apply_patch",
                                                           "*** Begin Patch\n*** End Patch")
    follow = {"model": "m", "tools": [APPLY_PATCH], "input": [
        {"role": "user", "content": "patch the file"}, call,
        {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Done!"}]}
    r = httpx.post(server.base_url + "/v1/responses", json=follow, timeout=60)
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "hi"


def test_tool_sets():
    tools = build_tool_set([NAMESPACE, APPLY_PATCH, {"type": "web_search_2025_08_26"}, {"type": "local_shell"},
                            {"type": "image_generation"}, {"type": "function", "name": "f"}], strict=False)
    assert [t["function"]["name"] for t in tools.chat_tools] == ["multi_agent_v1__spawn_agent", "apply_patch", "f"]
    assert tools.dropped == ["web_search_2025_08_26", "local_shell", "image_generation"]
    assert "lark grammar" in tools.chat_tools[1]["function"]["description"]
    with pytest.raises(ToolError) as e:
        build_tool_set([{"type": "function", "name": "f"}, {"type": "file_search"}], strict=True)
    assert e.value.param == "tools[1].type"
    for bad, param in [({"type": "namespace", "name": "n", "tools": []}, "tools[0].tools"),
                       ({"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}, "tools[0].tools[0].type"),
                       ({"type": "retrieval"}, "tools[0].type"), ({"type": "function"}, "tools[0].name")]:
        with pytest.raises(ToolError) as e:
            build_tool_set([bad], strict=False)
        assert e.value.param == param


def test_strict_tools_and_include(server):
    body = {"model": "m", "input": "hi", "tools": [{"type": "web_search"}]}
    protocol = OpenAIResponses.with_store(ResponsesStore(60, 1 << 20))
    rejection = protocol.plan_request(json.dumps(body).encode(), server.engine, ServerConfig(strict_tools=True))
    assert isinstance(rejection, Rejection) and rejection.param == "tools[0].type"
    assert "--strict-tools" in rejection.message
    plan = protocol.plan_request(json.dumps(body).encode(), server.engine, ServerConfig())
    assert plan.response_headers == {DROPPED_TOOLS_HEADER: "web_search"}
    rejection = protocol.plan_request(json.dumps({**body, "include": ["message.output_text.logprobs"]}).encode(),
                                      server.engine, ServerConfig())
    assert isinstance(rejection, Rejection) and rejection.param == "include"


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


def test_responses_function_tools_are_strict_unless_sent_strict_false(server):
    """OpenAI's /v1/responses holds a function tool sent without strict to its schema (strict
    defaults to true there, unlike Chat's); one whose schema cannot be enforced runs lenient, not
    as a 400, and the response echoes what ran."""
    protocol = OpenAIResponses.with_store(ResponsesStore(60, 1 << 20))
    unenforceable = {**WEATHER, "name": "when", "parameters": {
        "type": "object", "properties": {"at": {"type": "string", "format": "no-such-format"}}}}

    def grammar(*tools):
        body = {"model": "m", "input": "weather in Oslo?", "tools": list(tools)}
        plan = protocol.plan_request(json.dumps(body).encode(), server.engine, ServerConfig())
        assert not isinstance(plan, Rejection), plan.message
        return plan.params.grammar

    assert grammar(WEATHER) is not None and "city" in grammar(WEATHER).text
    assert grammar({**WEATHER, "strict": None}) is not None
    assert grammar({**WEATHER, "strict": False}) is None
    assert grammar(unenforceable) is None
    # sent strict: true, the same schema is a 400 naming it
    body = {"model": "m", "input": "hi", "tools": [{**unenforceable, "strict": True}]}
    rejection = protocol.plan_request(json.dumps(body).encode(), server.engine, ServerConfig())
    assert isinstance(rejection, Rejection) and rejection.param == "tools[0].parameters"
    mixed = grammar(WEATHER, unenforceable)
    assert mixed is not None and "city" in mixed.text
    for tools, echoed in [([WEATHER], [True]), ([{**WEATHER, "strict": False}], [False]),
                          ([WEATHER, unenforceable], [True, False])]:
        r = httpx.post(server.base_url + "/v1/responses", json={"model": "m", "input": "hi", "tools": tools},
                       timeout=60)
        assert r.status_code == 200, r.text
        validate("Response", r.json())
        assert [t["strict"] for t in r.json()["tools"]] == echoed


def test_sealed_reasoning():
    sealer = ReasoningSealer("key")
    blob = sealer.seal("secret thoughts ✓")
    assert "secret" not in blob and sealer.open(blob) == "secret thoughts ✓"
    assert ReasoningSealer("key").open(blob) == "secret thoughts ✓"  # the same key reads it after a restart
    assert ReasoningSealer("other").open(blob) is None and ReasoningSealer().open(blob) is None
    raw = bytearray(__import__("base64").urlsafe_b64decode(blob))
    raw[20] ^= 1
    assert sealer.open(__import__("base64").urlsafe_b64encode(bytes(raw)).decode()) is None
    assert sealer.open("not base64 !!") is None and sealer.open("") is None


# ---- model names ------------------------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True])
def test_model_names(strict):
    with LiveServer(FakeEngine(reply="ok"), ServerConfig(strict_model_names=strict)) as live:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        anthropic_body = {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        for model in ("fake-model", "claude-haiku-4-5", "gpt-5-codex"):
            r1 = httpx.post(live.base_url + "/v1/chat/completions", json={**chat, "model": model}, timeout=30)
            r2 = httpx.post(live.base_url + "/v1/messages", json={**anthropic_body, "model": model}, timeout=30)
            r3 = httpx.post(live.base_url + "/v1/responses", json={"model": model, "input": "hi"}, timeout=30)
            if strict and model != "fake-model":
                assert r1.status_code == r2.status_code == r3.status_code == 404
                assert r1.json()["error"]["code"] == "model_not_found" and r1.json()["error"]["param"] == "model"
                assert r2.json()["type"] == "error" and r2.json()["error"]["type"] == "not_found_error"
            else:
                assert r1.status_code == r2.status_code == r3.status_code == 200
                assert r1.json()["model"] == r2.json()["model"] == r3.json()["model"] == "fake-model"
