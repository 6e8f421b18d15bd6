"""dummy:<preset>: published architectures with random weights, for throughput work."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from tallow.errors import ModelLoadError
from tallow.models.config import ModelConfig

_LLAMA3 = dict(model_type="llama", vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
               bos_token_id=128000, eos_token_id=128001)
_QWEN = dict(vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
             bos_token_id=151643, eos_token_id=151645)

# The config.json numbers of the published models.
PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
    "qwen2.5-0.5b": dict(_QWEN, model_type="qwen2", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768),
    "qwen3-0.6b": dict(_QWEN, model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960),
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192),
    "llama-3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192),
    # google/gemma-3-270m: sliding window 512 on five of every six layers (sliding_window_pattern 6)
    "gemma3-270m": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=262144,
                        hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, sliding_window=512,
                        sliding_window_pattern=6, query_pre_attn_scalar=256, rope_theta=1000000.0,
                        rope_local_base_freq=10000.0, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0),
    "mistral-7b": dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5,
                       bos_token_id=1, eos_token_id=2),
}


def dummy_config(preset: str) -> ModelConfig:
    if preset not in PRESETS:
        raise ModelLoadError(f"unknown dummy preset {preset!r}; presets: {', '.join(PRESETS)}")
    return ModelConfig.from_hf_dict(PRESETS[preset])


@torch.no_grad()
def init_random_(model: nn.Module, seed: int = 0) -> None:
    """In place, on the parameters' device and dtype: matrices ~ N(0, 0.02), norm weights 1,
    biases 0. Deterministic for a seed and device."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        _init_(name, p, generator)


@torch.no_grad()
def random_checkpoint(config: ModelConfig, seed: int, device: torch.device,
                      dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights init_random_ gives the whole model, made one tensor at a time and named as
    in a checkpoint: a tensor-parallel shard loads its slices of them (load_weights), so every
    rank holds exactly its part of the model one process would make."""
    from tallow.models.llama import LlamaForCausalLM

    whole = LlamaForCausalLM.empty(config, device=torch.device("meta"), dtype=dtype)  # names and shapes only
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, p in whole.named_parameters():
        w = torch.empty(p.shape, dtype=dtype, device=device)
        _init_(name, w, generator)
        if whole._norm_offset(name):  # Gemma's checkpoints hold w of (1 + w)
            w -= 1.0
        yield from whole.checkpoint_parts(name, w).items()


def _init_(name: str, p: torch.Tensor, generator: torch.Generator) -> None:
    if p.dim() > 1:
        p.normal_(0.0, 0.02, generator=generator)
    elif name.endswith("norm.weight"):
        p.fill_(1.0)
    else:
        p.zero_()


def hf_config_dict(preset: str) -> dict:
    """The preset as transformers config kwargs: AutoConfig.for_model(**hf_config_dict(preset))."""
    if preset not in PRESETS:
        raise ModelLoadError(f"unknown dummy preset {preset!r}; presets: {', '.join(PRESETS)}")
    return dict(PRESETS[preset])
