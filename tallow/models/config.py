"""ModelConfig: the architecture facts the engine needs, from config.json, GGUF metadata or a preset."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class MissingConfigKey(ValueError):
    """config.json lacks a key the architecture needs (named in the message, which the HF loader
    prefixes with the file's path)."""

    def __init__(self, key: str):
        super().__init__(f"lacks {key!r}, a required key")
        self.key = key


# The transformers checkpoints tallow runs: model_type -> its causal-LM class.
_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
# Phi-3's rope types of the 128k-context models (transformers reads su and yarn as longrope).
_LONGROPE = ("longrope", "su", "yarn")


@dataclass
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma3" | "phi3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF-style rope scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...} or None.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qkv bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    hidden_act: str = "silu"
    sliding_window: int | None = None
    # Per layer "sliding_attention" | "full_attention" (Gemma 3; Phi-3's HF folders: every layer
    # slides): a sliding layer attends to the last sliding_window positions (itself included).
    # None: every layer attends to everything.
    layer_types: list[str] | None = None
    # Gemma 3: the sliding layers' rotary theta (no scaling there); rope_theta/rope_scaling are
    # the full-attention layers'.
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (default head_dim)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    # Norms after attention and after the MLP as well as before each (Gemma 2/3's four per layer).
    sandwich_norms: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    torch_dtype: str | None = None  # dtype of the stored weights, informational

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer, or None where it attends to its whole context."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def num_params(self) -> int:
        h, i, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        mlp = 3 * h * i
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return L * (attn + mlp + 2 * h) + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.kv_dim * dtype_bytes

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """A config.json's dict; a required key it lacks raises MissingConfigKey (a ValueError)."""
        try:
            return cls._from_hf_dict(d)
        except KeyError as e:
            raise MissingConfigKey(e.args[0]) from None

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        mt = (d.get("model_type") or "").lower()
        if mt == "gemma3" or (not mt and "Gemma3ForConditionalGeneration" in archs):
            raise ValueError("Gemma 3 multimodal checkpoints (model_type gemma3) are not supported: use the "
                             "text model (Gemma3ForCausalLM, model_type gemma3_text)")
        # the model_type decides; a config without one, its architectures (exact class names:
        # Qwen2MoeForCausalLM or Qwen2VLForConditionalGeneration is no qwen2)
        arch = mt or next((a for a, cls_name in _HF_CLASSES.items() if cls_name in archs), "")
        if arch not in _HF_CLASSES:
            raise ValueError(f"unsupported model_type {mt!r} (architectures {archs}); tallow runs model_type "
                             + ", ".join(f"{t} ({c})" for t, c in _HF_CLASSES.items()))
        if arch == "gemma3_text":
            return cls._gemma3_from_hf_dict(d)
        n_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
        eos = d.get("eos_token_id")
        eos_list = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        rp = d.get("rope_parameters")  # transformers >= 5 style
        if isinstance(rp, dict):
            rope_theta = rope_theta or rp.get("rope_theta")
            if rp.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or rp
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
        layer_types = None
        if arch == "phi3":
            _check_phi3(d, rope_scaling)
            # transformers' Phi3Model masks every layer to its window whenever sliding_window is set
            window = d.get("sliding_window")
            layer_types = None if window is None else ["sliding_attention"] * d["num_hidden_layers"]
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            hidden_act=d.get("hidden_act", "silu"),
            sliding_window=window,
            layer_types=layer_types,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_list,
            pad_token_id=d.get("pad_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        )

    @classmethod
    def _gemma3_from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Gemma3ForCausalLM's config.json (transformers 4.5x: rope_theta, rope_local_base_freq,
        rope_scaling, sliding_window_pattern; 5.x: rope_parameters per layer type, layer_types)."""
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if d.get(key) is not None:
                raise ValueError(f"{key} {d[key]} is not supported (Gemma 3 has none)")
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is not supported")
        n_layers = d["num_hidden_layers"]
        layer_types = d.get("layer_types")
        if layer_types is None:
            pattern = d.get("sliding_window_pattern", 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        rp = d.get("rope_parameters") or {}
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        rope_theta = full.get("rope_theta", d.get("rope_theta", 1_000_000.0))
        local_theta = local.get("rope_theta", d.get("rope_local_base_freq", 10_000.0))
        rope_scaling = d.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope scaling on the sliding layers ({local['rope_type']}) is not supported")
        eos = d.get("eos_token_id", 1)
        act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        return cls(
            architecture="gemma3",
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or 256,
            max_position_embeddings=d.get("max_position_embeddings", 131072),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            attention_bias=bool(d.get("attention_bias", False)),
            qk_norm=True,
            hidden_act="gelu_pytorch_tanh" if act in ("gelu_pytorch_tanh", "gelu_tanh") else act,
            sliding_window=d.get("sliding_window"),
            layer_types=list(layer_types),
            rope_local_theta=float(local_theta),
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
            scale_embeddings=True,
            sandwich_norms=True,
            bos_token_id=d.get("bos_token_id", 2),
            eos_token_id=list(eos) if isinstance(eos, (list, tuple)) else [eos],
            pad_token_id=d.get("pad_token_id", 0),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        )


def _check_phi3(d: dict[str, Any], rope_scaling: dict[str, Any] | None) -> None:
    """Refuse what Phi3ForCausalLM can hold and tallow does not run: the 128k-context models'
    LongRoPE and a partial rotary dimension (Phi-4-mini), each by its config.json field."""
    kind = rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind in _LONGROPE:
        field_name = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
        raise ValueError(f"phi3 with {field_name} of type {kind!r} (LongRoPE: the 128k-context Phi-3 models) is "
                         "not supported; the 4k-context models load")
    rp = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    factor = d.get("partial_rotary_factor", rp.get("partial_rotary_factor", 1.0))
    if factor is not None and factor < 1:
        raise ValueError(f"phi3 with partial_rotary_factor {factor} (a partial rotary dimension) is not supported")
