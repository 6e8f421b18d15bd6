"""FP8 (e4m3) weights: checkpoints that carry them, and `--quantization fp8` for float ones.

Checkpoints (a Hugging Face folder's config.json `quantization_config`), the formats vLLM
reads for Llama-family models:
- `compressed-tensors` with float-quantized 8-bit weights (`format` "float-quantized" or
  "naive-quantized", weights `type` float, `num_bits` 8, `strategy` "tensor" or "channel"):
  `<proj>.weight` float8_e4m3fn [N, K], `<proj>.weight_scale` [] / [1] (per tensor) or [N, 1]
  (per channel); `input_scale` (static activation scales) is not used: activations are
  quantized per token at run time, or not at all (weight-only GEMV / GEMM).
- `fbgemm_fp8`: `weight` float8_e4m3fn, `weight_scale` [N, 1]; `input_scale_ub` ignored.
Which projections are fp8 is read from the files' headers (a layer in the `ignore` /
`modules_to_not_convert` list is stored in bf16 and stays a plain Linear). Block-wise scales
(`weight_block_size`, DeepSeek's "fp8" format) are refused.

On CUDA (compute capability >= 8.9: e4m3 conversions and fp8 MMA) the projections are
`Fp8Linear` (tallow/ops/triton_fp8.py); a per-tensor scale is held as one per channel, so a
fused q/k/v layer keeps each part's. With tensor parallelism the weight splits like a float
one, and its per-channel scales with it along the output rows (column-parallel q/k/v,
gate/up); row-parallel o/down split along the input and keep every scale.

On the CPU an fp8 checkpoint is dequantized to the model's dtype as it loads (then
`--quantization` applies as for any float source); `--quantization fp8` is refused there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tallow.errors import ModelLoadError, TallowError
from tallow.ops.fp8 import FP8_DTYPE, dequantize

# The projections that fp8 applies to (the LM head and the embedding stay in the model's dtype,
# as in vLLM's fp8 and the checkpoints' ignore lists).
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_fp8_format(config: dict[str, Any]) -> str | None:
    """A config.json's fp8 weight format: "compressed-tensors", "fbgemm_fp8" or None (no
    quantization_config). Raises ModelLoadError for a quantization tallow does not read."""
    qc = config.get("quantization_config") or config.get("compression_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fbgemm_fp8":
        return method
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        for name, group in groups.items():
            w = (group or {}).get("weights") or {}
            if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") not in ("tensor", "channel"):
                raise ModelLoadError(f"compressed-tensors group {name!r}: only 8-bit float weights with per-tensor "
                                     f"or per-channel scales are supported (got {w})")
        if qc.get("format") not in (None, "float-quantized", "naive-quantized"):
            raise ModelLoadError(f"compressed-tensors format {qc.get('format')!r} is not supported "
                                 "(float-quantized fp8 only)")
        return method
    if method == "fp8" and qc.get("weight_block_size"):
        raise ModelLoadError("fp8 checkpoints with block-wise scales (weight_block_size) are not supported")
    raise ModelLoadError(f"quantization_config quant_method {method!r} is not supported "
                         "(compressed-tensors fp8 and fbgemm_fp8 are)")


def fp8_tensor_names(files: list[str]) -> set[str]:
    """Names of the float8_e4m3fn tensors in safetensors files (headers only)."""
    from safetensors import safe_open

    names = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if f.get_slice(name).get_dtype() == "F8_E4M3":
                    names.add(name)
    return names


def require_fp8_device(device: torch.device, what: str, param: str) -> None:
    """TallowError naming param unless device is a CUDA GPU with e4m3 support (sm_89+)."""
    if device.type != "cuda":
        raise TallowError(f"{what} runs on NVIDIA GPUs (Triton kernels, compute capability >= 8.9); "
                          f"not on {device.type}", param=param)
    if torch.cuda.get_device_capability(device) < (8, 9):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise TallowError(f"{what} needs compute capability >= 8.9 (Ada, Hopper); this GPU has {cap}", param=param)


def _projections(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(checkpoint module prefix, parent module, attribute) of every fp8-able projection."""
    for name, module in model.named_modules():
        parent_name, _, attr = name.rpartition(".")
        if attr in PROJECTIONS:
            yield parent_name, model.get_submodule(parent_name), attr


def fp8_skeleton_(model: nn.Module, fp8_names: set[str]) -> int:
    """Replace the projections whose checkpoint weights are fp8 (names in fp8_names) with empty
    Fp8Linear layers on the model's device, ready for load_weights; returns how many. A fused
    layer whose parts are stored differently (some fp8, some not) is refused."""
    from tallow.ops.triton_fp8 import Fp8Linear

    count = 0
    for parent_name, parent, attr in list(_projections(model)):
        parts = _PARTS.get(attr, (attr,))
        stored = [f"{parent_name}.{p}.weight" in fp8_names for p in parts]
        if not any(stored):
            continue
        if not all(stored):
            raise ModelLoadError(f"{parent_name}: {', '.join(parts)} are not all fp8 in the checkpoint")
        linear = getattr(parent, attr)
        setattr(parent, attr, Fp8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                        device=linear.weight.device, dtype=linear.weight.dtype))
        count += 1
    return count


@torch.no_grad()
def quantize_model_fp8_(model: nn.Module) -> int:
    """`--quantization fp8`: every float projection (nn.Linear) replaced in place by an Fp8Linear
    quantized per output channel (scale = amax / 448), one layer at a time (the float weight is
    freed as it goes); layers that are fp8 already are kept. Returns how many were replaced."""
    from tallow.ops.triton_fp8 import Fp8Linear

    count = 0
    for _, parent, attr in list(_projections(model)):
        linear = getattr(parent, attr)
        if type(linear) is nn.Linear:
            setattr(parent, attr, Fp8Linear.from_linear(linear))
            del linear
            count += 1
    if count and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the float weights' blocks back to the driver: the KV budget reads its free memory
    return count


def set_large_batch_path(model: nn.Module, path: str) -> None:
    """Every Fp8Linear of the model takes `path` for batches of w8a8_min_rows rows or more
    (EngineConfig.fp8_large_batch: "weight_only", "w8a8" or "scaled_mm")."""
    for module in model.modules():
        if type(module).__name__ == "Fp8Linear":
            module.large_batch = path


def dequantize_checkpoint(weights: Iterable[tuple[str, Any]], dtype: torch.dtype
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """An fp8 checkpoint's tensors with each fp8 weight times its weight_scale, in dtype (the CPU
    path); activation scales dropped. A weight waits for its scale (safetensors keeps names
    sorted: `weight` comes before `weight_scale`)."""
    pending: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, w in weights:
        w = w if isinstance(w, torch.Tensor) else w[...]  # a safetensors slice, read whole ([:] fails on 0-d)
        module, _, kind = name.rpartition(".")
        if kind in ("input_scale", "input_scale_ub", "input_zero_point", "weight_zero_point", "k_scale", "v_scale"):
            continue
        if kind == "weight_scale":
            if module in pending:
                yield f"{module}.weight", dequantize(pending.pop(module), w, dtype)
            else:
                scales[module] = w
        elif kind == "weight" and w.dtype == FP8_DTYPE:
            if module in scales:
                yield name, dequantize(w, scales.pop(module), dtype)
            else:
                pending[module] = w
        else:
            yield name, w
    if pending:
        raise ModelLoadError(f"fp8 weights without a weight_scale: {sorted(pending)[:4]}")


def scale_for(target_rows: int, w: torch.Tensor) -> torch.Tensor:
    """A checkpoint's weight_scale ([], [1], [N] or [N, 1]) as float32 [target_rows]."""
    w = w.float().reshape(-1)
    if w.numel() == 1:
        return w.expand(target_rows)
    return w


__all__ = ["PROJECTIONS", "checkpoint_fp8_format", "dequantize_checkpoint", "fp8_skeleton_", "fp8_tensor_names",
           "quantize_model_fp8_", "require_fp8_device", "scale_for", "set_large_batch_path"]
