"""Phi-3 (mini 4k style) Hugging Face folders: transformers' Phi3ForCausalLM saved with its fused
qkv_proj and gate_up_proj, loaded by tallow's loader and run against transformers on the same
folder, float32, with both CPU attention backends: with and without GQA, tied and untied LM
heads, and the sliding window transformers applies on every layer (a window of 5 over a
12-token prompt, then decode steps past it). The 128k models' LongRoPE and a partial rotary
dimension are refused by their config.json fields."""

from __future__ import annotations

import json
import os

import pytest
import torch

from model_utils import PagedBatches, random_hf_model
from test_gemma3 import ATOL, check_chunks_then_decode, hf_logits, random_ids, run, use_backend
from tallow.errors import ModelLoadError
from tallow.models.hf import load_hf_folder
from tallow.models.llama import LlamaForCausalLM
from tallow.models.loader import load_model

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# (KV heads, tied LM head, sliding window): Phi-3 mini's layout (no GQA, untied) with a window
# that the prompt passes, GQA with a tied head and no window, GQA with a window.
CASES = {"mha-untied-window5": (4, False, 5), "gqa-tied-nowindow": (2, True, None),
         "gqa-untied-window7": (2, False, 7)}


def save_phi3(path, kv_heads: int, tied: bool, window: int | None, seed: int = 0) -> None:
    """A random Phi3ForCausalLM saved as safetensors, with norm weights away from 1 so that a
    misplaced norm shows."""
    config = transformers.Phi3Config(**dict(SHAPE, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
                                            sliding_window=window))
    random_hf_model(transformers.Phi3ForCausalLM, config, seed, std=0.08, norm_mean=1.0).save_pretrained(
        path, safe_serialization=True)


def hf_from_folder(path):
    return transformers.Phi3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=list(CASES))
def folder(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    save_phi3(path, *CASES[request.param])
    return request.param, path


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_folder_matches_transformers(folder, backend):
    """Every prompt token's logits in chunks (the window of 5 passed inside the first), then
    decode steps: the same as transformers' over the whole sequence."""
    case, path = folder
    kv_heads, tied, window = CASES[case]
    hf = hf_from_folder(path)
    loaded = load_model(path, dtype=torch.float32, device="cpu")
    c = loaded.config
    assert (c.architecture, c.num_key_value_heads, c.tie_word_embeddings) == ("phi3", kv_heads, tied)
    assert [c.layer_window(i) for i in range(c.num_hidden_layers)] == [window] * c.num_hidden_layers
    model = use_backend(loaded.model, backend)
    ids = random_ids(20, SHAPE["vocab_size"], seed=4)
    check_chunks_then_decode(model, hf_logits(hf, ids), ids, chunk_lens=(12, 3), block_size=4, atol=ATOL)


def test_window_changes_the_logits_as_transformers_applies_it(tmp_path):
    """The parity above would hold for a window tallow ignored only if transformers ignored it
    too: with the same weights, a window of 5 changes transformers' logits from the 6th token on
    (a token attends to itself and the 4 before it) and tallow's alike."""
    save_phi3(tmp_path / "w", 4, False, 5)
    save_phi3(tmp_path / "full", 4, False, None)
    ids = random_ids(12, SHAPE["vocab_size"], seed=5)
    windowed, full = hf_logits(hf_from_folder(tmp_path / "w"), ids), hf_logits(hf_from_folder(tmp_path / "full"), ids)
    assert torch.equal(windowed[:5], full[:5]) and (windowed[5] - full[5]).abs().max() > 10 * ATOL
    model = load_model(str(tmp_path / "w"), dtype=torch.float32, device="cpu").model
    ours = run(model, PagedBatches(model.config, block_size=4), [("a", ids)])
    assert (ours - windowed).abs().max() < ATOL


def test_fused_weights_are_split_into_the_model(folder):
    """qkv_proj ([q; k; v] rows) and gate_up_proj ([gate; up]) land as they are in the fused
    layers, whole tensors or safetensors slices (the tensor-parallel loader's reads) alike."""
    from safetensors.torch import load_file

    _, path = folder
    ref = load_file(os.path.join(path, "model.safetensors"))
    config, _, weights = load_hf_folder(path, slices=True)
    model = LlamaForCausalLM.empty(config, device=torch.device("cpu"), dtype=torch.float32)
    model.load_weights(weights)
    for i in range(config.num_hidden_layers):
        layer = model.model.layers[i]
        assert torch.equal(layer.self_attn.qkv_proj.weight, ref[f"model.layers.{i}.self_attn.qkv_proj.weight"])
        assert torch.equal(layer.mlp.gate_up_proj.weight, ref[f"model.layers.{i}.mlp.gate_up_proj.weight"])
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])


def edit_config(path, **fields) -> None:
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    d.update(fields)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f)


_FACTORS = {"long_factor": [1.0] * 8, "short_factor": [1.0] * 8}


@pytest.mark.parametrize("field, value, named", [
    ("rope_scaling", {"type": "longrope", **_FACTORS}, "rope_scaling"),
    ("rope_scaling", {"type": "su", **_FACTORS}, "rope_scaling"),  # the first Phi-3 128k configs'
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 10000.0, **_FACTORS,
                         "original_max_position_embeddings": 128}, "rope_parameters"),  # transformers 5's
    ("partial_rotary_factor", 0.5, "partial_rotary_factor"),  # top level, as Phi-4-mini's (0.75)
    ("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
])
def test_longrope_and_partial_rotary_are_refused_by_field(tmp_path, field, value, named):
    save_phi3(tmp_path, 4, False, None)
    edit_config(tmp_path, **{field: value})
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    message = str(e.value)
    assert named in message and "config.json" in message
    assert ("LongRoPE" in message) == (named != "partial_rotary_factor")
