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
