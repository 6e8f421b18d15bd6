"""The engine's model code for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2).

One forward pass runs a flat batch of T tokens from many sequences (prefill chunks and
decode tokens mixed); attention reads and writes the paged KV cache through an
AttentionBackend. Linear layers are plain nn.Linear attributes with fused q/k/v and
gate/up weights, so a quantizer can swap them after loading.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tallow.engine.attention.base import AttentionBackend
from tallow.engine.attention.metadata import AttentionMetadata
from tallow.models.config import ModelConfig
from tallow.models.layers import RMSNorm, RotaryEmbedding, apply_rope


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.qk_dim = config.q_dim + config.kv_dim
        self.scale = config.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_dim + 2 * config.kv_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_dim, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.backend = backend

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)
        # q and k are adjacent in qkv: rotate them together as H + num_kv_heads heads.
        qk = qkv[:, : self.qk_dim].view(T, -1, self.head_dim)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])), dim=1)
        qk = apply_rope(qk, cos, sin)
        v = qkv[:, self.qk_dim:].view(T, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(qk[:, :H], qk[:, H:], v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.view(T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}")
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        # Zeros, not nn.Embedding's random init: weights are loaded, and normal_ on the meta
        # device (LlamaForCausalLM.empty) would import torch._dynamo, which takes seconds.
        self.embed_tokens = nn.Embedding.from_pretrained(torch.zeros(config.vocab_size, config.hidden_size),
                                                         freeze=False)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, h.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, kv_cache, meta)
        return self.norm(h)


# Checkpoint projections that live in one fused Linear here: name -> (fused name, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend | None = None):
        super().__init__()
        if attn_backend is None:
            from tallow.engine.attention.torch_ref import TorchAttentionBackend

            attn_backend = TorchAttentionBackend()
        self.config = config
        self.model = LlamaModel(config, attn_backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    @classmethod
    def empty(cls, config: ModelConfig, *, device: torch.device, dtype: torch.dtype,
              attn_backend: AttentionBackend | None = None) -> "LlamaForCausalLM":
        """The model with uninitialized weights allocated directly on device in dtype (no
        initialization pass, no CPU copy): fill it with load_weights or an in-place init."""
        model = cls._skeleton(config, dtype, attn_backend)
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
        model = cls._skeleton(config, torch.get_default_dtype(), attn_backend)
        try:
            model.load_state_dict(state_dict, assign=True)
        except RuntimeError as e:
            raise ValueError(str(e)) from e
        model._finish(device)
        return model

    @classmethod
    def _skeleton(cls, config: ModelConfig, dtype: torch.dtype, attn_backend: AttentionBackend | None):
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device("meta"):
                return cls(config, attn_backend)
        finally:
            torch.set_default_dtype(old_dtype)

    def _finish(self, device: torch.device) -> None:
        self.tie_weights()
        self.model.rotary_emb.reset_parameters(device)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of a flat batch; kv_caches holds one
        (k_cache, v_cache) pair per layer."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy weights named as in a transformers checkpoint (model.layers.0.self_attn.q_proj.weight,
        ...) into this model, fusing q/k/v and gate/up. Raises ValueError on an unknown name, a
        shape mismatch or a parameter left unloaded."""
        cfg = self.config
        shards = {"qkv_proj": [cfg.q_dim, cfg.kv_dim, cfg.kv_dim],
                  "gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size]}
        params = dict(self.named_parameters())
        missing = {(name, shard) for name in params
                   for shard in range(len(shards.get(name.split(".")[-2], [None])))}
        for name, w in weights:
            if "rotary_emb." in name or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                continue
            module, _, kind = name.rpartition(".")
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
            if target.shape != w.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(w.shape)}, expected {tuple(target.shape)}")
            target.copy_(w)
            missing.discard((target_name, shard))
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(n for n, _ in missing)[:8]}")
