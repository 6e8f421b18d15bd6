"""Test helpers: small Llama-shaped GGUF files in any of the block formats tallow loads.

gguf's writer quantizes only Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 (gguf.quants.quantize); the K-quant
tensors (Q4_K, Q5_K, Q6_K) are written as random raw blocks with valid scales, their type set
accordingly. The reference for such a file is the float32 model of its own dequantized weights."""

from __future__ import annotations

import numpy as np
from model_utils import add_gguf_shape, close_gguf, gguf_tensor_name

# Byte offsets of each block's float16 scale fields (the rest of a block is codes and integer
# scales, any bit pattern valid).
SCALE_FIELDS = {"Q4_0": [0], "Q5_0": [0], "Q8_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2],
                "Q5_K": [0, 2], "Q6_K": [208]}
# A typical scale per format, so that weights come out about 0.02 in size.
SCALE_SIZE = {"Q4_0": 0.006, "Q5_0": 0.003, "Q8_0": 0.0005, "Q4_1": 0.006, "Q5_1": 0.003, "Q4_K": 0.0002,
              "Q5_K": 0.0001, "Q6_K": 0.0003}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row_bytes] uint8: random codes and integer scales, float16 scales of moderate size
    (Q4_1/Q5_1/K minimums negative, so weights center near zero)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    b = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for i, off in enumerate(SCALE_FIELDS[type_name]):
        v = SCALE_SIZE[type_name] * rng.uniform(0.5, 1.5, b.shape[0])
        if i == 1:  # Q4_1/Q5_1: the minimum m (w = d q + m); K: dmin (w = d sc q - dmin mn); about centered
            v = v * {"Q4_1": -7.5, "Q5_1": -15.5, "Q4_K": 7.5, "Q5_K": 15.5}[type_name]
        b[:, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


def write_llama_gguf(path: str, types: dict[str, str], *, arch: str = "llama", hidden: int = 256, inter: int = 512,
                     layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 160, tied: bool = False,
                     seed: int = 0) -> None:
    """A random Llama-shaped GGUF. types: GGUF tensor kind (attn_q, attn_k, attn_v, attn_output,
    ffn_gate, ffn_up, ffn_down, token_embd, output) -> GGML type name (F32, F16, BF16, Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K); missing kinds are F32. qwen2: q/k/v biases."""
    import gguf
    from gguf.constants import GGMLQuantizationType

    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab"] + [f"t{i}" for i in range(3, vocab)])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(2)

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        t = types.get(kind, "F32")
        if t in ("Q4_K", "Q5_K", "Q6_K"):
            raw = random_blocks(t, rows, cols, rng)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[t])
            return
        data = (rng.standard_normal((rows, cols)) * (0.5 if kind == "token_embd" else 0.05)).astype(np.float32)
        if t == "F32":
            w.add_tensor(name, data)
        elif t == "F16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            q = gguf.quants.quantize(data, GGMLQuantizationType[t])
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType[t])

    add("token_embd.weight", "token_embd", vocab, hidden)
    for i in range(layers):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", (1 + 0.2 * rng.standard_normal(hidden)).astype(np.float32))
        w.add_tensor(f"{b}.ffn_norm.weight", (1 + 0.2 * rng.standard_normal(hidden)).astype(np.float32))
        add(f"{b}.attn_q.weight", "attn_q", hidden, hidden)
        add(f"{b}.attn_k.weight", "attn_k", kv_heads * head_dim, hidden)
        add(f"{b}.attn_v.weight", "attn_v", kv_heads * head_dim, hidden)
        if arch == "qwen2":
            for part, n in (("attn_q", hidden), ("attn_k", kv_heads * head_dim), ("attn_v", kv_heads * head_dim)):
                w.add_tensor(f"{b}.{part}.bias", (0.2 * rng.standard_normal(n)).astype(np.float32))
        add(f"{b}.attn_output.weight", "attn_output", hidden, hidden)
        add(f"{b}.ffn_gate.weight", "ffn_gate", inter, hidden)
        add(f"{b}.ffn_up.weight", "ffn_up", inter, hidden)
        add(f"{b}.ffn_down.weight", "ffn_down", hidden, inter)
    w.add_tensor("output_norm.weight", (1 + 0.2 * rng.standard_normal(hidden)).astype(np.float32))
    if not tied:
        add("output.weight", "output", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add_weight(writer, gguf_name: str, data: np.ndarray, weight_type: str) -> np.ndarray:
    """data (float32) written as a tensor of weight_type (F32, F16 or a type gguf.quants
    quantizes); returns its values as the file holds them after dequantization."""
    import gguf
    from gguf.constants import GGMLQuantizationType

    if weight_type == "F32":
        writer.add_tensor(gguf_name, data)
        return data
    if weight_type == "F16":
        writer.add_tensor(gguf_name, data.astype(np.float16))
        return data.astype(np.float16).astype(np.float32)
    kind = GGMLQuantizationType[weight_type]
    q = gguf.quants.quantize(data, kind)
    writer.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=kind)
    return gguf.quants.dequantize(q, kind).reshape(data.shape)


def add_sentencepiece_stub(writer, vocab_size: int, bos: int, eos: int) -> None:
    """An F32 file's type and a SentencePiece ("llama") vocabulary of placeholder pieces t0, t1, ...
    for a model the tests feed token ids."""
    import gguf

    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(vocab_size)])
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_token_types([1] * vocab_size)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_add_space_prefix(False)


# llama.cpp's gemma3 tensor names for transformers' Gemma3ForCausalLM parameters.
GEMMA3_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def write_gemma3_gguf(path: str, hf_model, weight_type: str = "F32") -> dict[str, np.ndarray]:
    """A transformers Gemma3ForCausalLM as llama.cpp's convert_hf_to_gguf.py (+ llama-quantize)
    writes it: arch gemma3, its metadata keys (sliding_window; the period of 6 and the local
    theta left to their defaults as the converter does), every norm weight stored as 1 + w, no
    q/k row permutation (Gemma's rotary is NeoX-style), tied embeddings (no output.weight).
    weight_type: the 2-D tensors' type (F32, F16 or one gguf.quants quantizes); norms stay F32.
    Returns each HF parameter's values as the file holds them after dequantization (HF names,
    norms as w), the reference for a lossy type."""
    import gguf

    c = hf_model.config
    assert c.layer_types == ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                             for i in range(c.num_hidden_layers)], "the converter writes no pattern: period 6"
    assert c.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0, "the converter writes no local theta"
    w = gguf.GGUFWriter(path, "gemma3")
    add_gguf_shape(w, c)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    scaling = c.rope_parameters["full_attention"]
    if scaling.get("rope_type", "default") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    w.add_sliding_window(c.sliding_window)
    add_sentencepiece_stub(w, c.vocab_size, bos=2, eos=1)
    held = {}
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight":
            continue
        gguf_name = gguf_tensor_name(name, GEMMA3_NAMES)
        data = t.float().numpy()
        if name.endswith("norm.weight"):
            data = data + 1.0  # Gemma3RMSNorm scales by 1 + w: the file holds that
            w.add_tensor(gguf_name, data)
            held[name] = data - 1.0
            continue
        held[name] = add_weight(w, gguf_name, data, weight_type)
    close_gguf(w)
    return held


# llama.cpp's phi3 tensor names for transformers' Phi3ForCausalLM parameters (q/k/v and gate/up
# stay fused, as the checkpoint holds them).
PHI3_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
    "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def write_phi3_gguf(path: str, hf_model, weight_type: str = "F32", rope_factors: bool = False) -> dict[str, np.ndarray]:
    """A transformers Phi3ForCausalLM as llama.cpp's convert_hf_to_gguf.py (+ llama-quantize)
    writes a Phi-3 mini 4k: arch phi3, its metadata keys (the rotary dimension, the sliding window),
    the fused attn_qkv and ffn_up tensors, no q/k row permutation (NeoX rotary), an output tensor.
    rope_factors: also the two LongRoPE tensors of the 128k models. weight_type as
    write_gemma3_gguf's; returns the HF parameters' values as the file holds them."""
    import gguf

    c = hf_model.config
    head_dim = c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(path, "phi3")
    add_gguf_shape(w, c)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_sliding_window(c.sliding_window or 0)  # the converter's 0 for none
    add_sentencepiece_stub(w, c.vocab_size, bos=1, eos=2)
    if rope_factors:
        w.add_tensor("rope_factors_long.weight", np.ones(head_dim // 2, np.float32))
        w.add_tensor("rope_factors_short.weight", np.ones(head_dim // 2, np.float32))
    held = {}
    for name, t in hf_model.state_dict().items():
        gguf_name = gguf_tensor_name(name, PHI3_NAMES)
        data = t.float().numpy()
        held[name] = add_weight(w, gguf_name, data, "F32" if name.endswith("norm.weight") else weight_type)
    close_gguf(w)
    return held
