"""--chat-template (issue 20): a base model without a chat template (Gemma 3 270M ships none)
answers chat requests with a 400 naming chat_template on every chat front end, while
/v1/completions works; a template given by file or text is the one every chat front end renders
with; a missing file or a broken template stops the start."""

from __future__ import annotations

import httpx
import pytest

from gguf_files import write_llama_gguf
from serve_utils import LiveServer
from tallow.config import EngineConfig
from tallow.engine.async_engine import AsyncEngine
from tallow.engine.core import EngineCore
from tallow.errors import TallowError

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """A GGUF without tokenizer.chat_template (as a base model's file)."""
    path = str(tmp_path_factory.mktemp("base") / "base.gguf")
    write_llama_gguf(path, {}, hidden=64, inter=128)
    return path


def _serve(path: str, **config):
    return LiveServer(AsyncEngine.from_config(EngineConfig(model=path, max_num_seqs=2, quantization="none",
                                                           **config)))


CHAT_BODIES = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/messages": {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 2},
}


def test_base_model_chat_is_a_400_naming_the_template(base_model):
    with _serve(base_model) as live:
        for path, body in CHAT_BODIES.items():
            r = httpx.post(live.base_url + path, json=body, timeout=30)
            assert r.status_code == 400, (path, r.text)
            assert "chat template" in r.text and "--chat-template" in r.text, (path, r.text)
        assert httpx.post(live.base_url + "/v1/chat/completions", json=CHAT_BODIES["/v1/chat/completions"],
                          timeout=30).json()["error"]["param"] == "chat_template"
        r = httpx.post(live.base_url + "/v1/completions", json={"model": "m", "prompt": "ab", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("given", ["file", "text"])
def test_given_template_renders_chat(base_model, tmp_path, given):
    value = TEMPLATE
    if given == "file":
        (tmp_path / "t.jinja").write_text(TEMPLATE)
        value = str(tmp_path / "t.jinja")
    with _serve(base_model, chat_template=value) as live:
        r = httpx.post(live.base_url + "/tokenize", json={"model": "m", "messages": [{"role": "user", "content": "ab"}]},
                       timeout=30)
        assert r.status_code == 200, r.text
        tok = live.engine.tokenizer
        assert r.json()["tokens"] == tok.encode("<user>ab</user><assistant>")
        r = httpx.post(live.base_url + "/v1/chat/completions", json=CHAT_BODIES["/v1/chat/completions"], timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tok.encode("<user>hi</user><assistant>"))


@pytest.mark.parametrize("value", ["/nonexistent/template.jinja", "{% for %}"])
def test_bad_template_fails_the_start(base_model, value):
    with pytest.raises(TallowError) as e:
        EngineCore(EngineConfig(model=base_model, quantization="none", chat_template=value))
    assert e.value.param == "chat_template"
