"""GGUF weights on CUDA in their own block formats: the one place that turns a GGUF tensor into
the layer that runs it on the GPU (`cuda_linear`, `CudaQuantEmbedding`), and the loader that
builds a whole model from a file's tensors with them (`load_blocks`).

- Block-quantized projections (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K) become
  `TritonQuantLinear` (tallow/ops/triton_quant.py): the file's blocks split into planes on the
  device (tallow/ops/triton_quant_layout.py), read by the Triton GEMV (decode) and GEMM
  (prefill). Fused q/k/v and gate/up are one layer where their parts share a type (the rows
  concatenated), else a `QuantConcat` of one layer per part (Q4_K_M's Q6_K attn_v).
- F32 / F16 / BF16 projections become nn.Linear in the model's dtype.
- The embedding stays in its file type (`CudaQuantEmbedding`: the looked-up rows dequantized
  on the device, no host sync, static shapes); the LM head is a TritonQuantLinear of its file
  type (tied: the embedding's planes, shared).

Tensors are read one at a time (a block tensor: its bytes from the file, copied to the device,
split into planes there), so no dequantized copy of the model ever exists; host memory holds one
tensor's bytes at a time. llama.cpp's q/k row interleave is undone on whole block rows.
The source of raw tensors is an interface (`RawTensors`), so a benchmark can build a model of
random blocks made on the device without a file (benchmarks/gpu_gguf_model.py).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch import nn

from tallow.models.config import ModelConfig

BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class RawTensors(Protocol):
    """Where load_blocks reads a model's tensors from (GGUF names: blk.0.attn_q.weight)."""

    def has(self, name: str) -> bool: ...

    def type_name(self, name: str) -> str: ...  # GGML type name: Q4_K, F32, ...

    def shape(self, name: str) -> tuple[int, int]: ...  # (rows, columns) = (out, in); 1-D: (n, 1)

    def raw(self, name: str, device: torch.device) -> torch.Tensor: ...  # uint8 [rows, row_bytes]


class QuantConcat(nn.Module):
    """Fused projection whose parts have different block types: outputs concatenated."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class CudaQuantEmbedding(nn.Module):
    """An embedding table held as block planes on the device; a lookup gathers the ids' rows of
    every plane and dequantizes them (torch ops on the device: no host sync, graph-safe)."""

    def __init__(self, weight, dtype: torch.dtype):
        super().__init__()
        self.weight_q, self.dtype = weight, dtype
        self.num_embeddings, self.embedding_dim = weight.N, weight.K

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        from tallow.ops.triton_quant_layout import QuantWeight, dequantize

        w = self.weight_q
        ids = input_ids.reshape(-1)
        rows = QuantWeight(w.fmt, ids.shape[0], w.K, *[None if p is None else p.index_select(0, ids) for p in
                                                        (w.qs, w.d, w.qh, w.m, w.sc, w.mn)])
        return dequantize(rows).to(self.dtype).view(*input_ids.shape, w.K)

    def extra_repr(self) -> str:
        return f"{self.weight_q.fmt}, {self.num_embeddings}, {self.embedding_dim}"


def cuda_linear(raw: torch.Tensor, type_name: str, in_features: int, bias: torch.Tensor | None,
                dtype: torch.dtype) -> nn.Module:
    """The CUDA layer of one GGUF weight: raw uint8 [out, row_bytes] on the device (block
    types) -> TritonQuantLinear; float types -> nn.Linear in dtype. bias in dtype or None."""
    from tallow.ops.triton_quant import TritonQuantLinear
    from tallow.ops.triton_quant_layout import repack

    if type_name in BLOCK_TYPES:
        return TritonQuantLinear(repack(raw, type_name, in_features), bias=bias)
    if type_name not in FLOAT_TYPES:
        raise ValueError(f"GGUF tensor type {type_name} is not supported on CUDA "
                         f"(supported: {', '.join(FLOAT_TYPES + BLOCK_TYPES)})")
    w = raw.contiguous().view(_FLOAT_DTYPES[type_name]).view(raw.shape[0], in_features).to(dtype)
    layer = nn.Linear(in_features, raw.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(w, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def _floats(src: RawTensors, name: str, device: torch.device) -> torch.Tensor:
    """A float tensor (norms, biases) as float32 on the device."""
    t = src.type_name(name)
    raw = src.raw(name, device)
    if t in FLOAT_TYPES:
        return raw.contiguous().reshape(-1).view(_FLOAT_DTYPES[t]).float()
    from tallow.ops.triton_quant_layout import dequantize, repack

    rows, cols = src.shape(name)
    return dequantize(repack(raw, t, cols)).reshape(-1)


def _interleave_index(rows: int, n_head: int, device: torch.device) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (whole rows)."""
    return torch.arange(rows, device=device).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)


def load_blocks(config: ModelConfig, src: RawTensors, device: torch.device, dtype: torch.dtype):
    """A LlamaForCausalLM on `device` (CUDA) whose projections, embedding and LM head keep the
    source's block formats (module docstring). Norms in dtype, as the dense path holds them."""
    from tallow.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM._skeleton(config, dtype, None, None)  # on the meta device

    def bias(names: list[str]) -> torch.Tensor | None:
        if not src.has(f"{names[0]}.bias"):
            return None
        return torch.cat([_floats(src, f"{n}.bias", device) for n in names]).to(dtype)

    def part(name: str, n_head: int | None) -> torch.Tensor:
        raw = src.raw(f"{name}.weight", device)
        if n_head is not None and config.architecture == "llama":
            raw = raw.index_select(0, _interleave_index(raw.shape[0], n_head, device))
        return raw

    def projection(names: list[str], heads: list[int | None]) -> nn.Module:
        types = [src.type_name(f"{n}.weight") for n in names]
        in_features = src.shape(f"{names[0]}.weight")[1]
        b = bias(names)
        if len(set(types)) == 1:
            raws = [part(n, h) for n, h in zip(names, heads)]
            raw = raws[0] if len(raws) == 1 else torch.cat(raws)
            del raws
            return cuda_linear(raw, types[0], in_features, b, dtype)
        rows = [src.shape(f"{n}.weight")[0] for n in names]
        biases = [None] * len(names) if b is None else list(b.split(rows))
        return QuantConcat([cuda_linear(part(n, h), t, in_features, bb, dtype)
                            for n, h, t, bb in zip(names, heads, types, biases)])

    def norm(name: str) -> nn.Parameter:
        return nn.Parameter(_floats(src, name, device).to(dtype).contiguous(), requires_grad=False)

    for i, layer in enumerate(model.model.layers):
        blk = f"blk.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = projection([f"{blk}.attn_q", f"{blk}.attn_k", f"{blk}.attn_v"],
                                   [config.num_attention_heads, config.num_key_value_heads, None])
        attn.o_proj = projection([f"{blk}.attn_output"], [None])
        mlp.gate_up_proj = projection([f"{blk}.ffn_gate", f"{blk}.ffn_up"], [None, None])
        mlp.down_proj = projection([f"{blk}.ffn_down"], [None])
        layer.input_layernorm.weight = norm(f"{blk}.attn_norm.weight")
        if config.sandwich_norms:
            layer.post_attention_layernorm.weight = norm(f"{blk}.post_attention_norm.weight")
            layer.pre_feedforward_layernorm.weight = norm(f"{blk}.ffn_norm.weight")
            layer.post_feedforward_layernorm.weight = norm(f"{blk}.post_ffw_norm.weight")
        else:
            layer.post_attention_layernorm.weight = norm(f"{blk}.ffn_norm.weight")
        if config.qk_norm:
            attn.q_norm.weight = norm(f"{blk}.attn_q_norm.weight")
            attn.k_norm.weight = norm(f"{blk}.attn_k_norm.weight")
    model.model.norm.weight = norm("output_norm.weight")
    rows, hidden = src.shape("token_embd.weight")
    if rows != config.vocab_size:
        raise ValueError(f"token_embd has {rows} rows for a vocabulary of {config.vocab_size}")
    embd_type = src.type_name("token_embd.weight")
    embd_layer = cuda_linear(src.raw("token_embd.weight", device), embd_type, hidden, None, dtype)
    if embd_type in BLOCK_TYPES:
        model.model.embed_tokens = CudaQuantEmbedding(embd_layer.weight, dtype)
    else:
        model.model.embed_tokens = nn.Embedding.from_pretrained(embd_layer.weight.data, freeze=True)
    if config.tie_word_embeddings:
        model.lm_head = embd_layer
    else:
        model.lm_head = projection(["output"], [None])
    model.model.rotary_emb.reset_parameters(device)
    if model.model.rotary_emb_local is not None:
        model.model.rotary_emb_local.reset_parameters(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"no weights for {left[:8]}")
    return model


class GgufFileTensors:
    """RawTensors of a GGUF file (tallow.models.gguf.GgufFile): each tensor's bytes read from the
    file on its own (not through the memory map, whose pages would stay resident) and copied to
    the device."""

    def __init__(self, path: str, reader):
        self.path = path
        self.tensors = {t.name: t for t in reader.tensors}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, int]:
        dims = [int(d) for d in self.tensors[name].shape]
        return (int(np.prod(dims[1:])) if len(dims) > 1 else dims[0], dims[0] if len(dims) > 1 else 1)

    def raw(self, name: str, device: torch.device) -> torch.Tensor:
        t = self.tensors[name]
        rows = self.shape(name)[0]
        with open(self.path, "rb") as f:
            f.seek(t.data_offset)
            data = np.fromfile(f, dtype=np.uint8, count=int(t.n_bytes))
        if data.size != int(t.n_bytes):
            raise ValueError(f"tensor {name} is cut short")
        return torch.from_numpy(data).reshape(rows, -1).to(device)


def load_gguf_blocks(path: str, reader, device: torch.device, dtype: torch.dtype):
    """(config, metadata, model) of a GGUF file with its block weights kept on `device`."""
    from tallow.models.gguf import _config

    metadata = {name: field.contents() for name, field in reader.fields.items()
                if name.startswith(("general.", "tokenizer."))}
    config = _config(reader, metadata)
    return config, metadata, load_blocks(config, GgufFileTensors(path, reader), device, dtype)
