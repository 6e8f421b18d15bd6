"""GGUF weights kept in their own block formats (tallow/models/gguf_linear.py, the kernels of
tallow/ops/cpu/linear_gguf.h and the Q4/Q8 kernels): each format's codes and scales against
gguf's own `dequantize`, the kernels' products against float64 references, batch invariance
bit for bit in both builds, whole GGUF files of each format through the loader against the
float32 model of their dequantized weights, and the memory a load takes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf_files import random_blocks, write_llama_gguf
from model_utils import PagedBatches, activation_levels, block_activations, round_linear_inputs, run_all
from torch import nn

from tallow.models import gguf_linear as gl
from tallow.models import quant
from tallow.ops import cpu_native

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
LAYER_TYPE = {"Q4_0": quant.Q4Linear, "Q4_1": quant.Q4Linear, "Q8_0": quant.Q8Linear}  # others: GgufLinear

needs_kernels = pytest.mark.skipif(cpu_native.lib() is None, reason=f"no CPU kernels: {cpu_native.unavailable_reason()}")


@pytest.fixture(params=cpu_native.supported_variants() or ["none"])
def kernels(request, monkeypatch):
    """Once per instruction set this CPU runs (an AVX-512 machine checks the AVX2 build too)."""
    if cpu_native.lib() is None:
        pytest.skip("no CPU kernels")
    lib = cpu_native.load(request.param)
    monkeypatch.setattr(cpu_native, "_lib", lib)
    monkeypatch.setattr(cpu_native, "_tried", True)
    return request.param


def gguf_type(name: str):
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType[name]


def gguf_dequantized(raw: np.ndarray, name: str) -> torch.Tensor:
    """gguf's own reference: float32 [rows, in]."""
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw, gguf_type(name)).copy()).view(raw.shape[0], -1)


def random_raw(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return random_blocks(name, rows, cols, np.random.default_rng(seed))


# ---- block decoding: the file's values, exactly ----------------------------------------------

@pytest.mark.parametrize("name", FORMATS)
def test_decoded_blocks_are_gguf_dequantize_bit_for_bit(name):
    raw = random_raw(name, 24, 512)
    codes = gl.decode_blocks(raw, name)
    assert torch.equal(gl.dequantize_codes(codes, name), gguf_dequantized(raw, name))


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
def test_layers_hold_the_files_weights_exactly(name, kernels):
    """The tiles hold each code and scale once, as in the file: the layer's dequantized weight is
    gguf's dequantize bit for bit, with an output width that is not a whole number of tiles."""
    raw = random_raw(name, 40, 512, seed=1)
    layer = gl.linear_from_raw(raw, gguf_type(name), 512)
    assert type(layer) is LAYER_TYPE.get(name, gl.GgufLinear)
    assert torch.equal(layer.dequantized_weight(), gguf_dequantized(raw, name))
    # about the file's bytes (padding to whole tiles and unpacked 6-bit K scales aside)
    held = sum(b.nbytes for b in layer.buffers())
    assert held <= raw.nbytes * 48 / 40 * 1.13, (held, raw.nbytes)


@pytest.mark.parametrize("name", ["Q5_0", "Q5_K", "Q6_K"])
def test_both_plane_layouts_hold_the_codes(name):
    """The tiles in either build's plane order (words: AVX-512; lanes: AVX2) give the file's codes
    back, and every code sits where linear_gguf.h says, read one by one: code (c, 4v + i) of a
    block has its low 4 bits in byte 64 (v % 4) + 4c + i (high nibble from v = 4), bit 4 + p in
    word v's bit 4c + i (words) or in byte 4c + i's bit v (lanes) of plane p."""
    q = torch.from_numpy(np.ascontiguousarray(gl.decode_blocks(random_raw(name, 20, 512, seed=4), name)["q"]))
    planes = gl.GgufLinear.format_attrs(name)["planes"]
    packed = {layout: gl._tile_planes(q, planes, 16, layout) for layout in (0, 1)}
    for layout, p in packed.items():
        assert p.shape[-1] == 256 + 64 * planes
        assert torch.equal(gl._untile_planes(p, 20, planes, 16, layout), q), layout
    words, lanes = packed[0].numpy(), packed[1].numpy()
    assert np.array_equal(words[..., :256], lanes[..., :256])
    rng = np.random.default_rng(0)
    for n, k in zip(rng.integers(0, 20, 300), rng.integers(0, 512, 300)):
        n, k = int(n), int(k)
        code, t, c, b = int(q[n, k]), n // 16, n % 16, k // 32
        v, i = (k % 32) // 4, k % 4
        assert (lanes[t, b, 64 * (v % 4) + 4 * c + i] >> (4 * (v // 4))) & 15 == code & 15
        for p in range(planes):
            word = int.from_bytes(words[t, b, 256 + 64 * p + 8 * v: 256 + 64 * p + 8 * v + 8].tobytes(), "little")
            assert (word >> (4 * c + i)) & 1 == (code >> (4 + p)) & 1
            assert (lanes[t, b, 256 + 64 * p + 4 * c + i] >> v) & 1 == (code >> (4 + p)) & 1

@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
def test_c_repacking_equals_the_python_packing(name, kernels):
    """tl_gguf_repack (C, from the file's blocks) lays out every byte as the Python packing of
    gguf_linear.decode_blocks' codes does (quant._tile_q4 / _tile_q8 / _tile_scales,
    GgufLinear.tile_codes): two implementations of one layout, 36 rows (a partial last tile)."""
    raw = random_raw(name, 36, 512, seed=2)
    codes = gl.decode_blocks(raw, name)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    if name in ("Q4_0", "Q4_1", "Q8_0"):
        tile = cpu_native.tile_channels()
        d = t(codes["d"])
        if name == "Q8_0":
            expected = quant.Q8Linear.tile_codes(t(codes["q"]), d, tile)
        else:
            m = t(codes["m"]) if name == "Q4_1" else (d.float() * -8).half()
            expected = quant.Q4Linear.tile_codes(t(codes["q"]), d, m, tile)
    else:
        tile = cpu_native.lib().tl_gguf_tile_channels()
        expected = gl.GgufLinear.tile_codes(codes, name, tile)
    got = gl.repacked(raw, name, 512, tile)
    for key, want in expected.items():
        assert (got[key] is None) == (want is None), key
        if want is not None:
            assert got[key].dtype == want.dtype and torch.equal(got[key], want), key


# ---- the kernels' products --------------------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 37, 70], ids=["gemv", "few", "many", "chunks"])
@pytest.mark.parametrize("name", FORMATS)
def test_products_match_float64_references(name, rows, kernels):
    """Against gguf's dequantized weights in float64:
    with the activations rounded as the kernel does (activation_levels: int8 for linear_gguf.h's
    formats, 12-bit for Q4_0 / Q4_1, 16-bit for Q8_0): its integer block sums are exact, what is left is the float32 scale
    math, at most 3 roundings of 2^-24 per block of 32 (the scale product, the fma, the m term's
    fma), relative to sum |x| |w|. (Against the float activations the error is then at most
    that plus half a rounding step times |w| per input: implied, so not asserted apart.)"""
    g = torch.Generator().manual_seed(rows)
    raw = random_raw(name, 48, 512, seed=rows)
    bias = torch.randn(48, generator=g)
    layer = gl.linear_from_raw(raw, gguf_type(name), 512, bias)
    w = gguf_dequantized(raw, name).double()
    x = torch.randn(rows, 512, generator=g) * torch.logspace(-3, 1, 512)  # blocks of very different scales
    y = layer(x)
    assert y.shape == (rows, 48) and y.dtype == torch.float32
    scale = (x.abs().double() @ w.abs().T).max().item()
    rounded = block_activations(x, activation_levels(name))
    torch.testing.assert_close(y.double(), rounded @ w.T + bias.double(), rtol=0,
                               atol=3 * (512 // 32) * 2.0**-24 * scale)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", FORMATS)
def test_rows_do_not_depend_on_the_batch(name, threads, kernels):
    """A row's output bit for bit the same alone, in small batches and across row chunks."""
    layer = gl.linear_from_raw(random_raw(name, 80, 512, seed=7), gguf_type(name), 512, torch.randn(80))
    x = torch.randn(70, 512)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = layer(x)
        for rows in (1, 2, 3, 4, 5, 16, 33, 65):
            assert torch.equal(layer(x[:rows]), full[:rows]), rows
        assert torch.equal(layer(x[41:42]), full[41:42])
    finally:
        torch.set_num_threads(old)


@needs_kernels
@pytest.mark.parametrize("name", list(gl.GGUF_KERNEL_FORMATS))
def test_the_amx_kernel_computes_the_floats_of_the_vnni_one(name):
    """Where AMX tiles are on (their probe passed), 5 rows and more of these formats run on
    them (linear_gguf_amx.h): bit for bit the floats of the AVX-512 VNNI loop with the tiles
    off, across the 16-row tile groups, the 64-row chunks and a partial last tile."""
    if cpu_native.variant() != "avx512" or cpu_native.amx_state() != "on":
        pytest.skip(f"AMX not in use here ({cpu_native.amx_state()})")
    layer = gl.linear_from_raw(random_raw(name, 40, 768, seed=9), gguf_type(name), 768, torch.randn(40))
    x = torch.randn(150, 768, generator=torch.Generator().manual_seed(10)) * torch.logspace(-3, 1, 768)
    kernels = cpu_native.lib()
    try:
        for rows in (5, 7, 16, 17, 40, 64, 65, 150):
            kernels.tl_amx_set(0)
            vnni = layer(x[:rows])
            kernels.tl_amx_set(1)
            assert torch.equal(layer(x[:rows]), vnni), rows
    finally:
        kernels.tl_amx_set(1)


@needs_kernels
@pytest.mark.parametrize("name", list(gl.GGUF_KERNEL_FORMATS))
def test_both_builds_compute_the_same_floats(name):
    """linear_gguf.h's lanes are output channels in both builds and the float math is the
    same operations in the same order: the AVX2 and AVX-512 kernels agree bit for bit."""
    variants = cpu_native.supported_variants()
    if len(variants) < 2:
        pytest.skip("one instruction set here")
    raw, x = random_raw(name, 40, 512, seed=3), torch.randn(6, 512)
    outs = []
    for v in variants:
        lib = cpu_native.load(v)
        old = cpu_native._lib, cpu_native._tried
        cpu_native._lib, cpu_native._tried = lib, True
        try:
            outs.append(gl.linear_from_raw(raw, gguf_type(name), 512)(x))
        finally:
            cpu_native._lib, cpu_native._tried = old
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_weights_stay_half_and_rows_do_not_depend_on_the_batch(dtype, kernels):
    """F16 / BF16 weights are held as stored; each output is a float32 dot product: within the
    worst case of two 256-step float32 sums (256 * 2^-24 of sum |x| |w|) of the float64
    product, and bit for bit the same alone and batched, with 1 or 2 threads."""
    name = {torch.float16: "F16", torch.bfloat16: "BF16"}[dtype]
    w = (torch.randn(37, 512) * 0.05).to(dtype)
    raw = w.view(torch.uint8).numpy()
    layer = gl.linear_from_raw(raw, name, 512, torch.randn(37))
    assert type(layer) is gl.HalfLinear and layer.weight.dtype == dtype and torch.equal(layer.weight, w)
    x = torch.randn(70, 512)
    ref = x.double() @ w.double().T + layer.bias.double()
    scale = (x.abs().double() @ w.abs().double().T).max().item()
    old = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            full = layer(x)
            torch.testing.assert_close(full.double(), ref, rtol=0, atol=256 * 2.0**-24 * scale)
            for rows in (1, 2, 5, 33):
                assert torch.equal(layer(x[:rows]), full[:rows]), rows
        finally:
            torch.set_num_threads(old)


@needs_kernels
def test_k_formats_need_whole_super_blocks():
    with pytest.raises(ValueError, match="divisible by 256"):
        gl.GgufLinear.from_codes({"q": np.zeros((16, 288), np.uint8)}, "Q4_K")


def test_without_kernels_a_layer_is_dequantized_on_its_own(monkeypatch):
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_tried", True)
    raw = random_raw("Q6_K", 16, 256)
    layer = gl.linear_from_raw(raw, gguf_type("Q6_K"), 256)
    assert type(layer) is gl.DequantizedLinear and torch.equal(layer.weight, gguf_dequantized(raw, "Q6_K"))
    # not a plain nn.Linear: --quantization does not re-quantize it
    assert quant.quantize_model_(nn.Sequential(layer), "int4") == "int4" and type(layer) is gl.DequantizedLinear


@pytest.mark.parametrize("name", ["Q8_0", "Q6_K", "Q4_K", "F16", "F32"])
def test_embedding_dequantizes_only_the_rows_looked_up(name):
    if name.startswith("F"):
        w = np.random.default_rng(0).standard_normal((50, 256)).astype(np.float32 if name == "F32" else np.float16)
        raw, ref = w.view(np.uint8), torch.from_numpy(w.astype(np.float32))
    else:
        raw = random_raw(name, 50, 256)
        ref = gguf_dequantized(raw, name)
    emb = gl.GgufEmbedding(raw, name, 256)
    ids = torch.tensor([[3, 49, 3], [0, 7, 11]])
    assert torch.equal(emb(ids), ref[ids])


# ---- whole files through the loader -------------------------------------------------------------

def logits_of(model, config, prompts: list[list[int]]) -> torch.Tensor:
    paged = PagedBatches(config, num_blocks=32, block_size=4)
    ids, positions, meta = paged.step([(i, p) for i, p in enumerate(prompts)])
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, paged.kv_caches, meta))


def reference_model(path: str):
    """The float32 model of the file's dequantized weights (gguf's dequantize, the float path)."""
    from tallow.models import gguf
    from tallow.models.llama import LlamaForCausalLM

    config, _, weights = gguf.read_gguf(path)
    model = LlamaForCausalLM.empty(config, device=torch.device("cpu"), dtype=torch.float32)
    model.load_weights(weights)
    return config, model.eval()


def round_inputs_as_the_kernels(ref: nn.Module, types: dict[str, str], tied: bool) -> None:
    """Each float Linear of the reference takes its input rounded per block as the kernel of its
    file type does (round_linear_inputs): then only float rounding separates the two models
    (int8 activations alone moved these random two-layer models' logits by 1-20% of the
    largest)."""
    of = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",), "gate_up_proj": ("ffn_gate", "ffn_up"),
          "down_proj": ("ffn_down",), "lm_head": ("token_embd" if tied else "output",)}
    for name, module in ref.named_modules():
        if isinstance(module, nn.Linear):
            levels = {activation_levels(types[t]) for t in of[name.rsplit(".", 1)[-1]]}
            assert len(levels) == 1, name
            round_linear_inputs(module, levels.pop())


ALL_OF = {name: dict.fromkeys(["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                               "token_embd", "output"], name) for name in [*FORMATS, "F16"]}
Q4_K_M = dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q6_K", attn_output="Q4_K", ffn_gate="Q4_K", ffn_up="Q4_K",
              ffn_down="Q6_K", token_embd="Q4_K", output="Q6_K")
Q5_K_M = dict(Q4_K_M, attn_q="Q5_K", attn_k="Q5_K", attn_output="Q5_K", ffn_gate="Q5_K", ffn_up="Q5_K",
              token_embd="Q5_K")


@needs_kernels
@pytest.mark.parametrize("types,arch,tied", [(ALL_OF[n], "llama", False) for n in [*FORMATS, "F16"]]
                         + [(Q4_K_M, "llama", False), (Q5_K_M, "qwen2", False), (ALL_OF["Q8_0"], "llama", True)],
                         ids=[*FORMATS, "F16", "Q4_K_M-mix", "Q5_K_M-mix-qwen2", "Q8_0-tied"])
def test_gguf_files_load_in_their_own_formats(types, arch, tied, tmp_path):
    """A random Llama (qwen2: with q/k/v biases) written in a format loads with its weights
    in that format (nothing re-quantized, no float32 cache), and its logits over a prefill of
    two sequences are those of the float32 model of its dequantized weights, each layer's input
    rounded as its kernel rounds it: within 2e-3 of the largest logit (1.5e-2 with int8 layers),
    the same argmax."""
    from tallow.models.loader import load_model

    path = str(tmp_path / "m.gguf")
    write_llama_gguf(path, types, arch=arch, tied=tied)
    cache = tmp_path / "cache"
    loaded = load_model(path, dtype=torch.float32, device="cpu", cache_dir=str(cache))
    model = loaded.model
    assert not cache.exists() or not any(cache.rglob("*.safetensors"))
    assert loaded.tokenizer_source.kind == "gguf"
    kinds = {type(m) for m in model.modules()}
    assert nn.Linear not in kinds and isinstance(model.model.embed_tokens, gl.GgufEmbedding)
    assert model.model.embed_tokens.gguf_type == types["token_embd"]
    head_type = types["token_embd" if tied else "output"]
    assert type(model.lm_head) is LAYER_TYPE.get(head_type, gl.GgufLinear if head_type in gl.GGUF_KERNEL_FORMATS
                                                 else gl.HalfLinear)
    assert getattr(model.lm_head, "gguf_type", head_type) == head_type
    if types["ffn_down"] in gl.GGUF_KERNEL_FORMATS:
        assert type(model.model.layers[0].mlp.down_proj) is gl.GgufLinear
    # quantize_model_ leaves the file's layers alone whatever --quantization says
    before = [type(m) for m in model.modules()]
    quant.quantize_model_(model, "int4")
    assert [type(m) for m in model.modules()] == before

    config, ref = reference_model(path)
    round_inputs_as_the_kernels(ref, types, tied)
    prompts = [list(range(5, 30)), [7, 3, 99, 150, 2, 2, 41]]
    out, expected = logits_of(model, config, prompts), logits_of(ref, config, prompts)
    # int8 layers: a float difference that moves one rounding moves that input by 1/127 of its
    # block's largest (Q4: 1/2047, Q8: 1/32767); 0.4-0.9% of the largest logit seen
    int8 = any(t in gl.GGUF_KERNEL_FORMATS for t in types.values())
    assert (out - expected).abs().max() <= (1.5e-2 if int8 else 2e-3) * expected.abs().max()
    assert torch.equal(out.argmax(-1), expected.argmax(-1))
    # the held weights: about the file's bytes
    held = sum(b.nbytes for b in model.buffers()) + sum(p.nbytes for p in model.parameters())
    assert held <= 1.25 * os.path.getsize(path)


def test_float32_gguf_keeps_the_float_path(tmp_path):
    """An all-F32 file is a float source: plain nn.Linear layers, which --quantization
    re-quantizes (as before)."""
    from tallow.models.loader import load_model

    path = str(tmp_path / "f32.gguf")
    write_llama_gguf(path, {}, hidden=64, inter=96)
    model = load_model(path, dtype=torch.float32, device="cpu").model
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert type(model.model.embed_tokens) is nn.Embedding


@needs_kernels
def test_load_memory_stays_near_the_file_size(tmp_path):
    """Peak RSS of loading a ~40 MB Q4_K file, over the process's footprint after its imports,
    is under the file size plus 120 MB (its float32 weights would be 8x the file)."""
    path = str(tmp_path / "big.gguf")
    write_llama_gguf(path, dict(ALL_OF["Q4_K"], token_embd="Q8_0", output="Q6_K"), hidden=2048, inter=4096,
                     heads=16, kv_heads=4, vocab=256)
    size = os.path.getsize(path)
    code = f"""
import resource, torch
from tallow.models.loader import load_model
from tallow.models import gguf, gguf_linear
import gguf as _g
from tallow.ops import cpu_native
cpu_native.lib()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
m = load_model({path!r}, dtype=torch.float32, device="cpu")
print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    base, peak = (int(v) * 1024 for v in out.split()[-2:])
    assert peak - base <= size + 120 * 2**20, (peak - base, size)


@needs_kernels
def test_default_gguf_file_loads_natively_to_the_same_logits(tmp_path):
    """The default model's file (Q4_1 projections, a Q8_0 tied embedding) loaded natively by its
    path gives bit for bit the logits of the default's cached float path after quantize_model_
    (whose Q4/Q8 re-fit holds those weights exactly): prefill and decode, fused layers."""
    from test_quant import default_gguf

    from tallow.config import EngineConfig
    from tallow.attention.cpu_backend import CpuAttentionBackend
    from tallow.engine.runner import set_attention_backend
    from tallow.models.loader import load_model

    path = default_gguf()
    outs = []
    for source, cache_dir in (("default", EngineConfig().cache_dir), (path, str(tmp_path / "cache"))):
        loaded = load_model(source, dtype=torch.float32, device="cpu", cache_dir=cache_dir)
        model = loaded.model
        quant.quantize_model_(model, "auto")
        set_attention_backend(model, CpuAttentionBackend())
        paged = PagedBatches(loaded.config, num_blocks=16, block_size=16)
        steps = []
        for chunks in ([("a", list(range(100, 140))), ("b", [5, 6, 7])], [("a", [9]), ("b", [11])]):
            ids, positions, meta = paged.step(chunks)
            with torch.no_grad():
                steps.append(model.compute_logits(model(ids, positions, paged.kv_caches, meta)))
        assert model.model.__dict__["_fused"][1] is not None  # one kernel call per layer
        outs.append((type(model.model.embed_tokens), steps))
    (old_embedding, old), (new_embedding, new) = outs
    assert old_embedding is nn.Embedding and new_embedding is gl.GgufEmbedding
    # the native load caches its repacked weights only (gguf_packed), never float32 ones
    assert not any((tmp_path / "cache").rglob("*.safetensors")) and any((tmp_path / "cache").rglob("*.packed"))
    assert all(torch.equal(a, b) for a, b in zip(old, new))


@needs_kernels
def test_engine_greedy_outputs_do_not_depend_on_the_batch(tmp_path):
    """Through the engine (scheduler, CPU attention, float16 KV cache, sampler) a Q4_K_M-like
    file's greedy tokens for each prompt are the same alone and batched with the others."""
    import dataclasses

    from tallow.config import EngineConfig
    from tallow.engine.core import EngineCore
    from tallow.engine.sampling import SamplingParams

    path = str(tmp_path / "m.gguf")
    write_llama_gguf(path, Q4_K_M, vocab=160)
    core = EngineCore(dataclasses.replace(EngineConfig(model=path, device="cpu"), max_num_seqs=8))
    assert type(core.loaded.model.model.layers[0].mlp.down_proj) is gl.GgufLinear
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 160, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 1)]

    together = [s.output_ids for s in run_all(core, prompts, params)]
    assert together == [run_all(core, [p], params)[0].output_ids for p in prompts]
    assert len(set(map(tuple, together))) > 1  # the outputs depend on the prompts


MIXED = dict(attn_q="Q5_0", attn_k="Q5_1", attn_v="F16", attn_output="Q8_0", ffn_gate="Q4_0", ffn_up="Q5_K",
             ffn_down="Q4_1", token_embd="Q8_0", output="Q6_K")


@needs_kernels
@pytest.mark.parametrize("types,arch", [(Q4_K_M, "llama"), (Q5_K_M, "qwen2"), (MIXED, "llama")],
                         ids=["Q4_K_M-mix", "Q5_K_M-mix-qwen2", "every-kind-mixed"])
def test_fused_layers_run_the_files_formats_bit_for_bit(types, arch, kernels, tmp_path):
    """A file's own formats (K-quants, Q5_x, F16, q/k/v and gate/up of mixed types as
    ConcatLinear) run through FusedCpuLayers, one tl_llama_layer call per layer, with the
    module path's logits bit for bit: prefill chunks of two sequences, then decode steps."""
    from tallow.attention.cpu_backend import CpuAttentionBackend
    from tallow.engine.runner import set_attention_backend
    from tallow.models.loader import load_model

    path = str(tmp_path / "m.gguf")
    write_llama_gguf(path, types, arch=arch)
    outs = []
    for fused in (True, False):
        loaded = load_model(path, dtype=torch.float32, device="cpu")
        model = loaded.model
        set_attention_backend(model, CpuAttentionBackend())
        if not fused:  # the module path: _cpu_fused's cache says "none for these objects"
            attn = model.model.layers[0].self_attn
            model.model.__dict__["_fused"] = ((attn.backend, attn.qkv_proj), None)
        paged = PagedBatches(loaded.config, num_blocks=16, block_size=16)
        steps = []
        for chunks in ([("a", list(range(5, 45))), ("b", [5, 6, 7])], [("a", [9]), ("b", list(range(50, 70)))],
                       [("a", [11]), ("b", [12])]):
            ids, positions, meta = paged.step(chunks)
            with torch.no_grad():
                steps.append(model.compute_logits(model(ids, positions, paged.kv_caches, meta)))
        assert (model.model.__dict__["_fused"][1] is not None) == fused
        outs.append(steps)
    assert all(torch.equal(a, b) for a, b in zip(*outs))
