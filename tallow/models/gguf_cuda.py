"""GGUF weights on CUDA in their own block formats: the one place that turns a GGUF tensor into
the layer that runs it on the GPU (`cuda_linear`, `CudaQuantEmbedding`), and the loader that
builds a whole model from a file's tensors with them (`load_blocks`).

- Block-quantized projections (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K) become
  `TritonQuantLinear` (tallow/ops/triton_quant.py): the file's blocks split into planes on the
  device (tallow/ops/triton_quant_layout.py), read by the Triton GEMV (decode) and GEMM
  (prefill). Fused q/k/v and gate/up are one layer where their parts share a type (the rows
  concatenated), else a `ConcatLinear` (gguf_linear.py) of one layer per run of parts (Q4_K_M's Q6_K attn_v).
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
from tallow.models.gguf import set_layer_norms
from tallow.models.gguf_linear import ConcatLinear

BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class RawTensors(Protocol):
    """Where load_blocks reads a model's tensors from (GGUF names: blk.0.attn_q.weight)."""

    def has(self, name: str) -> bool: ...

    def type_name(self, name: str) -> str: ...  # GGML type name: Q4_K, F32, ...

    def shape(self, name: str) -> tuple[int, int]: ...  # (rows, columns) = (out, in); 1-D: (n, 1)

    def raw(self, name: str, device: torch.device) -> torch.Tensor: ...  # uint8 [rows, row_bytes]


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


def _block_shape(type_name: str) -> tuple[int, int]:
    """(elements, bytes) per block; float types: one element of its size."""
    from tallow.ops.triton_quant_layout import BLOCK_SIZES

    if type_name in FLOAT_TYPES:
        return 1, _FLOAT_DTYPES[type_name].itemsize
    return BLOCK_SIZES[type_name]


def shards_fit(config: ModelConfig, src: RawTensors, shard) -> bool:
    """Whether every row-parallel projection (o, down) of a tensor-parallel shard starts and
    ends its input slice on block boundaries (256 for the K-quants, 32 for the others). When not,
    the blocks cannot be split there (the loader dequantizes such a file instead)."""
    for i in range(config.num_hidden_layers):
        for kind, span in (("attn_output", "q"), ("ffn_down", "mlp")):
            elems = _block_shape(src.type_name(f"blk.{i}.{kind}.weight"))[0]
            start, length = shard.span(span)
            if start % elems or length % elems:
                return False
    return True


def load_blocks(config: ModelConfig, src: RawTensors, device: torch.device, dtype: torch.dtype, parallel=None):
    """A LlamaForCausalLM on `device` (CUDA) whose projections, embedding and LM head keep the
    source's block formats (module docstring). Norms in dtype, as the dense path holds them.
    With parallel (a ParallelContext), this rank's Megatron shard: column-parallel q/k/v and
    gate/up keep their rows of the shard, row-parallel o and down their input columns (whole
    blocks: shards_fit must hold), the embedding and LM head their vocabulary rows (the LM head
    padded with zero blocks to vocab_per_rank)."""
    from tallow.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM._skeleton(config, dtype, None, parallel)  # on the meta device
    shard = model.shard
    sharded = parallel is not None
    if sharded and not shards_fit(config, src, shard):
        raise ValueError("the row-parallel projections' input slices do not fall on block boundaries")

    def rows(t: torch.Tensor, kind: str | None) -> torch.Tensor:
        if not sharded or kind is None:
            return t
        start, length = shard.span(kind)
        return t[start:start + length]

    def bias(names: list[str], kinds: list[str | None]) -> torch.Tensor | None:
        if not src.has(f"{names[0]}.bias"):
            return None
        return torch.cat([rows(_floats(src, f"{n}.bias", device), k) for n, k in zip(names, kinds)]).to(dtype)

    def part(name: str, n_head: int | None, row_kind: str | None, col_kind: str | None) -> torch.Tensor:
        raw = src.raw(f"{name}.weight", device)
        if n_head is not None and config.architecture == "llama":
            raw = raw.index_select(0, _interleave_index(raw.shape[0], n_head, device))
        raw = rows(raw, row_kind)
        if sharded and col_kind is not None:  # whole blocks of the input (shards_fit)
            elems, nbytes = _block_shape(src.type_name(f"{name}.weight"))
            start, length = shard.span(col_kind)
            raw = raw[:, start // elems * nbytes:(start + length) // elems * nbytes]
        return raw.contiguous()

    def projection(names: list[str], heads: list[int | None], row_kinds: list[str | None] | None = None,
                   col_kind: str | None = None) -> nn.Module:
        row_kinds = row_kinds or [None] * len(names)
        types = [src.type_name(f"{n}.weight") for n in names]
        in_features = src.shape(f"{names[0]}.weight")[1]
        if sharded and col_kind is not None:
            in_features = shard.span(col_kind)[1]
        b = bias(names, row_kinds)
        if len(set(types)) == 1:
            raws = [part(n, h, k, col_kind) for n, h, k in zip(names, heads, row_kinds)]
            raw = raws[0] if len(raws) == 1 else torch.cat(raws)
            del raws
            return cuda_linear(raw, types[0], in_features, b, dtype)
        # Runs of parts of one type share a layer (Q4_K_M's q and k; v in Q6_K on its own).
        layers, start = [], 0
        while start < len(names):
            end = start + 1
            while end < len(names) and types[end] == types[start]:
                end += 1
            raws = [part(n, h, k, col_kind) for n, h, k in zip(names[start:end], heads[start:end],
                                                                row_kinds[start:end])]
            raw = raws[0] if len(raws) == 1 else torch.cat(raws)
            del raws
            bb = None
            if b is not None:
                r0 = sum(layer.out_features for layer in layers)
                bb = b[r0:r0 + raw.shape[0]]
            layers.append(cuda_linear(raw, types[start], in_features, bb, dtype))
            start = end
        return ConcatLinear(layers)

    def norm(name: str) -> nn.Parameter:
        return nn.Parameter(_floats(src, name, device).to(dtype).contiguous(), requires_grad=False)

    def vocab_rows(name: str) -> torch.Tensor:
        """The tensor's vocabulary rows of this rank, padded with zero rows (zero blocks) to
        vocab_per_rank."""
        raw = rows(src.raw(name, device), "vocab")
        pad = shard.vocab_per_rank - raw.shape[0] if sharded else 0
        return torch.cat([raw, raw.new_zeros(pad, raw.shape[1])]) if pad > 0 else raw

    for i, layer in enumerate(model.model.layers):
        blk = f"blk.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = projection([f"{blk}.attn_q", f"{blk}.attn_k", f"{blk}.attn_v"],
                                   [config.num_attention_heads, config.num_key_value_heads, None], ["q", "kv", "kv"])
        attn.o_proj = projection([f"{blk}.attn_output"], [None], col_kind="q")
        mlp.gate_up_proj = projection([f"{blk}.ffn_gate", f"{blk}.ffn_up"], [None, None], ["mlp", "mlp"])
        mlp.down_proj = projection([f"{blk}.ffn_down"], [None], col_kind="mlp")
        set_layer_norms(layer, blk, config, norm)
    model.model.norm.weight = norm("output_norm.weight")
    vocab, hidden = src.shape("token_embd.weight")
    if vocab != config.vocab_size:
        raise ValueError(f"token_embd has {vocab} rows for a vocabulary of {config.vocab_size}")
    embd_type = src.type_name("token_embd.weight")
    embd_layer = cuda_linear(vocab_rows("token_embd.weight"), embd_type, hidden, None, dtype)
    if embd_type in BLOCK_TYPES:
        model.model.embed_tokens = CudaQuantEmbedding(embd_layer.weight, dtype)
    else:
        model.model.embed_tokens = nn.Embedding.from_pretrained(embd_layer.weight.data, freeze=True)
    if config.tie_word_embeddings:
        model.lm_head = embd_layer
    else:
        model.lm_head = cuda_linear(vocab_rows("output.weight"), src.type_name("output.weight"), hidden, None, dtype)
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


def load_gguf_blocks(path: str, reader, device: torch.device, dtype: torch.dtype, parallel=None):
    """(config, metadata, model) of a GGUF file with its block weights kept on `device` (with
    parallel: this rank's shard; ValueError where shards_fit does not hold)."""
    from tallow.models.gguf import _config

    metadata = {name: field.contents() for name, field in reader.fields.items()
                if name.startswith(("general.", "tokenizer."))}
    config = _config(reader, metadata)
    return config, metadata, load_blocks(config, GgufFileTensors(path, reader), device, dtype, parallel)
