"""What users pass as --model (and the load-time options beside it) resolves, or fails with one
specific TallowError before any weights load: Hub ids (the local Hugging Face cache's snapshot,
else how to get local files), GGUF files by their magic bytes (Ollama blobs, .GGUF), folders of
GGUF files, split GGUFs, missing paths, lone .safetensors files, damaged headers, config.json
without a required key; --quantization, --dtype, --kv-cache-dtype and --device names."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from gguf_files import write_llama_gguf
from tallow import config as tallow_config
from tallow.cli import main
from tallow.config import QUANTIZATIONS, EngineConfig
from tallow.errors import ModelLoadError, TallowError
from tallow.models import engine_model, loader, quant
from tallow.models.gguf import open_gguf
from tallow.models.loader import load_model, resolve_source

CPU = dict(dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    write_llama_gguf(path, {}, hidden=64, inter=128, layers=1, heads=2, kv_heads=1, vocab=40)
    return path


def _error(source: str) -> str:
    with pytest.raises(ModelLoadError) as e:
        resolve_source(source)
    return e.value.message


def _split_only_gguf(path, count: int = 2, index: int = 0) -> str:
    """A GGUF holding llama-gguf-split's split.* keys (no tensors: the reader stops at the keys)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint16("split.no", index)
    w.add_uint16("split.count", count)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# 1. Hub ids

@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # ORG/NAME is no relative path here
    return cache


def test_a_hub_id_without_a_local_snapshot_says_tallow_does_not_download(hub_cache):
    message = _error("Qwen/Qwen2.5-0.5B-Instruct")
    assert "does not download" in message
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir" in message
    assert str(hub_cache) in message and "snapshots" in message and "'default'" in message and ".gguf" in message


def test_a_hub_id_loads_its_snapshot_from_the_local_hugging_face_cache(hub_cache, tiny_gguf):
    repo = hub_cache / "models--Org--Tiny-GGUF"
    old, main_rev = repo / "snapshots" / "0ld", repo / "snapshots" / "abc123"
    for rev in (old, main_rev):
        rev.mkdir(parents=True)
        shutil.copy(tiny_gguf, rev / "tiny-q8_0.gguf")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    resolved = resolve_source("Org/Tiny-GGUF")
    assert (resolved.kind, resolved.location, resolved.name) == ("gguf", str(main_rev / "tiny-q8_0.gguf"),
                                                                 "Org/Tiny-GGUF")
    assert load_model("Org/Tiny-GGUF", **CPU).name == "Org/Tiny-GGUF"
    # an HF folder snapshot, found through HF_HOME when HF_HUB_CACHE is unset
    hf = hub_cache / "home" / "hub" / "models--Org--Folder" / "snapshots" / "r1"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    os.environ.pop("HF_HUB_CACHE")
    os.environ["HF_HOME"] = str(hub_cache / "home")
    try:
        assert resolve_source("Org/Folder").kind == "hf" and resolve_source("Org/Folder").location == str(hf)
    finally:
        os.environ.pop("HF_HOME")


def test_the_hub_cache_is_found_as_huggingface_hub_finds_it(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tallow_config.hf_hub_cache_dir() == str(tmp_path / "huggingface" / "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "h"))
    assert tallow_config.hf_hub_cache_dir() == str(tmp_path / "h" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert tallow_config.hf_hub_cache_dir() == str(tmp_path / "c")


# 2. GGUF by its magic bytes

def test_gguf_files_are_found_by_their_magic_bytes(tmp_path, tiny_gguf):
    blob = tmp_path / "blobs" / "sha256-0123abcd"
    blob.parent.mkdir()
    shutil.copy(tiny_gguf, blob)
    upper = tmp_path / "Model.Q8_0.GGUF"
    shutil.copy(tiny_gguf, upper)
    for path, name in ((blob, "sha256-0123abcd"), (upper, "Model.Q8_0")):
        resolved = resolve_source(str(path))
        assert (resolved.kind, resolved.name) == ("gguf", name)
        loaded = load_model(str(path), **CPU)
        assert loaded.name == name and loaded.config.vocab_size == 40
    other = tmp_path / "sha256-feed"
    other.write_bytes(b"\x00" * 64)
    message = _error(str(other))
    assert str(other) in message and "not a GGUF file" in message


# 3. Folders of GGUF files

def test_a_folder_with_one_gguf_file_loads_it_and_with_several_lists_them(tmp_path, tiny_gguf):
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(tiny_gguf, one / "tiny-Q8_0.gguf")
    shutil.copy(tiny_gguf, one / "mmproj-tiny-f16.gguf")  # a vision projector beside it: not the model
    resolved = resolve_source(str(one))
    assert (resolved.kind, resolved.location) == ("gguf", str(one / "tiny-Q8_0.gguf"))
    assert load_model(str(one), **CPU).name == "tiny-Q8_0"
    many = tmp_path / "many"
    many.mkdir()
    for name in ("a-Q4_K_M.gguf", "a-Q8_0.gguf"):
        shutil.copy(tiny_gguf, many / name)
    message = _error(str(many))
    assert str(many / "a-Q4_K_M.gguf") in message and str(many / "a-Q8_0.gguf") in message
    assert "pass one" in message


# 4. Split GGUF files

def test_split_gguf_files_are_refused_with_the_merge_command(tmp_path, tiny_gguf):
    first = tmp_path / "m-00001-of-00003.gguf"
    shutil.copy(tiny_gguf, first)
    message = _error(str(first))
    assert "split GGUF" in message and "not supported" in message
    assert f"llama-gguf-split --merge {first} {tmp_path / 'm.gguf'}" in message
    second = tmp_path / "m-00002-of-00003.gguf"
    shutil.copy(tiny_gguf, second)
    assert f"--merge {first} " in _error(str(second))  # names the first part
    assert "llama-gguf-split --merge" in _error(str(tmp_path))  # a folder of the parts alone
    # split.count in the metadata, whatever the file's name
    renamed = _split_only_gguf(tmp_path / "renamed.gguf")
    resolve_source(renamed)
    with pytest.raises(ModelLoadError, match="llama-gguf-split --merge") as e:
        load_model(renamed, **CPU)
    assert renamed in e.value.message and "part 1 of 2" in e.value.message
    # the name -00001-of-00001 is a whole model
    whole = tmp_path / "w-00001-of-00001.gguf"
    shutil.copy(tiny_gguf, whole)
    assert resolve_source(str(whole)).kind == "gguf"


# 5. Missing paths, lone safetensors, damaged headers, config.json without a key

def test_a_missing_path_is_named_with_the_accepted_forms(tmp_path):
    missing = tmp_path / "nope.gguf"
    message = _error(str(missing))
    assert message.startswith(f"no such file or folder: {missing}")
    assert "'default'" in message and "config.json" in message and "dummy:<preset>" in message
    assert "no model given" in _error("")


def test_a_lone_safetensors_file_asks_for_its_folder(tmp_path):
    lone = tmp_path / "model.safetensors"
    lone.write_bytes(b"{}")
    message = _error(str(lone))
    assert str(lone) in message and "config.json" in message and "folder" in message
    (tmp_path / "config.json").write_text("{}")
    assert f"pass its folder {tmp_path}" in _error(str(lone))
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    (weights_only / "model.safetensors").write_bytes(b"{}")
    assert "no config.json" in _error(str(weights_only))


@pytest.mark.parametrize("keep", [100, 1000, 0])
def test_a_truncated_gguf_header_is_named_as_such(tmp_path, tiny_gguf, keep):
    cut = tmp_path / "cut.gguf"
    with open(tiny_gguf, "rb") as f:
        cut.write_bytes(f.read(keep))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(cut), **CPU)
    message = e.value.message
    assert f"cannot read GGUF file {cut}" in message and "unpack_from" not in message
    assert ("truncated or corrupt header" if keep else "empty file") in message


def test_a_corrupt_string_length_is_a_corrupt_header(tmp_path, tiny_gguf):
    data = bytearray(open(tiny_gguf, "rb").read())
    data[24:32] = (0x72_ed_1f_ab_00_00_00_00).to_bytes(8, "little")  # the first key's length
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="truncated or corrupt header"):
        open_gguf(str(bad))


def test_config_json_without_a_required_key_names_the_key_and_the_file(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 40,
                                                    "intermediate_size": 128, "num_hidden_layers": 1}))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(folder), **CPU)
    assert f"{folder}/config.json" in e.value.message and "lacks 'num_attention_heads'" in e.value.message


# 6-8. --quantization, --dtype, --kv-cache-dtype, --device: refused before loading

@pytest.fixture
def no_loading(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loader, "load_model", load)
    monkeypatch.setattr(engine_model, "load_model", load)


@pytest.mark.parametrize("value", ["awq", "gptq", "int3"])
def test_an_unknown_quantization_is_one_line_before_loading(value, no_loading, capsys):
    with pytest.raises(TallowError) as e:
        EngineConfig(quantization=value)
    message = e.value.message
    assert repr(value) in message and "AWQ and GPTQ checkpoints are not supported" in message
    for accepted in QUANTIZATIONS:
        assert accepted in message
    assert main(["generate", "hi", "--quantization", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tallow generate: error: unknown quantization") and err.count("\n") == 1
    with pytest.raises(ValueError, match="int8-torch"):
        quant.quantize_model_(torch.nn.Linear(4, 4), value)


def test_the_quantization_names_are_the_weight_formats():
    assert set(QUANTIZATIONS) == set(quant.SCHEMES) | {"auto", "fp8"}
    for value in QUANTIZATIONS:
        EngineConfig(quantization=value)


def test_dtype_float_is_float32():
    assert engine_model.resolve_dtype("float", torch.device("cpu")) is torch.float32
    EngineConfig(dtype="float")
    with pytest.raises(TallowError, match="float32") as e:
        EngineConfig(dtype="float64")
    assert "'float64'" in e.value.message


@pytest.mark.parametrize("value", ["fp8_e5m2", "q4_0", "float64"])
def test_an_unknown_kv_cache_dtype_lists_the_caches_own_choices(value, no_loading, capsys):
    with pytest.raises(TallowError) as e:
        EngineConfig(kv_cache_dtype=value)
    for message in (e.value.message, _kv_error(value)):
        assert repr(value) in message and "q8_0" in message and "fp8" in message and "int8" in message
        assert ("e5m2 is not supported" in message) == ("e5m2" in value)
    assert main(["generate", "hi", "--kv-cache-dtype", value]) == 2
    assert "unknown kv_cache_dtype" in capsys.readouterr().err


def _kv_error(value: str) -> str:
    with pytest.raises(TallowError) as e:
        engine_model.resolve_kv_cache_dtype(value, torch.float32, torch.device("cpu"), "none", 64)
    return e.value.message


@pytest.mark.parametrize("value", ["bogus", "cuda0", "mps", "auto:1"])
def test_an_unknown_device_is_one_line_before_loading(value, no_loading, capsys):
    with pytest.raises(TallowError, match="cpu, cuda or cuda:N") as e:
        EngineConfig(device=value)
    assert repr(value) in e.value.message
    with pytest.raises(TallowError, match="cuda:N"):
        engine_model.resolve_device(value)
    assert main(["generate", "hi", "--device", value]) == 2
    err = capsys.readouterr().err
    assert "unknown device" in err and "Traceback" not in err


def test_cuda_without_cuda_is_one_line_before_loading(monkeypatch, no_loading, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for value in ("cuda", "cuda:1"):
        with pytest.raises(TallowError, match="--device cpu") as e:
            EngineConfig(device=value)
        assert repr(value) in e.value.message
        with pytest.raises(TallowError, match="--device cpu"):
            engine_model.resolve_device(value)
    assert main(["generate", "hi", "--device", "cuda"]) == 2
    assert "device 'cuda'" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(TallowError, match="only 1 CUDA device"):
        EngineConfig(device="cuda:1")
    assert EngineConfig(device="auto").device == "auto" and EngineConfig(device="cpu").device == "cpu"
