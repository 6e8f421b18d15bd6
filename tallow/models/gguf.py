"""GGUF files: metadata -> ModelConfig; tensors either kept in their own formats
(`load_native`) or dequantized to float32 weights with transformers names (`read_gguf`).

load_native (a file with block-quantized, F16 or BF16 weights, on the CPU in float32, without
tensor parallelism): each weight is read from the file on its own and repacked into its
kernel's layout in its file type (tallow/models/gguf_linear.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K, F16, BF16; F32 weights are plain float32 nn.Linear layers that
--quantization may re-quantize), the embedding stays in the memory-mapped file (rows
dequantized as looked up), the LM head in its file type. Nothing is materialized as float32
beyond one tensor's rows at a time: memory stays about the file's size. With a cache folder the
repacked buffers go to disk, and a later load maps them instead (tallow/models/gguf_packed.py).

read_gguf (float32 files, tensor parallelism, other devices, the default model): reading and
dequantizing takes seconds, so the loader keeps the converted model in a cache: one
safetensors file with the engine's own state dict (fused weights), the config and the
metadata, keyed by the GGUF's path, size and mtime. A warm load maps that file and uses its
tensors in place. Float32, because the dequantized values (a float16 scale times a small
integer, plus a float16 offset) are not exact in float16 or bfloat16.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import mmap
import os
import re
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from tallow.errors import ModelLoadError
from tallow.models.cache_files import remove_stale, source_key
from tallow.models.config import ModelConfig

log = logging.getLogger("tallow.models")

_CACHE_FORMAT = 3  # 3: files with quantized weights load natively, never cached
_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3's four norms per layer: ffn_norm is the one before the MLP there.
_GEMMA3_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3's fused projections, under its checkpoints' names (LlamaForCausalLM.load_weights splits them).
_PHI3_FUSED = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight"""
    base, _, kind = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        names = dict(_BLOCK_NAMES, **{"gemma3": _GEMMA3_NORMS, "phi3": _PHI3_FUSED}.get(arch, {}))
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
    elif base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ModelLoadError(f"unknown GGUF tensor {gguf_name!r}")


def projection_tensors(config: ModelConfig, blk: str) -> tuple[tuple[list[str], list[int | None]], ...]:
    """A layer's q/k/v and gate/up projections as GGUF tensors whose rows, side by side, are the
    fused projection's, each with the head count that undoes llama.cpp's q/k row interleave (None:
    nothing to undo). Phi-3's files keep its checkpoints' fused tensors: attn_qkv (q, k, v rows)
    and ffn_up (the gate's rows, then the up projection's); the float path reads them under
    those checkpoints' names (hf_name), split by LlamaForCausalLM.load_weights."""
    if config.architecture == "phi3":
        return ([f"{blk}.attn_qkv"], [None]), ([f"{blk}.ffn_up"], [None])
    return (([f"{blk}.attn_q", f"{blk}.attn_k", f"{blk}.attn_v"],
             [config.num_attention_heads, config.num_key_value_heads, None]),
            ([f"{blk}.ffn_gate", f"{blk}.ffn_up"], [None, None]))


class _Field:
    """A metadata value; contents() as gguf.ReaderField gives it (plain Python values)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def contents(self) -> Any:
        return self.value


@dataclasses.dataclass
class GgufTensor:
    """A tensor's entry, with gguf.ReaderTensor's fields: shape in GGUF's order (ne0 first),
    data a view of the memory-mapped file shaped as GGUFReader shapes it (float and integer
    types by element, the block types as bytes [..., row_bytes])."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


SPLIT_NAME = re.compile(r"(?P<stem>.*)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf", re.IGNORECASE)


def split_message(path: str, count: int, index: int | None = None) -> str:
    """What to do with a shard of a split GGUF (llama.cpp's llama-gguf-split output, *-00001-of-0000N.gguf).
    tallow reads one file: the memory-mapped GGUF readers, the CUDA block loader and the repacked-weight
    cache all key a tensor by one file's path and offset, so the shards are merged first."""
    folder, base = os.path.split(path)
    m = SPLIT_NAME.fullmatch(base)
    if m:
        first = os.path.join(folder, f"{m['stem']}-{1:05d}-of-{m['count']}{base[-5:]}")
        merged = os.path.join(folder, f"{m['stem']}.gguf")
        part = int(m["part"])
    else:
        first, merged, part = path, os.path.join(folder, "merged.gguf"), None if index is None else index + 1
    which = f"part {part} of {count}" if part else f"one of {count} parts"
    return (f"{path} is {which} of a split GGUF, and split GGUF files are not supported (tallow loads one file): "
            f"merge the parts with llama.cpp's `llama-gguf-split --merge {first} {merged}` and pass {merged}")


class GgufFile:
    """A GGUF file's metadata and tensor entries, parsed with struct on a memory map, nothing
    else read: gguf.GGUFReader's fields and tensors for the loader. GGUFReader builds numpy
    views for every item of every array (a 262,144-token vocabulary took it ~20 s here); this
    takes a fraction of a second."""

    _ELEMENT_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                      "I32": np.int32, "I64": np.int64}

    def __init__(self, path: str):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        from tallow.tokenizer import _gguf_string, _gguf_value

        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ValueError("empty file")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != b"GGUF":
            raise ValueError("not a GGUF file")
        if len(buf) < 24:
            raise ValueError("truncated or corrupt header")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF v{version} is not supported")
        try:
            pos, self.fields = 24, {}
            for _ in range(n_kv):
                key, pos = _gguf_string(buf, pos)
                (value_type,) = struct.unpack_from("<I", buf, pos)
                value, pos = _gguf_value(buf, pos + 4, value_type, keep=True)
                self.fields[key] = _Field(value)
                if pos > len(buf):  # a length past the end of the file
                    raise ValueError("past the end")
            entries = []
            for _ in range(n_tensors):
                name, pos = _gguf_string(buf, pos)
                (n_dims,) = struct.unpack_from("<I", buf, pos)
                if n_dims > 8 or pos > len(buf):
                    raise ValueError("past the end")
                dims = np.frombuffer(buf, np.uint64, n_dims, pos + 4).copy()
                kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
                pos += 4 + 8 * n_dims + 12
                entries.append((name, dims, kind, offset))
        except (struct.error, ValueError, IndexError, OverflowError, MemoryError, ModelLoadError) as e:
            # a length or count past the end of the file: not struct's "requires a buffer of 10^19 bytes"
            raise ValueError("truncated or corrupt header") from e
        known = {int(t) for t in GGMLQuantizationType}
        for name, _, kind, _ in entries:
            if kind not in known:
                raise ValueError(f"tensor {name}: GGML type {kind} is unknown to the installed gguf package")
        entries = [(name, dims, GGMLQuantizationType(kind), offset) for name, dims, kind, offset in entries]
        if "split.count" in self.fields and int(self.fields["split.count"].value) > 1:
            index = int(self.fields["split.no"].value) if "split.no" in self.fields else None
            raise ModelLoadError(split_message(path, int(self.fields["split.count"].value), index))
        alignment = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else 32
        start = -(-pos // alignment) * alignment
        file_bytes = np.frombuffer(buf, np.uint8)
        self.tensors = []
        for name, dims, kind, offset in entries:
            n = int(np.prod(dims))
            block, size = GGML_QUANT_SIZES[kind]
            n_bytes, at = n * size // block, start + int(offset)
            shape = tuple(int(d) for d in reversed(dims))
            element = self._ELEMENT_TYPES.get(kind.name)
            raw = file_bytes[at:at + n_bytes]
            if len(raw) != n_bytes:
                raise ValueError(f"tensor {name} is cut short")
            if element is not None:
                data = raw.view(element).reshape(shape)
            else:  # block types: bytes per row, as GGUFReader (quant_shape_to_byte_shape)
                data = raw.reshape(*shape[:-1], shape[-1] // block * size)
            self.tensors.append(GgufTensor(name, kind, dims, n, n_bytes, at, data))


def open_gguf(path: str) -> GgufFile:
    """The file's metadata and tensor entries (GgufFile: tensors memory-mapped, nothing read)."""
    try:
        return GgufFile(path)
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def read_gguf(path: str, reader=None) -> tuple[ModelConfig, dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    """(config, metadata, weights) of a GGUF file. metadata holds the general.* and
    tokenizer.* keys as plain Python values; weights are float32 with transformers names."""
    reader = reader or open_gguf(path)
    metadata = {name: field.contents() for name, field in reader.fields.items()
                if name.startswith(("general.", "tokenizer."))}
    config = _config(reader, metadata)
    return config, metadata, _dequantized(reader, config)


def quantized_weights(reader) -> bool:
    """Whether a GGUF file (its reader) holds weights in other types than F32 (block-quantized,
    F16, BF16): those that load_native keeps as they are."""
    return any(t.tensor_type.name != "F32" and t.name.endswith(".weight") and len(t.shape) == 2
               for t in reader.tensors)


def load_native(path: str, reader=None, cache_dir: str | None = None):
    """(config, metadata, LlamaForCausalLM on the CPU) with every weight in its file type (see
    the module docstring). Raises ModelLoadError on a tensor type without a layer here. With a
    cache folder the repacked weights are kept there and mapped by later loads (gguf_packed)."""
    from tallow.models.gguf_packed import PackedMismatch, PackedWeights

    packed = PackedWeights.open(path, cache_dir)
    try:
        loaded = _load_native(path, reader, packed)
        if packed is not None:
            packed.finish()
            log.info("%s: repacked weights %s %s", os.path.basename(path),
                     "mapped from" if packed.reading else "written to", packed.target)
        return loaded
    except PackedMismatch as e:  # a cache this load cannot use: dropped, and the file read afresh
        packed.drop(e)
        return load_native(path, None, cache_dir)
    except BaseException:
        if packed is not None:
            packed.abandon()
        raise


def _load_native(path: str, reader, packed):
    from tallow.models import gguf_linear as gl
    from tallow.models.llama import LlamaForCausalLM

    reader = reader or open_gguf(path)
    metadata = {name: field.contents() for name, field in reader.fields.items()
                if name.startswith(("general.", "tokenizer."))}
    config = _config(reader, metadata)
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.tensor_type.name not in gl.SUPPORTED_TYPES:
            raise ModelLoadError(f"GGUF tensor {t.name} has type {t.tensor_type.name}; tallow loads "
                                 f"{', '.join(gl.SUPPORTED_TYPES)}")
    model = LlamaForCausalLM._skeleton(config, torch.float32, None, None)  # on the meta device
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        file_bytes = np.frombuffer(mapping, dtype=np.uint8)

        def mapped(name: str):
            """(rows [rows, row_bytes] as a view of the mapped file, release(r0, r1)): a single
            tensor is repacked from the mapping, its pages dropped from memory chunk by chunk
            (madvise), so a large one (an LM head) never sits in memory twice."""
            t = tensors[name]
            off, n, rows = int(t.data_offset), int(t.n_bytes), _rows(t)
            row_bytes = n // rows

            def release(r0: int, r1: int) -> None:
                start = (off + r0 * row_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
                if hasattr(mapping, "madvise"):
                    mapping.madvise(mmap.MADV_DONTNEED, start, off + r1 * row_bytes - start)

            return file_bytes[off:off + n].reshape(rows, -1), release

        def raw(name: str) -> np.ndarray:
            """A tensor's rows as bytes [rows, row_bytes], read from the file (not through the
            memory map, whose pages would stay resident)."""
            t = tensors[name]
            f.seek(t.data_offset)
            data = np.fromfile(f, dtype=np.uint8, count=int(t.n_bytes))
            return data.reshape(_rows(t), -1)

        def floats(name: str) -> torch.Tensor:
            t = tensors[name]
            return gl.dequantize_raw(raw(name), t.tensor_type).reshape(-1)

        def rows_into(name: str, data: np.ndarray, n_head: int | None) -> None:
            """A projection's raw rows read into data [rows, row_bytes]; n_head: undo
            llama.cpp's q/k row interleave, which moves whole rows (a row is a whole number of
            blocks)."""
            t = tensors[name]
            f.seek(t.data_offset)
            if f.readinto(memoryview(data.reshape(-1))) != data.nbytes:
                raise ValueError(f"tensor {name} is cut short")
            if n_head is not None and config.architecture == "llama":
                out = data.shape[0]
                data[:] = data[np.arange(out).reshape(n_head, out // n_head // 2, 2).swapaxes(1, 2).reshape(-1)]

        def bias(names: list[str]) -> torch.Tensor | None:
            if f"{names[0]}.bias" not in tensors:
                return None
            return torch.cat([floats(f"{n}.bias") for n in names])

        def projection(names: list[str], heads: list[int | None]) -> torch.nn.Module:
            """One Linear of the parts' rows side by side (q/k/v, gate/up): one layer where they
            share a type (their rows read into one buffer), else a ConcatLinear."""
            ts = [tensors[f"{n}.weight"] for n in names]
            b = bias(names)
            in_features = _in_features(ts[0])
            key = "+".join(names)
            if len(ts) == 1 and heads[0] is None:
                data, release = mapped(f"{names[0]}.weight")
                return gl.linear_from_raw(data, ts[0].tensor_type, in_features, b, release, packed, key)
            def needs_rows(t, rows: int) -> bool:  # a repack the cache holds reads nothing (the
                # rows' buffer, never touched, costs no memory)
                return packed is None or not packed.reading or gl.kernel_layer(t.tensor_type, (rows, in_features)) is None

            if len({t.tensor_type for t in ts}) == 1:
                data = np.empty((sum(_rows(t) for t in ts), int(ts[0].n_bytes) // _rows(ts[0])), np.uint8)
                start = 0
                read = needs_rows(ts[0], data.shape[0])
                for n, t, h in zip(names, ts, heads):
                    if read:
                        rows_into(f"{n}.weight", data[start:start + _rows(t)], h)
                    start += _rows(t)
                return gl.linear_from_raw(data, ts[0].tensor_type, in_features, b, None, packed, key)
            biases = [None] * len(ts) if b is None else list(b.split([_rows(t) for t in ts]))
            parts = []
            for n, t, h, bb in zip(names, ts, heads, biases):
                data = np.empty((_rows(t), int(t.n_bytes) // _rows(t)), np.uint8)
                if needs_rows(t, data.shape[0]):
                    rows_into(f"{n}.weight", data, h)
                parts.append(gl.linear_from_raw(data, t.tensor_type, in_features, bb, None, packed, n))
            return gl.ConcatLinear(parts)

        def norm_weight(name: str) -> torch.nn.Parameter:
            return torch.nn.Parameter(floats(name).float().contiguous(), requires_grad=False)

        try:
            for i, layer in enumerate(model.model.layers):
                blk = f"blk.{i}"
                attn, mlp = layer.self_attn, layer.mlp
                qkv, gate_up = projection_tensors(config, blk)
                attn.qkv_proj = projection(*qkv)
                attn.o_proj = projection([f"{blk}.attn_output"], [None])
                mlp.gate_up_proj = projection(*gate_up)
                mlp.down_proj = projection([f"{blk}.ffn_down"], [None])
                set_layer_norms(layer, blk, config, norm_weight)
            model.model.norm.weight = norm_weight("output_norm.weight")
            embd = tensors["token_embd.weight"]
            if _rows(embd) != config.vocab_size:
                raise ValueError(f"token_embd has {_rows(embd)} rows for a vocabulary of {config.vocab_size}")
            table = embd.data.view(np.uint8).reshape(_rows(embd), -1)  # stays memory-mapped
            model.model.embed_tokens = gl.GgufEmbedding(table, embd.tensor_type, config.hidden_size)
            head = "token_embd" if config.tie_word_embeddings else "output"
            data, release = mapped(f"{head}.weight")
            model.lm_head = gl.linear_from_raw(data, tensors[f"{head}.weight"].tensor_type, config.hidden_size, None,
                                               release, packed, f"lm_head:{head}")
        except KeyError as e:
            raise ModelLoadError(f"GGUF file {path} lacks tensor {e}") from e
        except ValueError as e:
            raise ModelLoadError(f"cannot load GGUF file {path}: {e}") from e
    model.model.rotary_emb.reset_parameters(torch.device("cpu"))
    if model.model.rotary_emb_local is not None:
        model.model.rotary_emb_local.reset_parameters(torch.device("cpu"))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"GGUF file {path}: no weights for {left[:8]}")
    return config, metadata, model


def set_layer_norms(layer, blk: str, config: ModelConfig, norm) -> None:
    """A decoder layer's norm weights from block `blk`'s GGUF tensors, norm(name) -> Parameter
    (the CPU loader's and models/gguf_cuda.py's)."""
    attn = layer.self_attn
    layer.input_layernorm.weight = norm(f"{blk}.attn_norm.weight")
    if config.sandwich_norms:  # Gemma 3 (its file holds the norms as applied, 1 + w)
        layer.post_attention_layernorm.weight = norm(f"{blk}.post_attention_norm.weight")
        layer.pre_feedforward_layernorm.weight = norm(f"{blk}.ffn_norm.weight")
        layer.post_feedforward_layernorm.weight = norm(f"{blk}.post_ffw_norm.weight")
    else:
        layer.post_attention_layernorm.weight = norm(f"{blk}.ffn_norm.weight")
    if config.qk_norm:
        attn.q_norm.weight = norm(f"{blk}.attn_q_norm.weight")
        attn.k_norm.weight = norm(f"{blk}.attn_k_norm.weight")


def _rows(t) -> int:
    return int(np.prod([int(d) for d in t.shape[1:]]))


def _in_features(t) -> int:
    return int(t.shape[0])


def read_cache(path: str, cache_dir: str) -> tuple[ModelConfig, dict[str, Any], dict[str, torch.Tensor]] | None:
    """(config, metadata, state dict) cached for this GGUF file, or None. The tensors are
    memory-mapped from the cache file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    cache = _cache_path(path, cache_dir)
    if not os.path.exists(cache):
        return None
    with safe_open(cache, framework="pt") as f:
        header = f.metadata()
    return ModelConfig(**json.loads(header["config"])), json.loads(header["metadata"]), load_file(cache)


def write_cache(path: str, cache_dir: str, config: ModelConfig, metadata: dict[str, Any],
                state_dict: dict[str, torch.Tensor]) -> None:
    """Store a converted model for read_cache. Failing to write only costs the next load time."""
    from safetensors.torch import save_file

    cache = _cache_path(path, cache_dir)
    tmp = f"{cache}.{os.getpid()}.tmp"
    header = {"config": json.dumps(dataclasses.asdict(config)), "metadata": json.dumps(metadata),
              "source": json.dumps(source_key(path))}
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        remove_stale(path, cache, ".safetensors", _safetensors_source)
        save_file(state_dict, tmp, metadata=header)
        os.replace(tmp, cache)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)


def _safetensors_source(cache: str) -> list | None:
    from safetensors import safe_open

    with safe_open(cache, framework="pt") as f:
        return json.loads((f.metadata() or {}).get("source", "null"))


def _config(reader, metadata: dict[str, Any]) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(_ARCHITECTURES)})")

    def get(key: str, default: Any = None) -> Any:
        field = reader.fields.get(f"{arch}.{key}")
        return default if field is None else field.contents()

    tensors = {t.name: t for t in reader.tensors}
    hidden, heads = get("embedding_length"), get("attention.head_count")
    rope_scaling = None
    if "rope_freqs.weight" in tensors:  # llama3-style scaling, stored as per-frequency divisors
        rope_scaling = {"rope_type": "freq_factors",
                        "freq_factors": np.asarray(tensors["rope_freqs.weight"].data, np.float32).tolist()}
    elif get("rope.scaling.type", "none") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    elif get("rope.scaling.type", "none") != "none":
        raise ModelLoadError(f"unsupported GGUF rope scaling {get('rope.scaling.type')!r}")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    gemma = _gemma3_options(arch, get, hidden, heads) if arch == "gemma3" else {}
    if arch == "phi3":
        # Phi-3's 128k models scale their rotary frequencies by LongRoPE factors, stored as two
        # tensors; the 4k models have none. Their `attention.sliding_window` (2047) is left out,
        # as llama.cpp leaves it out for phi3.
        if any(name.startswith("rope_factors") for name in tensors):
            raise ModelLoadError("GGUF phi3 with LongRoPE factors (rope_factors_long / rope_factors_short: the "
                                 "128k-context Phi-3 models) is not supported; the 4k-context models load")
        if get("rope.dimension_count", hidden // heads) != hidden // heads:
            raise ModelLoadError(f"GGUF phi3: a partial rotary dimension ({get('rope.dimension_count')} of "
                                 f"{hidden // heads}) is not supported")
    return ModelConfig(
        architecture=arch,
        vocab_size=get("vocab_size") or len(metadata["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=get("attention.key_length", hidden // heads),
        max_position_embeddings=get("context_length", 4096),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=get("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=[] if eos is None else [eos],
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
        **gemma,
    )


def _gemma3_options(arch: str, get, hidden: int, heads: int) -> dict[str, Any]:
    """ModelConfig's Gemma 3 fields from a gemma3 GGUF's metadata, as llama.cpp reads them: the
    sliding window on `attention.sliding_window_pattern` layers (a period, default 6: the last
    layer of each period attends globally; or a list of booleans), the local rotary theta
    `rope.freq_base_swa` (default 10,000), and a query scale of head_dim ** -0.5 except for the
    62-layer (27B) model's (hidden / heads) ** -0.5 (transformers' query_pre_attn_scalar)."""
    if get("final_logit_softcapping") or get("attn_logit_softcapping"):
        raise ModelLoadError(f"GGUF {arch}: logit softcapping is not supported")
    layers, head_dim = get("block_count"), get("attention.key_length", 256)
    window, layer_types = get("attention.sliding_window"), None
    if window:
        pattern = get("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            sliding = [bool(p) for p in pattern]
        else:  # llama.cpp's set_swa_pattern: 0 = every layer slides
            sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
        layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    return dict(
        layer_types=layer_types,
        sliding_window=int(window) if window else None,
        rope_local_theta=float(get("rope.freq_base_swa", 10_000.0)),
        query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
        scale_embeddings=True,
        sandwich_norms=True,
        hidden_act="gelu_pytorch_tanh",
    )


def _dequantized(reader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        name = hf_name(t.name, config.architecture)
        if config.architecture == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # the file holds Gemma's 1 + w; transformers' checkpoints hold w
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp's converter interleaves the two rotary halves of each head: undo it.
            n_head = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            out, cols = w.shape
            w = w.reshape(n_head, out // n_head // 2, 2, cols).swapaxes(1, 2).reshape(out, cols)
        if not (w.flags.writeable and w.flags.c_contiguous):  # F32 tensors are views of the file
            w = np.array(w)
        yield name, torch.from_numpy(w)


def _cache_path(path: str, cache_dir: str) -> str:
    st = os.stat(path)
    key = f"{_CACHE_FORMAT}|{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"
    stem = os.path.basename(path).removesuffix(".gguf")
    return os.path.join(cache_dir, "gguf", f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors")
