"""tallow's phi3 GGUF loader against files written by llama.cpp's own converter.

tests/test_phi3_gguf.py writes its phi3 files with gguf's writer, laid out as llama.cpp's
convert_hf_to_gguf.py lays them out. This check closes the loop with the converter itself, which
CI does not have (it comes with the llama-cpp-python sdist: see vs_llamacpp.py). It does this:
1. builds a random Phi3ForCausalLM of Phi-3 mini's proportions (head dim 96, untied LM head,
   sliding_window 2047), with a SentencePiece tokenizer trained on the spot;
2. saves it with transformers;
3. converts it with convert_hf_to_gguf.py to each --outtype;
4. loads each file in tallow (the CPU kernels) and compares every token's logits with
   transformers' on the weights the file holds: chunked prefill, then decode.

The bounds are the Gemma 3 GGUF tests': 1e-3 for f32, 2e-3 of the largest logit for q8_0.

    python benchmarks/phi3_converter_check.py \\
        --converter /tmp/llamacpp/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--converter", required=True, help="llama.cpp's convert_hf_to_gguf.py (a glob is expanded)")
    ap.add_argument("--types", nargs="+", default=["f32", "q8_0"], help="the converter's --outtype values")
    args = ap.parse_args()
    import sentencepiece as spm
    import torch
    import transformers

    from test_gemma3 import ATOL, check_chunks_then_decode, hf_logits, random_ids, use_backend
    from tallow.models.gguf import read_gguf
    from tallow.models.loader import load_model

    converter = glob.glob(args.converter)[0]
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(converter), "gguf-py"))
    with tempfile.TemporaryDirectory() as out:
        with open(f"{out}/corpus.txt", "w") as f:
            for i in range(2000):
                f.write(f"the quick brown fox {i} jumps over the lazy dog number {i * 7} and sings\n")
        spm.SentencePieceTrainer.train(input=f"{out}/corpus.txt", model_prefix=f"{out}/tokenizer", vocab_size=300,
                                       model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
                                       byte_fallback=True, minloglevel=2)
        torch.manual_seed(0)
        cfg = transformers.Phi3Config(vocab_size=320, hidden_size=192, intermediate_size=384, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                                      original_max_position_embeddings=4096, rms_norm_eps=1e-5,
                                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      sliding_window=2047)
        hf = transformers.Phi3ForCausalLM(cfg)
        with torch.no_grad():
            for n, p in hf.named_parameters():
                norm = n.endswith("norm.weight")
                p.normal_(1.0 if norm else 0.0, 0.3 if norm else 0.05)
        hf.eval().save_pretrained(f"{out}/hf", safe_serialization=True)
        os.replace(f"{out}/tokenizer.model", f"{out}/hf/tokenizer.model")
        with open(f"{out}/hf/tokenizer_config.json", "w") as f:
            json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "bos_token": "<s>",
                       "eos_token": "</s>", "unk_token": "<unk>"}, f)
        for t in args.types:
            path = f"{out}/phi3-{t}.gguf"
            r = subprocess.run([sys.executable, converter, f"{out}/hf", "--outtype", t, "--outfile", path],
                               env=env, capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"{t}: the converter failed:\n{r.stderr[-2000:]}")
            model = use_backend(load_model(path, dtype=torch.float32, device="cpu").model, "cpu")
            held = dict(read_gguf(path)[2])  # the weights the file holds, fused ones split
            ref_model = transformers.Phi3ForCausalLM(cfg).eval()
            with torch.no_grad():
                for n, p in ref_model.named_parameters():
                    layer = n.split(".")[2] if n.startswith("model.layers.") else None
                    if n.endswith("qkv_proj.weight"):
                        p.copy_(torch.cat([held[f"model.layers.{layer}.self_attn.{x}_proj.weight"] for x in "qkv"]))
                    elif n.endswith("gate_up_proj.weight"):
                        p.copy_(torch.cat([held[f"model.layers.{layer}.mlp.{x}_proj.weight"] for x in ("gate", "up")]))
                    else:
                        p.copy_(held[n])
            ids = random_ids(40, 300, seed=4)
            ref = hf_logits(ref_model, ids)
            atol = ATOL if t in ("f32", "f16") else 2e-3 * ref.abs().max().item()
            check_chunks_then_decode(model, ref, ids, chunk_lens=(13, 15), block_size=4, atol=atol)
            print(f"{t}: {os.path.getsize(path)} bytes, arch {model.config.architecture}: every token's logits "
                  f"within {atol:.2e} of transformers'")


if __name__ == "__main__":
    main()
