"""GGUF files: metadata -> ModelConfig, tensors -> float32 weights with transformers names.

Reading and dequantizing a GGUF takes seconds, so the loader keeps the converted model in a
cache: one safetensors file with the engine's own state dict (fused weights), the config and
the metadata, keyed by the GGUF's path, size and mtime. A warm load maps that file and uses
its tensors in place. Float32, because the dequantized values (a float16 scale times a small
integer, plus a float16 offset) are not exact in float16 or bfloat16.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from tallow.errors import ModelLoadError
from tallow.models.config import ModelConfig

_CACHE_FORMAT = 2
_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight"""
    base, _, kind = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    elif base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ModelLoadError(f"unknown GGUF tensor {gguf_name!r}")


def read_gguf(path: str) -> tuple[ModelConfig, dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    """(config, metadata, weights) of a GGUF file. metadata holds the general.* and
    tokenizer.* keys as plain Python values; weights are float32 with transformers names."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    metadata = {name: field.contents() for name, field in reader.fields.items()
                if name.startswith(("general.", "tokenizer."))}
    config = _config(reader, metadata)
    return config, metadata, _dequantized(reader, config)


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
    header = {"config": json.dumps(dataclasses.asdict(config)), "metadata": json.dumps(metadata)}
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        save_file(state_dict, tmp, metadata=header)
        os.replace(tmp, cache)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)


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
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=[] if eos is None else [eos],
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
    )


def _dequantized(reader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        name = hf_name(t.name)
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(t.shape)])
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
