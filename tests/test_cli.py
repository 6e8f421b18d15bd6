"""The command line: argument checks at start-up, and `tallow generate` end to end on a replay script."""

import json
import subprocess
import sys

import pytest

from tallow.cli import main
from tallow.output.reasoning import REASONING_PARSERS
from tallow.output.tool_parsers import TOOL_PARSERS


@pytest.mark.parametrize("flag, names", [("--tool-call-parser", TOOL_PARSERS), ("--reasoning-parser", REASONING_PARSERS)])
def test_an_unknown_parser_name_stops_serve_before_anything_loads(flag, names, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", flag, "no_such_parser"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert flag in err and "no_such_parser" in err
    assert all(name in err for name in names)


def test_generate_streams_the_reply_and_honours_a_stop_string(tmp_path):
    script = tmp_path / "reply.json"
    script.write_text(json.dumps([{"reply": "Alpha beta gamma. Delta epsilon."}]))
    args = [sys.executable, "-m", "tallow.testing", "generate", "Say something.", "--chat",
            "--model", f"replay:{script}", "--kv-cache-memory", "0.01"]
    whole = subprocess.run(args, capture_output=True, text=True, timeout=120)
    stopped = subprocess.run(args + ["--stop", " Delta", "-v"], capture_output=True, text=True, timeout=120)
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout == "Alpha beta gamma. Delta epsilon.\n"
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout == "Alpha beta gamma.\n"
    assert "finish stop]" in stopped.stderr


def test_a_model_that_cannot_load_is_one_line_of_error(tmp_path, capsys):
    missing = tmp_path / "missing.gguf"
    assert main(["generate", "hi", "--model", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tallow generate: error: ") and str(missing) in err and "Traceback" not in err


@pytest.mark.parametrize("argv, allowed", [([], False), (["--allow-special-tokens-in-content"], True)])
def test_serve_keeps_special_tokens_in_chat_content_text_unless_allowed(monkeypatch, argv, allowed):
    import tallow.serve.app

    seen = {}
    monkeypatch.setattr(tallow.serve.app, "run_server", lambda engine, server: seen.setdefault("server", server) and 0)
    assert main(["serve", *argv]) == 0
    assert seen["server"].allow_special_tokens_in_content is allowed


@pytest.fixture
def served(monkeypatch):
    """What `tallow serve ...` would run: (engine config, server config), without running it."""
    import tallow.serve.app

    seen = {}
    monkeypatch.setattr(tallow.serve.app, "run_server",
                        lambda engine, server: seen.update(engine=engine, server=server) or 0)
    return seen


def test_vllm_and_llama_server_command_lines(served, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    # vLLM's `serve MODEL`, its spellings of our flags, and its flags that change nothing here
    assert main(["serve", "dummy:tiny", "--served-model-name", "a", "b", "-tp", "1", "--no-enable-prefix-caching",
                 "--uvicorn-log-level", "DEBUG", "--trust-remote-code", "--enable-auto-tool-choice",
                 "--tool-call-parser", "hermes", "--enable-chunked-prefill", "--chat-template-file", str(template)]) == 0
    engine, server = served["engine"], served["server"]
    assert engine.model == "dummy:tiny" and not engine.enable_prefix_caching and engine.chat_template == str(template)
    assert server.served_model_name == ["a", "b"] and server.log_level == "debug"
    assert server.tool_call_parser == "hermes"
    # llama-server's
    assert main(["serve", "-m", "dummy:tiny", "-c", "4096", "-np", "4", "-a", "x", "--jinja"]) == 0
    engine, server = served["engine"], served["server"]
    assert (engine.model, engine.max_model_len, engine.max_num_seqs, server.served_model_name) == (
        "dummy:tiny", 4096, 4, ["x"])


@pytest.mark.parametrize("argv, said", [
    (["serve", "-ngl", "99"], "--device cuda"),
    (["serve", "--threads", "4"], "OMP_NUM_THREADS"),
    (["serve", "--ssl-keyfile", "k.pem"], "TLS proxy"),
    (["serve", "--p", "1"], "--p"),  # no abbreviations: a typo is not --port
    (["serve", "--served", "m"], "--served"),
    (["serve", "--log-level", "verbose"], "verbose"),
    (["serve", "a.gguf", "--model", "b.gguf"], "the model is given twice"),
    (["generate", "hi", "-ngl", "99"], "--device cuda"),
])
def test_flags_tallow_does_not_have_stop_with_what_to_do(served, capsys, argv, said):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and said in err and f"usage: tallow {argv[0]}" in err
    assert "engine" not in served  # nothing started


def test_every_served_name_is_listed_and_answered(monkeypatch):
    import asyncio

    import httpx
    from serve_utils import FakeEngine

    from tallow.config import ServerConfig
    from tallow.serve.app import build_app

    async def go(strict: bool):
        app = build_app(FakeEngine(), ServerConfig(served_model_name=["first", "second"], strict_model_names=strict))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            listed = (await client.get("/v1/models")).json()["data"]
            one = await client.get("/v1/models/second")
            other = await client.get("/v1/models/third")
            body = {"model": "second", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            reply = await client.post("/v1/chat/completions", json=body)
            wrong = await client.post("/v1/chat/completions", json={**body, "model": "third"})
        return [m["id"] for m in listed], one, other, reply, wrong

    for strict in (False, True):
        listed, one, other, reply, wrong = asyncio.run(go(strict))
        assert listed == ["first", "second"] and one.json()["id"] == "second" and other.status_code == 404
        assert reply.status_code == 200 and reply.json()["model"] == "first"  # vLLM answers with the first
        assert wrong.status_code == (404 if strict else 200)
