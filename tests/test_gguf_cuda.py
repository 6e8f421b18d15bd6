"""GGUF files served with their weights in block form by tallow's Triton kernels
(tallow/models/gguf_cuda.py: TritonQuantLinear projections and LM head, a block embedding).

- triton_interp (TRITON_INTERPRET=1, on the CPU): whole small files loaded by load_blocks on the
  CPU, their logits over a prefill (the GEMM) and decode steps of one and three rows (the GEMVs)
  against the float32 model of the file's weights dequantized by gguf (the float path).
- gpu: the same files on CUDA in bf16 against the same file dequantized to bf16 (the loader's
  `gguf_blocks=False`, what `--quantization none` selects), on the Triton attention path; and
  the engine over a Q4_K_M file with CUDA graphs and asynchronous scheduling: greedy tokens do
  not depend on the batch, graph replays equal eager steps.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from gguf_files import write_llama_gguf
from model_utils import PagedBatches
from triton_test_devices import CUDA, INTERPRET, INTERPRETER

pytest.importorskip("gguf")

if INTERPRET:  # the interpreter's tl.dot on bfloat16 (test_triton_quant.py says why)
    from test_triton_quant import _dot_bfloat16_as_float32

    _dot_bfloat16_as_float32()

Q4_K_M = dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q6_K", attn_output="Q4_K", ffn_gate="Q4_K", ffn_up="Q4_K",
              ffn_down="Q6_K", token_embd="Q4_K", output="Q6_K")
Q8_0 = dict.fromkeys(["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd",
                      "output"], "Q8_0")
Q5_K_M = dict(Q4_K_M, attn_q="Q5_K", attn_k="Q5_K", attn_output="Q5_K", ffn_gate="Q5_K", ffn_up="Q5_K",
              token_embd="Q5_K")
FILES = {  # id -> (types, arch, tied)
    "Q4_K_M": (Q4_K_M, "llama", False),
    "Q8_0-tied": (Q8_0, "llama", True),
    "Q5_K_M-qwen2": (Q5_K_M, "qwen2", False),
}


def write(tmp_path, kind: str) -> str:
    types, arch, tied = FILES[kind]
    path = str(tmp_path / f"{kind}.gguf")
    write_llama_gguf(path, types, arch=arch, tied=tied)
    return path


def steps_of(prompts):
    """A prefill of all prompts, then a decode step of one row and one of three."""
    a, b, c = prompts
    return [[("a", a), ("b", b), ("c", c)], [("a", [7])], [("a", [9]), ("b", [11]), ("c", [13])]]


PROMPTS = [list(range(5, 30)), [7, 3, 99, 150, 2, 2, 41], [1, 2, 3]]


def run_steps(model, config, device, dtype, steps) -> list[torch.Tensor]:
    paged = PagedBatches(config, num_blocks=32, block_size=16, dtype=dtype)
    paged.kv_caches = [(k.to(device), v.to(device)) for k, v in paged.kv_caches]
    return paged.logits(model, device, steps)


def float_reference(path: str):
    from tallow.models import gguf
    from tallow.models.llama import LlamaForCausalLM

    config, _, weights = gguf.read_gguf(path)
    model = LlamaForCausalLM.empty(config, device=torch.device("cpu"), dtype=torch.float32)
    model.load_weights(weights)
    return config, model.eval()


def assert_block_layers(model, types, tied):
    from tallow.models.gguf_cuda import CudaQuantEmbedding
    from tallow.models.gguf_linear import ConcatLinear
    from tallow.ops.triton_quant import TritonQuantLinear

    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert isinstance(model.model.embed_tokens, CudaQuantEmbedding)
    assert model.model.embed_tokens.weight_q.fmt == types["token_embd"]
    assert isinstance(model.lm_head, TritonQuantLinear)
    assert model.lm_head.weight.fmt == types["token_embd" if tied else "output"]
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight_q
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, ConcatLinear if types["attn_q"] != types["attn_v"] else TritonQuantLinear)


@pytest.mark.parametrize("kind", list(FILES))
@pytest.mark.parametrize("where", [INTERPRETER])
def test_block_model_logits_match_dequantized_float32(kind, where, tmp_path):
    """On the CPU under Triton's interpreter: prefill (the GEMM: activations and weights rounded
    to bf16) and decode steps of one and three rows (the GEMVs, float32; K/V from the prefill)
    against gguf's dequantized float32 model: relative error of the logits below 2e-2 (about
    1.3% measured for the Q4_K_M file, whose random Q6_K weights are large; a wrong block or
    scale gives errors of order 1)."""
    from tallow.attention.torch_ref import TorchAttentionBackend
    from tallow.engine.runner import set_attention_backend
    from tallow.models import gguf
    from tallow.models.gguf_cuda import load_gguf_blocks

    path = write(tmp_path, kind)
    types, _, tied = FILES[kind]
    config, _, model = load_gguf_blocks(path, gguf.open_gguf(path), torch.device("cpu"), torch.float32)
    assert_block_layers(model, types, tied)
    ref_config, ref = float_reference(path)
    assert ref_config == config
    for m in (model, ref):
        set_attention_backend(m, TorchAttentionBackend())
    steps = steps_of(PROMPTS)
    got = run_steps(model, config, "cpu", torch.float32, steps)
    want = run_steps(ref, config, "cpu", torch.float32, steps)
    for i, (x, y) in enumerate(zip(got, want)):
        err = ((x - y).norm() / y.norm()).item()
        assert err < 2e-2, f"step {i}: relative error {err:.2e}"


# ---- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(FILES))
@pytest.mark.parametrize("where", [CUDA])
def test_cuda_block_logits_match_the_file_dequantized_to_bf16(kind, where, tmp_path):
    """The loader on CUDA keeps the blocks (no nn.Linear, the planes about the file's size) and
    its bf16 logits match the same file dequantized to bf16: relative error of the logits below
    4e-2 (the two round different things to bf16: the dense model its weights, the block model
    the GEMM's operands; the same comparison on the CPU under the interpreter measured 1-2% on
    these files, whose random weights are large; a wrong block or scale gives errors of order 1)."""
    from tallow.attention.triton_backend import TritonAttentionBackend
    from tallow.engine.runner import set_attention_backend
    from tallow.models.loader import load_model

    path = write(tmp_path, kind)
    types, _, tied = FILES[kind]
    blocks = load_model(path, dtype=torch.bfloat16, device="cuda").model
    dense = load_model(path, dtype=torch.bfloat16, device="cuda", gguf_blocks=False).model
    assert_block_layers(blocks, types, tied)
    assert any(type(m) is torch.nn.Linear for m in dense.modules())
    planes = sum(m.weight.nbytes() for m in blocks.modules()
                 if hasattr(getattr(m, "weight", None), "planes"))
    if not tied:
        planes += blocks.model.embed_tokens.weight_q.nbytes()
    assert planes <= 1.1 * os.path.getsize(path)
    config = blocks.config
    for m in (blocks, dense):
        set_attention_backend(m, TritonAttentionBackend(config.num_attention_heads, config.num_key_value_heads,
                                                        config.head_dim, max_num_seqs=8, device="cuda"))
    steps = steps_of(PROMPTS)
    got = run_steps(blocks, config, "cuda", torch.bfloat16, steps)
    want = run_steps(dense, config, "cuda", torch.bfloat16, steps)
    for i, (x, y) in enumerate(zip(got, want)):
        err = ((x - y).norm() / y.norm()).item()
        assert err < 4e-2, f"step {i}: relative error {err:.2e}"


@pytest.fixture(scope="module")
def q4_k_m_engines(tmp_path_factory):
    """Engines over one Q4_K_M file on CUDA (float32 activations): CUDA graphs + async
    scheduling (the defaults), and eager."""
    import json

    from tokenizers import Tokenizer, models

    from tallow.config import EngineConfig
    from tallow.engine.core import EngineCore
    from tallow.models.loader import TokenizerSource, load_model

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder = tmp_path_factory.mktemp("q4km")
    path = write(folder, "Q4_K_M")
    Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    # float32 activations: the kernels' sums in float32 whatever the batch (bf16 outputs could
    # round apart between the one-row and the batched GEMV and flip a near-tie)
    loaded = load_model(path, dtype=torch.float32, device="cuda")
    loaded.tokenizer_source = TokenizerSource("hf", str(folder))
    config = EngineConfig(model=path, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=16)
    graphs = EngineCore(config, loaded=loaded)
    eager = EngineCore(config, loaded=loaded)
    eager.runner.graphs = None
    return graphs, eager


def _generate(core, prompts, params):
    seqs = [core.make_sequences(p, params)[0] for p in prompts]
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    return [list(s.output_ids) for s in seqs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_q4_k_m_engine_greedy_is_batch_invariant_under_cuda_graphs(q4_k_m_engines):
    """Greedy tokens of each prompt alone equal those in a batch of six (decode batches of 1..6
    rows: the one-row GEMV, the small-M GEMV and, in prefill, the GEMM), with the decode steps
    replayed from CUDA graphs under asynchronous scheduling; and the eager engine agrees."""
    from tallow.engine.sampling import SamplingParams

    graphs, eager = q4_k_m_engines
    assert graphs.runner.graphs is not None and graphs.async_scheduling
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 160, (n,), generator=g).tolist() for n in (5, 37, 64, 90, 17, 12)]
    replays = graphs.runner.graphs.num_replays
    together = _generate(graphs, prompts, params)
    assert graphs.runner.graphs.num_replays - replays >= params.max_tokens - 1
    alone = [_generate(graphs, [p], params)[0] for p in prompts]
    assert together == alone
    assert _generate(eager, prompts, params) == together
    assert len({tuple(t) for t in together}) > 1


# ---- tensor-parallel shards (CPU, plain torch: the planes are compared, no kernel runs) ----------


@dataclasses.dataclass
class _Rank:
    """What LlamaForCausalLM reads of a ParallelContext at construction."""

    rank: int
    world_size: int


def _dense(layer) -> torch.Tensor:
    """A projection's weight [out, in] in float32 (TritonQuantLinear / ConcatLinear / Linear)."""
    from tallow.models.gguf_linear import ConcatLinear
    from tallow.ops.triton_quant_layout import dequantize

    if isinstance(layer, ConcatLinear):
        return torch.cat([_dense(p) for p in layer.parts])
    if hasattr(layer.weight, "planes"):
        return dequantize(layer.weight)
    return layer.weight.float()


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0-tied"])
def test_tensor_parallel_shards_hold_their_slices_of_the_blocks(kind, tmp_path):
    """Each rank of two holds its Megatron slices in block form: q/k/v and gate/up rows, o and
    down input columns cut on block boundaries, its vocabulary rows of the embedding and LM head
    (zero padding after the last token); together they are the whole model's weights."""
    pytest.importorskip("triton")
    from tallow.models import gguf
    from tallow.models.gguf_cuda import load_gguf_blocks
    from tallow.ops.triton_quant_layout import dequantize

    types, arch, tied = FILES[kind]
    path = str(tmp_path / "m.gguf")
    write_llama_gguf(path, types, arch=arch, tied=tied, hidden=512, inter=1024, vocab=161)
    cpu = torch.device("cpu")
    config, _, full = load_gguf_blocks(path, gguf.open_gguf(path), cpu, torch.float32)
    shards = [load_gguf_blocks(path, gguf.open_gguf(path), cpu, torch.float32, _Rank(r, 2))[2] for r in range(2)]
    q, kv, inter = config.hidden_size, config.num_key_value_heads * config.head_dim, config.intermediate_size
    for i, layer in enumerate(full.model.layers):
        qkv = _dense(layer.self_attn.qkv_proj)
        gate_up = _dense(layer.mlp.gate_up_proj)
        parts = [m.model.layers[i] for m in shards]
        got_qkv = [_dense(p.self_attn.qkv_proj) for p in parts]
        for r, g in enumerate(got_qkv):
            hq, hk = q // 2, kv // 2
            want = torch.cat([qkv[r * hq:(r + 1) * hq], qkv[q + r * hk:q + (r + 1) * hk],
                              qkv[q + kv + r * hk:q + kv + (r + 1) * hk]])
            assert torch.equal(g, want)
            half = inter // 2
            own = torch.cat([gate_up[r * half:(r + 1) * half], gate_up[inter + r * half:inter + (r + 1) * half]])
            assert torch.equal(_dense(parts[r].mlp.gate_up_proj), own)
        for get in (lambda x: x.self_attn.o_proj, lambda x: x.mlp.down_proj):
            assert torch.equal(torch.cat([_dense(get(p)) for p in parts], dim=1), _dense(get(layer)))
    heads = [_dense(m.lm_head) for m in shards]
    assert all(h.shape[0] == 81 for h in heads)
    assert torch.equal(torch.cat(heads)[:161], _dense(full.lm_head)) and not torch.cat(heads)[161:].any()
    embeds = [dequantize(m.model.embed_tokens.weight_q) for m in shards]
    assert torch.equal(torch.cat(embeds)[:161], dequantize(full.model.embed_tokens.weight_q))


def test_shards_off_block_boundaries_are_refused(tmp_path):
    """hidden 256 in two ranks: the o projection's input slice is 128 columns, half a K-quant
    super-block: load_blocks refuses (the loader then dequantizes); Q8_0's blocks of 32 fit."""
    pytest.importorskip("triton")
    from tallow.models import gguf
    from tallow.models.gguf_cuda import load_gguf_blocks

    path = write(tmp_path, "Q4_K_M")
    with pytest.raises(ValueError, match="block boundaries"):
        load_gguf_blocks(path, gguf.open_gguf(path), torch.device("cpu"), torch.float32, _Rank(0, 2))
    path = write(tmp_path, "Q8_0-tied")
    load_gguf_blocks(path, gguf.open_gguf(path), torch.device("cpu"), torch.float32, _Rank(1, 2))
