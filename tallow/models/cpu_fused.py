"""The CPU fast path of LlamaModel: each decoder layer in one call of tallow's kernels.

A layer run module by module makes about nine kernel calls from Python (norms, four
projections, rotary, KV write, attention, silu*mul), each paying Python and ctypes overhead
that on a small model at batch 1 rivals the kernels themselves. tl_llama_layer
(tallow/ops/cpu/kernels.c) runs the same calls, in the same order and with the same
arithmetic as the module path over the same kernels, from C: one call per layer.

It applies when the model runs on the CPU in float32 with tallow's kernels throughout:
every projection a Q4Linear or Q8Linear, or one of a GGUF file's own formats (GgufLinear:
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; HalfLinear: F16, BF16; a ConcatLinear of up to three of any of
these, as the q/k/v of a Q4_K_M file), attention through CpuAttentionBackend, and no tensor
parallelism. Qwen3's q/k norms and Gemma 3's options (q/k norms, sandwich norms, GeGLU, sliding
windows with their own rotary table) run in it too: the module path computes them with the same
kernels (head_rms_norm, gelu_tanh_and_mul). Otherwise LlamaModel runs its modules.
"""

from __future__ import annotations

import ctypes

import torch

from tallow.attention.cpu_backend import cache_format
from tallow.attention.metadata import AttentionMetadata
from tallow.ops import cpu_native, gelu_tanh_and_mul, silu_and_mul


_MAX_PARTS = 3  # TL_MAX_PARTS
_Q4, _Q8, _GGUF, _HALF = range(4)  # tl_part kinds


class _Part(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("sc", ctypes.c_void_p),
                ("mn", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("kind", ctypes.c_int), ("fmt", ctypes.c_int), ("n", ctypes.c_int), ("k", ctypes.c_int)]


class _Proj(ctypes.Structure):
    _fields_ = [("part", _Part * _MAX_PARTS), ("nparts", ctypes.c_int), ("n", ctypes.c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj), ("down", _Proj),
                ("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("hidden", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("inter", ctypes.c_int),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("pre_ff_norm", ctypes.c_void_p),
                ("post_ff_norm", ctypes.c_void_p), ("cos_sin", ctypes.c_void_p),
                ("act", ctypes.c_int), ("window", ctypes.c_int)]


class _Step(ctypes.Structure):
    _fields_ = [("T", ctypes.c_int), ("B", ctypes.c_int), ("block_size", ctypes.c_int), ("kv_fmt", ctypes.c_int),
                ("bt_stride", ctypes.c_long),
                ("positions", ctypes.c_void_p), ("slot_mapping", ctypes.c_void_p), ("cos_sin", ctypes.c_void_p),
                ("query_start_loc", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p), ("block_tables", ctypes.c_void_p),
                ("x", ctypes.c_void_p), ("qkv", ctypes.c_void_p), ("attn", ctypes.c_void_p),
                ("gate_up", ctypes.c_void_p), ("act", ctypes.c_void_p)]


def _norms(layer) -> tuple:
    """A decoder layer's norm weights: input, post-attention, q, k, pre- and post-feedforward
    (None where the model has no such norm)."""
    attn = layer.self_attn
    q, k = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
    pre, post = ((layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight)
                 if layer.sandwich else (None, None))
    return layer.input_layernorm.weight, layer.post_attention_layernorm.weight, q, k, pre, post


def _parts(linear) -> list | None:
    """The layers whose outputs side by side make this projection's (a ConcatLinear's parts, or
    the layer itself), or None where one has no tl_part kind (nn.Linear, DequantizedLinear, a
    HalfLinear without its kernel)."""
    from tallow.models.gguf_linear import ConcatLinear, GgufLinear, HalfLinear
    from tallow.models.quant import Q4Linear, Q8Linear

    layers = list(linear.parts) if isinstance(linear, ConcatLinear) else [linear]
    if len(layers) > _MAX_PARTS:
        return None
    for layer in layers:
        if isinstance(layer, HalfLinear):
            if layer._fn is None or layer.weight.device.type != "cpu":
                return None
        elif not isinstance(layer, (Q4Linear, Q8Linear, GgufLinear)):
            return None
    return layers


def _part(layer) -> _Part:
    """A layer's descriptor: its weight addresses as it passes them to its own kernel."""
    from tallow.models.gguf_linear import GgufLinear, HalfLinear
    from tallow.models.quant import Q8Linear

    n, k = layer.out_features, layer.in_features
    if isinstance(layer, HalfLinear):
        bias = None if layer.bias is None else layer.bias.data_ptr()
        return _Part(layer.weight.data_ptr(), None, None, None, None, bias, _HALF,
                     int(layer.weight.dtype == torch.bfloat16), n, k)
    if isinstance(layer, GgufLinear):
        fmt, w, d, m, sc, mn, bias = layer._ptrs
        return _Part(w, d, m, sc, mn, bias, _GGUF, fmt, n, k)
    w, d, m, bias = layer._ptrs
    return _Part(w, d, m, None, None, bias, _Q8 if isinstance(layer, Q8Linear) else _Q4, 0, n, k)


def _proj(linear) -> _Proj:
    """A projection's descriptor: its parts' (see _parts) and its width."""
    parts = _parts(linear)
    proj = _Proj(nparts=len(parts), n=sum(p.out_features for p in parts))
    for i, layer in enumerate(parts):
        proj.part[i] = _part(layer)
    return proj


class FusedCpuLayers:
    """The decoder layers of a LlamaModel as tl_llama_layer descriptors (weight addresses,
    shapes). Build it after quantization; the model's weights must not move afterwards."""

    @staticmethod
    def supported(model) -> bool:
        from tallow.attention.cpu_backend import CpuAttentionBackend

        if cpu_native.lib() is None or model.parallel is not None:
            return False
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(attn.backend, CpuAttentionBackend) or mlp.act not in (silu_and_mul, gelu_tanh_and_mul):
                return False
            if any(_parts(p) is None for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
                return False
            if any(w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous()
                   for w in _norms(layer) if w is not None):
                return False
        hidden = model.layers[0].input_layernorm.weight.shape[0]
        inter = model.layers[0].mlp.down_proj.in_features
        return hidden % 8 == 0 and inter % 8 == 0 and model.layers[0].self_attn.head_dim % 8 == 0

    def __init__(self, model) -> None:
        self._fn = cpu_native.lib().tl_llama_layer
        self.layers = []
        local = model.rotary_emb_local
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            _, _, q_norm, k_norm, pre_ff, post_ff = (None if w is None else w.data_ptr() for w in _norms(layer))
            self.layers.append(_Layer(
                _proj(attn.qkv_proj), _proj(attn.o_proj), _proj(mlp.gate_up_proj), _proj(mlp.down_proj),
                layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                layer.input_layernorm.eps, attn.scale, layer.input_layernorm.weight.shape[0], attn.num_heads,
                attn.num_kv_heads, attn.head_dim, mlp.down_proj.in_features, q_norm, k_norm, pre_ff, post_ff,
                local.cos_sin_cache.data_ptr() if attn.local_rope else None, int(mlp.act is gelu_tanh_and_mul),
                attn.sliding_window or 0))
        first = self.layers[0]
        self.q_dim, self.kv_dim = first.heads * first.head_dim, first.kv_heads * first.head_dim
        self.hidden, self.inter = first.hidden, first.inter

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) after the last layer, as the module path's loop returns them."""
        T = h.shape[0]
        h = h.float().contiguous()  # the embedding lookup's fresh tensor: written in place
        residual = torch.empty_like(h)
        scratch = torch.empty(T * (self.hidden + self.q_dim + 2 * self.kv_dim + self.q_dim + 3 * self.inter))
        sizes = [self.hidden, self.q_dim + 2 * self.kv_dim, self.q_dim, 2 * self.inter, self.inter]
        parts = scratch.split([T * n for n in sizes])
        positions = positions.contiguous()
        tables = meta.block_tables
        assert positions.dtype == meta.slot_mapping.dtype == torch.int64 and tables.dtype == torch.int32
        assert tables.stride(1) == 1 and meta.query_start_loc.is_contiguous() and meta.seq_lens.is_contiguous()
        step = _Step(T, meta.seq_lens.shape[0], kv_caches[0][0].shape[1], cache_format(kv_caches[0][0]),
                     tables.stride(0), positions.data_ptr(),
                     meta.slot_mapping.data_ptr(), cos_sin_cache.data_ptr(), meta.query_start_loc.data_ptr(),
                     meta.seq_lens.data_ptr(), tables.data_ptr(), *(p.data_ptr() for p in parts))
        step_ref, threads = ctypes.byref(step), torch.get_num_threads()
        hp, rp = h.data_ptr(), residual.data_ptr()
        fn = self._fn
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            if fn(ctypes.byref(layer), step_ref, k_cache.data_ptr(), v_cache.data_ptr(), hp, rp, int(i == 0), threads):
                raise MemoryError("tl_llama_layer: out of memory for its workspace")
        return h, residual
