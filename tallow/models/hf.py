"""Hugging Face model folders: config.json, *.safetensors (sharded or not), generation_config.json."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tallow.errors import ModelLoadError
from tallow.models.config import ModelConfig

# generation_config.json keys that are request defaults.
_GENERATION_KEYS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "max_new_tokens", "bos_token_id", "eos_token_id", "pad_token_id")


def is_hf_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def load_hf_folder(path: str, slices: bool = False
                   ) -> tuple[ModelConfig, dict[str, Any], Iterable[tuple[str, torch.Tensor]]]:
    """(config, generation defaults, weights) of a transformers model folder; with slices, the
    weights are safetensors slices (see iter_safetensors)."""
    try:
        config = ModelConfig.from_hf_dict(_read_json(os.path.join(path, "config.json")))
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{path}/config.json: {e}") from e
    gen_path = os.path.join(path, "generation_config.json")
    generation = _read_json(gen_path) if os.path.exists(gen_path) else {}
    defaults = {k: generation[k] for k in _GENERATION_KEYS if generation.get(k) is not None}
    if isinstance(defaults.get("eos_token_id"), int):
        defaults["eos_token_id"] = [defaults["eos_token_id"]]
    return config, defaults, iter_safetensors(weight_files(path), slices)


def quantization_format(path: str) -> str | None:
    """The folder's fp8 weight format ("compressed-tensors", "fbgemm_fp8") or None; a
    quantization tallow cannot read raises ModelLoadError (tallow/models/fp8.py)."""
    from tallow.models.fp8 import checkpoint_fp8_format

    return checkpoint_fp8_format(_read_json(os.path.join(path, "config.json")))


def iter_safetensors(files: list[str], slices: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files, one at a time, on the CPU. With slices, safe_open slices
    instead: indexing one reads only that part of the file (a tensor-parallel shard's), and
    only until the next item is asked for."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name) if slices else f.get_tensor(name)


def weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        names = sorted(set(_read_json(index)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise ModelLoadError(f"{path} holds no *.safetensors weights")
    return [os.path.join(path, n) for n in names]


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
