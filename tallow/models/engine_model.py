"""EngineModel: the model as the engine runs it, from an EngineConfig's load-time choices.

One place resolves what an EngineConfig leaves to "auto" or names as a string (the device,
the model's dtype, the KV cache's dtype, the CPU weight format) and loads the model with it.
EngineCore (rank 0) and every tensor-parallel worker (tallow/distributed/workers.py) load
through load_engine_model(), so all ranks agree on dtypes and quantization; the tokenizer is
rank 0's alone (load_tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tallow.config import (DTYPE_NAMES, FP8_KV_NAMES, INT8_KV_NAMES, EngineConfig, check_device, dtype_error,
                           kv_cache_dtype_error)
from tallow.errors import ModelLoadError, TallowError
from tallow.models.loader import LoadedModel, TokenizerSource, load_model

if TYPE_CHECKING:
    from tallow.distributed.group import ParallelContext
    from tallow.tokenizer import Tokenizer


@dataclass
class EngineModel:
    """A loaded model (this rank's shard with tensor parallelism) on its device and dtype,
    its weights in the format chosen, and the dtype its KV cache holds."""

    loaded: LoadedModel
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    quantization: str  # the weight format applied ("none" off the CPU or when asked for; "fp8")
    # An fp8 KV cache's per-tensor scale (k and v of every layer); None: calibrated from the
    # first prefill (EngineConfig.kv_cache_scale).
    kv_scale: float | None = 1.0


def load_engine_model(config: EngineConfig, device: torch.device, *, parallel: ParallelContext | None = None,
                      loaded: LoadedModel | None = None) -> EngineModel:
    """Load config.model on `device` (with parallel: this rank's shard; `loaded`: a model
    loaded already, used as it is), quantize it on the CPU as config.quantization says, and
    resolve the KV cache's dtype."""
    dtype = resolve_dtype(config.dtype, device)
    kv_scale = resolve_kv_cache_scale(config.kv_cache_scale)
    if config.fp8_large_batch not in FP8_LARGE_BATCH_PATHS:
        raise TallowError(f"fp8_large_batch {config.fp8_large_batch!r}: one of {', '.join(FP8_LARGE_BATCH_PATHS)}",
                          param="fp8_large_batch")
    if config.quantization == "fp8":  # refused before anything loads
        from tallow.models.fp8 import require_fp8_device

        require_fp8_device(device, "quantization 'fp8'", "quantization")
    if ((config.kv_cache_dtype in FP8_KV_NAMES and device.type != "cuda")
            or (config.kv_cache_dtype in INT8_KV_NAMES and device.type != "cpu")):
        resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device, config.quantization, 0)  # raises
    if loaded is None:
        # The default's Q4_1 / Q8_0 blocks are the int4 scheme's layers bit for bit: loaded in
        # them, it needs no float32 copy (about 600 MB less memory, 440 MB less cache on disk)
        native = True if (config.model == "default" and device.type == "cpu" and dtype == torch.float32
                          and config.quantization in ("auto", "int4")) else None
        loaded = load_model(config.model, dtype=dtype, device=device, cache_dir=config.cache_dir,
                            seed=config.seed, parallel=parallel, gguf_native=native,
                            # fp8 of a GGUF file: its blocks dequantized, then quantized to fp8
                            gguf_blocks=not (device.type == "cuda" and config.quantization in ("none", "fp8")))
    mc = loaded.config
    if device.type == "cuda" and any(mc.layer_window(i) for i in range(mc.num_hidden_layers)):
        raise ModelLoadError(f"{loaded.name}: sliding-window attention ({mc.architecture}) runs on the CPU only "
                             "(the Triton attention kernels have no window): use --device cpu")
    quantization = "none"
    if config.quantization == "fp8":  # dynamic per-channel fp8 weights (CUDA, sm_89+)
        from tallow.models.fp8 import quantize_model_fp8_

        if not quantize_model_fp8_(loaded.model) and not _has_fp8_layers(loaded.model):
            raise ModelLoadError(f"{loaded.name}: quantization 'fp8' found no float projection to quantize")
        quantization = "fp8"
    elif device.type == "cpu" and config.quantization != "none":
        from tallow.models.quant import quantize_model_

        quantization = quantize_model_(loaded.model, config.quantization)
    if quantization == "none" and _has_fp8_layers(loaded.model):
        quantization = "fp8 (checkpoint)"
    if quantization.startswith("fp8"):
        from tallow.models.fp8 import set_large_batch_path

        set_large_batch_path(loaded.model, config.fp8_large_batch)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device, config.quantization,
                                      loaded.config.head_dim)
    return EngineModel(loaded, device, dtype, kv_dtype, quantization, kv_scale)


def resolve_kv_cache_scale(value: str | float) -> float | None:
    """EngineConfig.kv_cache_scale: "calibrate" -> None, else a positive finite float."""
    if value == "calibrate":
        return None
    try:
        scale = float(value)
    except (TypeError, ValueError):
        scale = float("nan")
    if not (0.0 < scale < float("inf")):
        raise TallowError(f"kv_cache_scale {value!r}: a positive number or 'calibrate'", param="kv_cache_scale")
    return scale


FP8_LARGE_BATCH_PATHS = ("weight_only", "w8a8", "scaled_mm")


def _has_fp8_layers(model: torch.nn.Module) -> bool:
    return any(p.dtype == torch.float8_e4m3fn for p in model.parameters())


def resolve_device(name: str) -> torch.device:
    """"auto" (cuda when available, else cpu), "cpu" or "cuda[:N]" (refused where torch sees no
    such CUDA device)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device(name)
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPE_NAMES:
        raise dtype_error(name)
    return getattr(torch, DTYPE_NAMES[name])


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device, quantization: str,
                           head_dim: int) -> torch.dtype:
    """The KV cache's dtype. "auto": float16 on the CPU where tallow's kernels run a float32
    model with int4/int8 weights (attention reads half the bytes; K and V round to float16's
    11 significant bits, as llama.cpp's default cache does), else the model's dtype. A named
    dtype must be the model's, or float16 or int8 on the CPU with tallow's attention kernels
    ("int8", alias "q8_0": blocks of 32 codes and a scale, 0.56x float16's bytes, as llama.cpp's
    `-ctk q8_0 -ctv q8_0`; head_dim a multiple of 32)."""
    from tallow.attention.cpu_backend import CpuAttentionBackend, cache_supported

    if name in FP8_KV_NAMES:
        if device.type != "cuda":
            raise TallowError(f"kv_cache_dtype {name!r}: an fp8 KV cache is read by the Triton attention kernels "
                              f"(CUDA); not on {device.type}", param="kv_cache_dtype")
        return torch.float8_e4m3fn
    native = device.type == "cpu" and CpuAttentionBackend.supports(model_dtype, head_dim)
    if name in INT8_KV_NAMES:
        if not (native and cache_supported(torch.int8, head_dim)):
            where = (f"on {device.type}" if device.type != "cpu" else
                     f"for this model (dtype {str(model_dtype).removeprefix('torch.')}, head_dim {head_dim})")
            raise TallowError(f"kv_cache_dtype {name!r}: an int8 KV cache is read by tallow's CPU attention kernels "
                              f"(float32 models, head_dim a multiple of 32), not {where}", param="kv_cache_dtype")
        return torch.int8
    if name == "auto":
        quantized = quantization in ("auto", "int4", "int8")
        return torch.float16 if native and quantized else model_dtype
    if name not in DTYPE_NAMES:  # fp8_e5m2, ...: the cache's own choices, not --dtype's
        raise kv_cache_dtype_error(name)
    dtype = resolve_dtype(name, device)
    if dtype != model_dtype and not (native and dtype == torch.float16):
        raise TallowError(f"kv_cache_dtype {name!r}: the cache holds the model's dtype "
                          f"({str(model_dtype).removeprefix('torch.')}), or float16 or int8 on the CPU with tallow's kernels",
                          param="kv_cache_dtype")
    return dtype


def load_tokenizer(source: TokenizerSource) -> Tokenizer:
    """A Tokenizer from the loader's TokenizerSource."""
    from tallow.tokenizer import Tokenizer, read_gguf_tokenizer_metadata

    if source.kind == "hf":
        return Tokenizer.from_hf_dir(source.path)
    if source.kind == "gguf" and source.metadata:
        return Tokenizer.from_gguf_metadata(source.metadata, source.cache_path)
    if source.path is None:
        raise TallowError(source.note or "no tokenizer for this model", status=500, type="server_error")
    return Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(source.path))
