"""Phi-3 mini 4k GGUF files (arch phi3: fused attn_qkv and ffn_up, NeoX rotary, its own output
tensor) as llama.cpp's converter writes them, against transformers' Phi3ForCausalLM on the same
random weights, float32: through the float path (F32) and kept in their types (F16, Q8_0); and
the 128k models' LongRoPE files refused by name."""

from __future__ import annotations

import pytest
import torch

from gguf_files import write_phi3_gguf
from model_utils import random_hf_model
from test_gemma3 import ATOL, check_chunks_then_decode, hf_logits, random_ids, use_backend
from tallow.errors import ModelLoadError
from tallow.models.loader import load_model

transformers = pytest.importorskip("transformers")

# Phi-3 mini's proportions (head dim 96, no GQA, untied LM head, its 2,047-token sliding window in
# the file, which tallow leaves out as llama.cpp does: the test's prompts are shorter), small.
SHAPE = dict(vocab_size=256, hidden_size=192, intermediate_size=384, num_hidden_layers=3, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
             sliding_window=2047, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def hf_phi3(seed: int = 0):
    return random_hf_model(transformers.Phi3ForCausalLM, transformers.Phi3Config(**SHAPE), seed, std=0.05,
                           norm_mean=1.0)


@pytest.mark.parametrize("weight_type", ["F32", "F16", "Q8_0"])
def test_phi3_gguf_matches_transformers(weight_type, tmp_path):
    hf = hf_phi3(seed=3)
    held = write_phi3_gguf(str(tmp_path / "p.gguf"), hf, weight_type)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.from_numpy(held[name]))
    loaded = load_model(str(tmp_path / "p.gguf"), dtype=torch.float32, device="cpu")
    model = use_backend(loaded.model, "cpu")
    c = model.config
    assert (c.architecture, c.head_dim, c.tie_word_embeddings, c.sliding_window) == ("phi3", 96, False, None)
    ids = random_ids(40, SHAPE["vocab_size"], seed=4)
    ref = hf_logits(hf, ids)
    atol = ATOL if weight_type != "Q8_0" else 2e-3 * ref.abs().max().item()
    check_chunks_then_decode(model, ref, ids, chunk_lens=(13, 15), block_size=4, atol=atol)


def test_phi3_longrope_file_is_refused_by_name(tmp_path):
    write_phi3_gguf(str(tmp_path / "p.gguf"), hf_phi3(), "F32", rope_factors=True)
    with pytest.raises(ModelLoadError, match="LongRoPE"):
        load_model(str(tmp_path / "p.gguf"), dtype=torch.float32, device="cpu")
