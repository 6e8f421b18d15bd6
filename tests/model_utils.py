"""Test helpers: a paged KV cache and flat batches of AttentionMetadata, independent of the runner."""

from __future__ import annotations

import dataclasses
import math

import torch

from tallow.attention.metadata import AttentionMetadata
from tallow.models.config import ModelConfig


class PagedBatches:
    """KV cache tensors for every layer and a toy block allocator.

    Blocks are handed out in a shuffled order, so a sequence's blocks are not contiguous in
    the cache. step() turns (sequence key, new token ids) pairs into one flat batch.
    """

    def __init__(self, config: ModelConfig, *, num_blocks: int = 64, block_size: int = 4,
                 dtype: torch.dtype = torch.float32, seed: int = 0):
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(config.num_hidden_layers)]
        self.block_size = block_size
        g = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=g).tolist()
        self.tables: dict[object, list[int]] = {}
        self.lengths: dict[object, int] = {}

    def step(self, chunks: list[tuple[object, list[int]]], *, pad_to: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input_ids, positions and metadata for one flat batch; pad_to adds padding tokens
        (slot -1) at the end, as a CUDA graph runner would."""
        bs = self.block_size
        ids, positions, slots, qsl, seq_lens, query_lens = [], [], [], [0], [], []
        for key, new in chunks:
            table = self.tables.setdefault(key, [])
            start = self.lengths.get(key, 0)
            end = start + len(new)
            while len(table) * bs < end:
                table.append(self.free_blocks.pop())
            self.lengths[key] = end
            ids += new
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            qsl.append(qsl[-1] + len(new))
            seq_lens.append(end)
            query_lens.append(len(new))
        if pad_to is not None:
            pad = pad_to - len(ids)
            ids, positions, slots = ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad
        width = max(len(self.tables[key]) for key, _ in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.int32)
        for row, (key, _) in enumerate(chunks):
            tables[row, : len(self.tables[key])] = torch.tensor(self.tables[key], dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        return torch.tensor(ids), torch.tensor(positions), meta

    def logits(self, model, device, steps: list[list[tuple[object, list[int]]]]) -> list[torch.Tensor]:
        """The model's logits (float32, on the CPU) for every token of every step, each step's
        metadata moved to `device` (the caches are where the caller put them)."""
        out = []
        for chunks in steps:
            ids, pos, meta = self.step(chunks)
            meta = dataclasses.replace(meta, **{f: getattr(meta, f).to(device) for f in
                                                ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")})
            with torch.no_grad():
                hidden = model(ids.to(device), pos.to(device), self.kv_caches, meta)
                out.append(model.compute_logits(hidden).float().cpu())
        return out


# ---- tiny transformers models ---------------------------------------------------------------

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)


def random_hf_model(model_cls, config, seed: int = 0, std: float | None = None, norm_mean: float = 0.0,
                    norm_std: float = 0.3):
    """A transformers model of random weights (eager attention, float32, eval mode): every weight
    N(0, std) (None: the class's own initialization) and the norm weights N(norm_mean, norm_std),
    away from their neutral value so that a misplaced norm, or one applied as w instead of 1 + w,
    shows."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(norm_mean, norm_std)
            elif std is not None:
                p.normal_(0.0, std)
    return model.eval()


def tiny_hf_model(family: str, seed: int = 0, **overrides):
    """A small random transformers model (GQA, 2 layers) with weights large enough that attention
    is far from uniform, and norm weights away from 1 so a misplaced norm shows. overrides: config
    fields instead of TINY's (e.g. a vocab_size for a real tokenizer)."""
    import transformers

    torch.manual_seed(seed)
    fields = {**TINY, **overrides}
    if family == "llama":  # with llama3 rope scaling that touches low, medium and high frequencies
        config = transformers.LlamaConfig(**fields, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(config)
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**fields))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields, head_dim=32, tie_word_embeddings=True))
    elif family == "gemma3":  # a period of five sliding-window layers (window 6) and a global one
        fields = {**fields, "num_hidden_layers": 6, **overrides}
        config = transformers.Gemma3TextConfig(
            **fields, head_dim=32, sliding_window=6, query_pre_attn_scalar=24,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
        config._attn_implementation = "eager"
        model = transformers.Gemma3ForCausalLM(config)
    elif family == "phi3":  # fused qkv_proj / gate_up_proj in the checkpoint; every layer slides (window 6)
        config = transformers.Phi3Config(**{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **fields},
                                         sliding_window=6)  # (its default token ids are past a tiny vocabulary)
        model = transformers.Phi3ForCausalLM(config)
    else:
        raise ValueError(family)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return model.eval()


def llama_cpp_permute(w, n_head: int):
    """What llama.cpp's converter does to attn_q / attn_k rows (the inverse of the loader's fix)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict, head_dim: int):
    """The per-frequency divisors llama.cpp's converter stores as rope_freqs.weight."""
    import numpy as np

    factors = []
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = ((rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"])
                      / (rope["high_freq_factor"] - rope["low_freq_factor"]))
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_tensor_name(hf_name: str, names: dict[str, str]) -> str:
    """A transformers parameter name in GGUF's spelling: model.layers.3.self_attn.q_proj.weight
    -> blk.3.attn_q.weight, through `names` (HF module path -> GGUF base name)."""
    base, _, kind = hf_name.rpartition(".")
    if base.startswith("model.layers."):
        layer, part = base.removeprefix("model.layers.").split(".", 1)
        return f"blk.{layer}.{names[part]}.{kind}"
    return f"{names[base]}.{kind}"


def block_activations(x: torch.Tensor, levels: int) -> torch.Tensor:
    """x [rows, k] as tallow's CPU block kernels see it, float64: rounded per block of 32 to
    integers of scale max|x| / levels (127: linear_gguf.h's GGUF formats; 2047: the Q4 kernels';
    32767: the Q8 kernels'), the kernel's float32 operations."""
    groups = x.double().reshape(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    step = (amax.float() / levels).double()  # the kernel's float32 scale
    inv = torch.where(amax > 0, torch.full_like(amax, float(levels)).float() / amax.float(), 0.0).double()  # IEEE
    return ((groups.float() * inv.float()).round().double() * step).reshape(x.shape)


def activation_levels(gguf_type: str) -> int | None:
    """How tallow's CPU kernels round a layer's input for a GGUF weight type: 127 (int8: Q5_0,
    Q5_1 and the K-quants), 2047 (12-bit: Q4_0, Q4_1), 32767 (16-bit: Q8_0), None (float
    weights)."""
    from tallow.models import gguf_linear as gl

    if gguf_type in gl.GGUF_KERNEL_FORMATS:
        return 127
    return {"Q4_0": 2047, "Q4_1": 2047, "Q8_0": 32767}.get(gguf_type)


def round_linear_inputs(linear: torch.nn.Module, levels: int | None) -> None:
    """A reference float Linear whose input is first rounded as the kernel of levels rounds it
    (block_activations): then only float rounding separates it from the quantized layer."""
    if levels is None:
        return

    def hook(module, args):
        x = args[0]
        return (block_activations(x.reshape(-1, x.shape[-1]), levels).to(x.dtype).view(x.shape),)

    linear.register_forward_pre_hook(hook)


def run_all(core, prompts_ids, params) -> list:
    """Add a sequence per prompt (per choice) to an EngineCore and step until none has work."""
    seqs = [s for ids in prompts_ids for s in core.make_sequences(ids, params)]
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    return seqs


def write_gguf(path: str, hf_model, arch: str) -> None:
    """hf_model's weights as a float32 GGUF, the way llama.cpp's converter names and permutes them."""
    import gguf

    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(path, arch)
    add_gguf_shape(writer, c)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    writer.add_eos_token_id(2)
    if c.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(c.rope_parameters, head_dim))
    names = {v: k for k, v in _GGUF_TO_HF.items()}
    for name, w in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        gguf_name = gguf_tensor_name(name, names)
        w = w.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, c.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, c.num_key_value_heads)
        writer.add_tensor(gguf_name, w)
    close_gguf(writer)


def add_gguf_shape(writer, c) -> None:
    """A transformers config's layer shape in a GGUF writer's metadata (the keys every
    architecture's converter writes)."""
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)


def close_gguf(writer) -> None:
    """Write the file: header, metadata, tensors."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_GGUF_TO_HF = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


# ---- a byte-level tokenizer for tiny models that read text -----------------------------------

BYTE_EOS = "<|endoftext|>"


def gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (as in its encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) \
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def save_byte_tokenizer(path) -> int:
    """A byte-level BPE tokenizer without merges (token id = byte value, 256 = BYTE_EOS) written to
    path as tokenizer.json and tokenizer_config.json, readable by tallow and transformers'
    AutoTokenizer alike. Returns the vocabulary size (257)."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in gpt2_byte_alphabet().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_EOS, special=True)])
    tok.save(f"{path}/tokenizer.json")
    from tallow.chat_template import CHATML

    with open(f"{path}/tokenizer_config.json", "w") as f:  # ChatML as an instruct model's (chat tests)
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": BYTE_EOS, "bos_token": None,
                   "add_bos_token": False, "model_max_length": 256, "chat_template": CHATML}, f)
    return tok.get_vocab_size()


def tiny_text_model(path, family: str = "llama", seed: int = 0):
    """A tiny random model over save_byte_tokenizer's vocabulary (260 rows, EOS 256), saved with
    its tokenizer in path; returns the transformers model (float32)."""
    hf = tiny_hf_model(family, seed, vocab_size=260, bos_token_id=None, eos_token_id=256, pad_token_id=None)
    hf.save_pretrained(path)
    save_byte_tokenizer(path)
    return hf
