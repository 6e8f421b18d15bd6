"""The engine's model code for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2,
Phi-3) and Gemma 3's text model, which ModelConfig describes as a Llama with options: embeddings
scaled by sqrt(hidden), norms before and after attention and the MLP (sandwich_norms; the
norm weights held as applied, Gemma's 1 + w), q/k norms, GeGLU (gelu_tanh), a query scale of
query_pre_attn_scalar ** -0.5, and sliding-window attention on the layers layer_types names,
whose rotary embedding has its own theta (rope_local_theta).

One forward pass runs a flat batch of T tokens from many sequences (prefill chunks and
decode tokens mixed); attention reads and writes the paged KV cache through an
AttentionBackend. Linear layers are plain nn.Linear attributes with fused q/k/v and
gate/up weights, so a quantizer can swap them after loading.

The residual stream travels beside the hidden states (vLLM's layout), so that each
residual add and the RMSNorm after it are one call of tallow.ops.fused_add_rms_norm. On
CUDA those calls and the rotary embedding are Triton kernels (fewer launches, one pass
over memory), as is SwiGLU's silu(gate) * up, and a one-row step's o projection and LM head
run a Triton GEMV. On the CPU in float32 they are tallow's C kernels (tallow/ops/cpu), and
with Q4/Q8 projections each whole layer is one call (tallow/models/cpu_fused.py); elsewhere
they are the same torch ops as a plain Llama, in the same order.

With tensor parallelism (a ParallelContext), each rank holds a Megatron shard
(tallow/models/sharding.py): column-parallel fused qkv and gate/up, row-parallel o_proj
and down_proj each followed by one all-reduce, a vocab-parallel embedding (ids outside the
rank's rows masked, then an all-reduce) and LM head (rank 0 gathers the logits). Without one
the model is whole and runs no collective.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from tallow.attention.base import AttentionBackend
from tallow.attention.metadata import AttentionMetadata
from tallow.models.config import ModelConfig
from tallow.models.layers import RMSNorm, RotaryEmbedding, apply_rope
from tallow.models.sharding import ShardLayout
from tallow.ops import apply_rotary, fused_add_rms_norm, gelu_tanh_and_mul, head_rms_norm, rms_norm, silu_and_mul

if TYPE_CHECKING:
    from tallow.distributed.group import ParallelContext


def one_row_linear(linear: nn.Module, x: torch.Tensor, **config) -> torch.Tensor:
    """linear(x); a single row on CUDA goes through the Triton GEMV (tallow/ops/triton_gemv.py),
    which streams these weights faster than cuBLAS's split-K GEMM at batch 1 (the o projection
    and the LM head of Llama-3-8B on an H200). config: the kernel's tile settings."""
    if x.is_cuda and x.shape[0] == 1 and type(linear) is nn.Linear:
        from tallow.ops.triton_gemv import triton_gemv

        return triton_gemv(x, linear.weight, linear.bias, **config)
    return linear(x)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, shard: ShardLayout,
                 parallel: ParallelContext | None = None, layer: int = 0):
        super().__init__()
        # Sliding-window layers (Gemma 3; every layer of a Phi-3 HF folder) attend to their last
        # `sliding_window` positions; Gemma 3's rotate with the local rotary table.
        self.sliding_window = config.layer_window(layer)
        self.local_rope = self.sliding_window is not None and config.rope_local_theta is not None
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = config.head_dim
        q_dim, kv_dim = shard.num_heads * config.head_dim, shard.num_kv_heads * config.head_dim
        self.qk_dim = q_dim + kv_dim
        self.scale = config.attention_scale
        self.qkv_proj = nn.Linear(config.hidden_size, q_dim + 2 * kv_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=False)  # row-parallel: no bias to add once
        self.parallel = parallel
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.backend = backend

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """rope: (positions, cos_sin_cache) on CUDA or for a backend with forward_rotary, (cos, sin)
        of RotaryEmbedding otherwise."""
        T, H = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)
        # q and k are adjacent in qkv: rotate them together as H + num_kv_heads heads.
        qk = qkv[:, : self.qk_dim].view(T, -1, self.head_dim)
        if self.qk_norm:
            qk = head_rms_norm(qk, H, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        v = qkv[:, self.qk_dim:].view(T, self.num_kv_heads, self.head_dim)
        window = {}
        if self.sliding_window is not None:
            if not getattr(self.backend, "supports_sliding_window", False):
                raise NotImplementedError(f"sliding-window attention (Gemma 3, Phi-3) is not supported by "
                                          f"{type(self.backend).__name__}: it runs on the CPU backends")
            window = {"sliding_window": self.sliding_window}
        fused = getattr(self.backend, "forward_rotary", None)
        if fused is not None:  # the backend rotates q and k itself (on CUDA with the KV write)
            out = fused(qk[:, :H], qk[:, H:], v, *rope, kv_cache[0], kv_cache[1], meta, self.scale, **window)
        elif x.is_cuda:
            q, k = apply_rotary(qk[:, :H], qk[:, H:], *rope)
            out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, **window)
        else:
            qk = apply_rope(qk, *rope)
            out = self.backend.forward(qk[:, :H], qk[:, H:], v, kv_cache[0], kv_cache[1], meta, self.scale,
                                       **window)
        out = one_row_linear(self.o_proj, out.view(T, -1))
        return out if self.parallel is None else self.parallel.all_reduce(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, shard: ShardLayout, parallel: ParallelContext | None = None):
        super().__init__()
        if config.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}")
        self.act = silu_and_mul if config.hidden_act == "silu" else gelu_tanh_and_mul
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * shard.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shard.intermediate_size, config.hidden_size, bias=False)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act(self.gate_up_proj(x)))
        return out if self.parallel is None else self.parallel.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    """Llama: post_attention_layernorm is the norm before the MLP. With sandwich_norms (Gemma 3)
    it normalizes the attention output before the residual add, pre_feedforward_layernorm
    comes before the MLP and post_feedforward_layernorm after it (transformers' names)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, shard: ShardLayout,
                 parallel: ParallelContext | None = None, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend, shard, parallel, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, shard, parallel)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) -> (mlp output, residual before it); the first layer gets residual None."""
        norm = self.input_layernorm
        if residual is None:
            x, residual = rms_norm(h, norm.weight, norm.eps), h
        else:
            x, residual = fused_add_rms_norm(h, residual, norm.weight, norm.eps)
        h = self.self_attn(x, rope, kv_cache, meta)
        norm = self.post_attention_layernorm
        if self.sandwich:
            h = rms_norm(h, norm.weight, norm.eps)
            norm = self.pre_feedforward_layernorm
            x, residual = fused_add_rms_norm(h, residual, norm.weight, norm.eps)
            norm = self.post_feedforward_layernorm
            return rms_norm(self.mlp(x), norm.weight, norm.eps), residual
        x, residual = fused_add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, shard: ShardLayout,
                 parallel: ParallelContext | None = None):
        super().__init__()
        # Zeros, not nn.Embedding's random init: weights are loaded, and normal_ on the meta
        # device (LlamaForCausalLM.empty) would import torch._dynamo, which takes seconds.
        self.embed_tokens = nn.Embedding.from_pretrained(torch.zeros(shard.vocab_per_rank, config.hidden_size),
                                                         freeze=False)
        self.vocab_start, self.parallel = shard.vocab_start, parallel
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling)
        # Gemma 3's sliding layers: their own theta, no scaling.
        self.rotary_emb_local = None if config.rope_local_theta is None else RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_local_theta, None)
        # Gemma: embeddings times sqrt(hidden), rounded to float32 as transformers' buffer is.
        self.embed_scale = float(np.float32(config.hidden_size ** 0.5)) if config.scale_embeddings else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, backend, shard, parallel, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed(input_ids)
        fused = self._cpu_fused() if h.device.type == "cpu" else None
        if fused is not None:  # every layer in one call of tallow's CPU kernels
            h, residual = fused.forward(h, positions, self.rotary_emb.cos_sin_cache, kv_caches, meta)
            return fused_add_rms_norm(h, residual, self.norm.weight, self.norm.eps)[0]
        tables = [self.rotary_emb] if self.rotary_emb_local is None else [self.rotary_emb, self.rotary_emb_local]
        if h.is_cuda or hasattr(self.layers[0].self_attn.backend, "forward_rotary"):
            ropes = [(positions, t.cos_sin_cache) for t in tables]  # the kernels read the float32 table
        else:
            ropes = [t(positions, h.dtype) for t in tables]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, ropes[layer.self_attn.local_rope], kv_cache, meta)
        return fused_add_rms_norm(h, residual, self.norm.weight, self.norm.eps)[0]

    def _cpu_fused(self):
        """FusedCpuLayers for this model as it is now (its projections and attention backend),
        or None where the module path must run; rebuilt when either changes."""
        attn = self.layers[0].self_attn
        key = (attn.backend, attn.qkv_proj)  # the objects themselves (an id could be reused)
        cached = self.__dict__.get("_fused")
        if cached is None or cached[0][0] is not key[0] or cached[0][1] is not key[1]:
            from tallow.models.cpu_fused import FusedCpuLayers

            cached = (key, FusedCpuLayers(self) if FusedCpuLayers.supported(self) else None)
            self.__dict__["_fused"] = cached
        return cached[1]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self._embed(input_ids)
        return h if self.embed_scale is None else h.mul_(self.embed_scale)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel is None:
            return self.embed_tokens(input_ids)
        # Vocab-parallel: each rank looks up the ids in its rows; the sum has every row once.
        ids = input_ids - self.vocab_start
        outside = (ids < 0) | (ids >= self.embed_tokens.num_embeddings)
        h = self.embed_tokens(ids.masked_fill_(outside, 0)).masked_fill_(outside.unsqueeze(1), 0.0)
        return self.parallel.all_reduce(h)


# Checkpoint projections that live in one fused Linear here: name -> (fused name, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# A fused Linear's checkpoint parts, in order: fused name -> [part names].
_PARTS = {fused: [part for part, (f, _) in _FUSED.items() if f == fused] for fused, _ in _FUSED.values()}
# Checkpoint weights that tensor parallelism splits: module name -> (dim, ShardLayout.span kind).
_SPLIT = {
    "q_proj": (0, "q"), "k_proj": (0, "kv"), "v_proj": (0, "kv"), "o_proj": (1, "q"),
    "gate_proj": (0, "mlp"), "up_proj": (0, "mlp"), "down_proj": (1, "mlp"),
    "embed_tokens": (0, "vocab"), "lm_head": (0, "vocab"),
}
# Checkpoint tensors the model does not use: fp8 checkpoints' static activation scales (tallow
# quantizes activations per token at run time, or not at all) and a compressed-tensors
# kv_cache_scheme's k_scale / v_scale (not read yet: --kv-cache-scale sets an fp8 cache's scales).
_UNUSED_KINDS = ("input_scale", "input_scale_ub", "k_scale", "v_scale")


class LlamaForCausalLM(nn.Module):
    """The whole model, or with `parallel` the shard of its rank (weights sliced by load_weights)."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend | None = None,
                 parallel: ParallelContext | None = None):
        super().__init__()
        if attn_backend is None:
            from tallow.attention.torch_ref import TorchAttentionBackend

            attn_backend = TorchAttentionBackend()
        self.config = config
        self.parallel = parallel
        self.shard = ShardLayout.of(config) if parallel is None else ShardLayout.of(config, parallel.rank,
                                                                                    parallel.world_size)
        self.model = LlamaModel(config, attn_backend, self.shard, parallel)
        self.lm_head = nn.Linear(config.hidden_size, self.shard.vocab_per_rank, bias=False)
        self.tie_weights()

    @classmethod
    def empty(cls, config: ModelConfig, *, device: torch.device, dtype: torch.dtype,
              attn_backend: AttentionBackend | None = None,
              parallel: ParallelContext | None = None) -> "LlamaForCausalLM":
        """The model with uninitialized weights allocated directly on device in dtype (no
        initialization pass, no CPU copy): fill it with load_weights or an in-place init."""
        model = cls._skeleton(config, dtype, attn_backend, parallel)
        model.to_empty(device=device)
        model._finish(device)
        return model

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state_dict: dict[str, torch.Tensor], *,
                        attn_backend: AttentionBackend | None = None) -> "LlamaForCausalLM":
        """The model around the given tensors, without copying them (for memory-mapped weights).
        Names and shapes are this model's own, as state_dict() gives them; lm_head.weight may be
        left out when the embeddings are tied. Device and dtype are the tensors'."""
        if config.tie_word_embeddings:
            state_dict = dict(state_dict, **{"lm_head.weight": state_dict["model.embed_tokens.weight"]})
        device = state_dict["model.embed_tokens.weight"].device
        model = cls._skeleton(config, torch.get_default_dtype(), attn_backend, None)
        try:
            model.load_state_dict(state_dict, assign=True)
        except RuntimeError as e:
            raise ValueError(str(e)) from e
        model._finish(device)
        return model

    @classmethod
    def _skeleton(cls, config: ModelConfig, dtype: torch.dtype, attn_backend: AttentionBackend | None,
                  parallel: ParallelContext | None):
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device("meta"):
                return cls(config, attn_backend, parallel)
        finally:
            torch.set_default_dtype(old_dtype)

    def _finish(self, device: torch.device) -> None:
        self.tie_weights()
        self.model.rotary_emb.reset_parameters(device)
        if self.model.rotary_emb_local is not None:
            self.model.rotary_emb_local.reset_parameters(device)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of a flat batch; kv_caches holds one
        (k_cache, v_cache) pair per layer."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [N, vocab]; with tensor parallelism on rank 0 only (the others send
        their vocabulary slices to it and get None)."""
        logits = one_row_linear(self.lm_head, hidden, num_warps=8).float()
        if self.parallel is None:
            return logits
        return self.parallel.gather_columns(logits, self.config.vocab_size)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights named as in a transformers checkpoint (views, no copies): the inverse of
        load_weights, e.g. to run transformers on the same (random) weights."""
        out = {}
        for name, w in self.state_dict().items():
            if self._norm_offset(name):
                w = w - 1.0  # Gemma's checkpoints hold w of (1 + w)
            out.update(self.checkpoint_parts(name, w))
        return out

    def _norm_offset(self, name: str) -> bool:
        """Whether the checkpoint holds this norm weight minus one (Gemma's RMSNorm scales by
        1 + w; this model holds the scale itself)."""
        return self.config.architecture == "gemma3" and name.endswith("norm.weight")

    def checkpoint_parts(self, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """A tensor of this model (named as in state_dict()) under its checkpoint name: fused
        q/k/v and gate/up weights split into their parts (views)."""
        module, _, kind = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf not in self._fused_sizes():
            return {name: w}
        return {f"{parent}.{part}.{kind}": t for part, t in zip(_PARTS[leaf], w.split(self._fused_sizes()[leaf]))}

    def _fused_sizes(self, whole: bool = False) -> dict[str, list[int]]:
        """Rows of each part of the fused weights, in this rank's shard (whole: the whole model's,
        as a checkpoint holds them)."""
        sh = ShardLayout.of(self.config) if whole else self.shard
        q, kv = sh.num_heads * sh.head_dim, sh.num_kv_heads * sh.head_dim
        return {"qkv_proj": [q, kv, kv], "gate_up_proj": [sh.intermediate_size] * 2}

    def _separated(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's weights with fused projections (Phi-3's qkv_proj: q, k, v rows;
        gate_up_proj: the gate's rows, then up's) split into the separate parts the other
        architectures' checkpoints hold (q_proj, k_proj, v_proj; gate_proj, up_proj): views, or
        for a safetensors slice, only that part read."""
        sizes = self._fused_sizes(whole=True)
        for name, w in weights:
            module, _, kind = name.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            if leaf not in sizes or kind not in ("weight", "bias"):
                yield name, w
                continue
            rows_held = (w.shape if isinstance(w, torch.Tensor) else w.get_shape())[0]
            if rows_held != sum(sizes[leaf]):
                raise ValueError(f"weight {name!r} has {rows_held} rows, expected {sum(sizes[leaf])} "
                                 f"({' + '.join(map(str, sizes[leaf]))})")
            start = 0
            for part, rows in zip(_PARTS[leaf], sizes[leaf]):
                yield f"{parent}.{part}.{kind}", w[start:start + rows]
                start += rows

    def _own_slice(self, leaf: str, w) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor. w is a tensor or a safetensors slice
        (safe_open().get_slice()), which reads only the slice from the file."""
        split = _SPLIT.get(leaf) if self.parallel is not None else None
        if split is None:
            return w if isinstance(w, torch.Tensor) else w[:]
        dim, kind = split
        start, length = self.shard.span(kind)
        return w[(slice(None),) * dim + (slice(start, start + length),)]

    def _own_scales(self, leaf: str, w, rows: int) -> torch.Tensor:
        """This rank's part of an fp8 weight's weight_scale as float32 [rows]: a per-tensor scale
        ([] or [1]) repeated for every row; per-channel scales ([N] or [N, 1]) split with the
        output rows of a column-parallel layer, whole for a row-parallel one (its rows are whole)."""
        w = (w if isinstance(w, torch.Tensor) else w[...]).float().reshape(-1)  # [...]: 0-d slices too
        if w.numel() == 1:
            return w.expand(rows)
        split = _SPLIT.get(leaf) if self.parallel is not None else None
        if split is not None and split[0] == 0:
            start, length = self.shard.span(split[1])
            w = w[start:start + length]
        return w

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy weights named as in a transformers checkpoint (model.layers.0.self_attn.q_proj.weight,
        ...; Phi-3's fused qkv_proj and gate_up_proj too) into this model, fusing q/k/v and
        gate/up; a shard copies only its slice of each (the weights may be safetensors slices).
        Raises ValueError on an unknown name, a shape mismatch or a parameter left unloaded."""
        cfg = self.config
        shards = self._fused_sizes()
        params = dict(self.named_parameters())
        missing = {(name, shard) for name in params
                   for shard in range(len(shards.get(name.split(".")[-2], [None])))}
        for name, w in self._separated(weights):
            if "rotary_emb." in name or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                continue
            module, _, kind = name.rpartition(".")
            if kind in _UNUSED_KINDS:  # static activation scales of fp8 checkpoints
                continue
            parent, _, leaf = module.rpartition(".")
            target_name, shard = name, 0
            if leaf in _FUSED:
                fused, shard = _FUSED[leaf]
                target_name = f"{parent}.{fused}.{kind}"
            if target_name not in params:
                raise ValueError(f"unexpected weight {name!r}")
            target = params[target_name]
            if leaf in _FUSED:
                sizes = shards[fused]
                target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
            if kind == "weight_scale":  # an fp8 weight's scales (tallow/models/fp8.py)
                w = self._own_scales(leaf, w, target.shape[0])
            else:
                w = self._own_slice(leaf, w)
            if (w.dtype == torch.float8_e4m3fn) != (target.dtype == torch.float8_e4m3fn) and kind == "weight":
                raise ValueError(f"weight {name!r} is {w.dtype} but its layer holds {target.dtype}: "
                                 "fp8 weights load only into fp8 layers (with their scales)")
            if self._norm_offset(name):
                w = w.float() + 1.0  # (in float32, as Gemma's RMSNorm computes 1 + w)
            if leaf in ("embed_tokens", "lm_head") and w.shape[0] < target.shape[0]:  # vocabulary padding
                target[w.shape[0]:].zero_()
                target = target[: w.shape[0]]
            if target.shape != w.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(w.shape)}, expected {tuple(target.shape)}")
            target.copy_(w)
            missing.discard((target_name, shard))
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(n for n, _ in missing)[:8]}")
