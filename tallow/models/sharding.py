"""Which slice of each sharded dimension one tensor-parallel rank holds (Megatron-style).

Attention heads, the MLP's intermediate dimension and the vocabulary are split in equal
contiguous parts. KV heads are split the same way when there are at least as many as ranks;
with fewer, each rank keeps one: rank r takes KV head r * num_kv_heads // size (the one its
query heads attend to), so KV heads are replicated across ranks. The vocabulary is padded to
a multiple of the size: the last rank's slice can end in rows that are zero.
"""

from __future__ import annotations

from dataclasses import dataclass

from tallow.errors import TallowError
from tallow.models.config import ModelConfig


def validate_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise TallowError (param tensor_parallel_size) when the model cannot be split in `size` parts."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if size < 1:
        problem = "must be at least 1"
    elif heads % size:
        problem = f"must divide the number of attention heads ({heads})"
    elif config.intermediate_size % size:
        problem = f"must divide the MLP's intermediate size ({config.intermediate_size})"
    elif kv_heads % size and size % kv_heads:
        problem = f"must divide the number of KV heads ({kv_heads}) or be a multiple of it"
    elif -(-config.vocab_size // size) * (size - 1) >= config.vocab_size:
        problem = f"leaves a rank without vocabulary ({config.vocab_size} tokens)"
    else:
        return
    raise TallowError(f"tensor_parallel_size {size} {problem}", param="tensor_parallel_size")


@dataclass(frozen=True)
class ShardLayout:
    """The sizes one rank's model has, and where its slices start in the full dimensions.
    ShardLayout.of(config) (rank 0 of 1) is the whole model."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the full vocabulary
    vocab_per_rank: int  # rows of this rank's embedding and LM head, padding included

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, size: int = 1) -> "ShardLayout":
        validate_tensor_parallel(config, size)
        kv_heads = config.num_key_value_heads
        local_kv = max(kv_heads // size, 1)
        kv_start = rank * local_kv if kv_heads >= size else rank * kv_heads // size
        return cls(rank, size, config.num_attention_heads // size, local_kv, kv_start, config.head_dim,
                   config.intermediate_size // size, config.vocab_size, -(-config.vocab_size // size))

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def span(self, kind: str) -> tuple[int, int]:
        """(start, length) of this rank's slice of a full dimension: "q" (query heads' rows),
        "kv" (KV heads' rows), "mlp" (intermediate) or "vocab" (without the padding)."""
        if kind == "q":
            return self.rank * self.num_heads * self.head_dim, self.num_heads * self.head_dim
        if kind == "kv":
            return self.kv_head_start * self.head_dim, self.num_kv_heads * self.head_dim
        if kind == "mlp":
            return self.rank * self.intermediate_size, self.intermediate_size
        if kind == "vocab":
            return self.vocab_start, min(self.vocab_per_rank, self.vocab_size - self.vocab_start)
        raise ValueError(f"unknown sharded dimension {kind!r}")
