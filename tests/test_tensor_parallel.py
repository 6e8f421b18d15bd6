"""Tensor parallelism on the CPU (gloo): TP=2 gives TP=1's greedy tokens and logits through
prefill, chunked prefill, decode and the prefix cache; each rank loads exactly its slice of the
weights; workers stop with the engine, also when its process dies; bad sizes are refused."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from model_utils import TINY, tiny_hf_model, write_gguf
from tallow.config import EngineConfig
from tallow.distributed.group import ParallelContext
from tallow.engine.async_engine import AsyncEngine
from tallow.engine.core import EngineCore
from tallow.engine.sampling import SamplingParams
from tallow.errors import TallowError
from tallow.models.config import ModelConfig
from tallow.models.dummy import init_random_, random_checkpoint
from tallow.models.llama import LlamaForCausalLM
from tallow.models.loader import load_model
from tallow.models.sharding import ShardLayout
import tallow.testing  # noqa: F401  (registers the replay: model source)
from deadlines import wait_until
# Prompts of 3, 9 and 22 tokens: blocks of 4 tokens, so prefill and 24 decode steps cross block
# boundaries; a token budget of 16 chunks the long prefill and mixes it with decode tokens.
PROMPTS = [[5, 6, 7], [11, 3, 8, 40, 2, 9, 71, 30, 12], list(range(40, 62))]
NEW_TOKENS = 24


def tiny_qwen3_mqa():
    """Qwen3 (q/k norm, tied embeddings) with one KV head, replicated on every rank at TP=2, and a
    vocabulary of 97 tokens, which the vocab-parallel embedding and LM head pad to 2 x 49."""
    import transformers

    torch.manual_seed(1)
    config = transformers.Qwen3Config(**dict(TINY, num_key_value_heads=1, vocab_size=97), head_dim=32,
                                      tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def save_with_tokenizer(hf, path) -> str:
    """save_pretrained plus a stand-in tokenizer (the engine reads one; the tests feed token ids)."""
    from tokenizers import Tokenizer, models

    hf.save_pretrained(path)
    Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>")).save(f"{path}/tokenizer.json")
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<eos>"}, f)
    return str(path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    """Llama with GQA (4 query heads, 2 KV heads: one per rank at TP=2) and untied embeddings."""
    return save_with_tokenizer(tiny_hf_model("llama"), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    return save_with_tokenizer(tiny_qwen3_mqa(), tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(params=["llama", pytest.param("qwen3", marks=pytest.mark.slow)])  # qwen3: the slow tier (fast-tier budget)
def model_dir(request) -> str:
    return request.getfixturevalue(f"{request.param}_dir")


def engine_config(model: str, **overrides) -> EngineConfig:
    return dataclasses.replace(EngineConfig(model=model, device="cpu", quantization="none", block_size=4,
                                            num_kv_blocks=96, max_num_batched_tokens=16), **overrides)


def record_logits(core: EngineCore) -> list[torch.Tensor]:
    """Every step's logits (rank 0's full vocabulary), as the runner hands them to the sampler."""
    steps = []
    logits_of = core.runner.logits

    def spy(out, prev_ids=None):
        logits = logits_of(out, prev_ids)
        steps.append(logits.clone())
        return logits

    core.runner.logits = spy
    return steps


def generate(core: EngineCore, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    seqs = [core.make_sequences(p, params)[0] for p in prompts]
    for s in seqs:
        core.add(s)
    while core.has_work():
        core.step()
    return seqs


@contextlib.contextmanager
def tp2_engine(model_dir: str, **overrides):
    """An engine with one worker; a process holds one tensor-parallel group at a time."""
    core = EngineCore(engine_config(model_dir, tensor_parallel_size=2, **overrides))
    try:
        yield core
    finally:
        core.shutdown()


def test_tp2_matches_tp1_tokens_and_logits(model_dir):
    tp1 = EngineCore(engine_config(model_dir))
    ref_logits = record_logits(tp1)
    ref = [s.output_ids for s in generate(tp1, PROMPTS)]
    with tp2_engine(model_dir) as tp2:
        logits = record_logits(tp2)
        got = [s.output_ids for s in generate(tp2, PROMPTS)]
    assert got == ref
    assert len(logits) == len(ref_logits) >= NEW_TOKENS
    for step, (a, b) in enumerate(zip(logits, ref_logits)):
        assert a.shape == b.shape == (b.shape[0], tp1.model_config.vocab_size)
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5, msg=lambda m: f"step {step}: {m}")


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_tp2_prompt_logprobs_match_tp1(llama_dir):
    """Prompt-logprob rows travel with the logits indices: the workers gather the same LM-head
    slices, so TP=2 scores a chunked prompt as TP=1 does, next to a request that does not ask."""
    def scored(core):
        params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
        seqs = [core.make_sequences(PROMPTS[2], params)[0],
                core.make_sequences(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=4))[0]]
        for s in seqs:
            core.add(s)
        firsts = {}
        while core.has_work():
            for seq, out in core.step():
                firsts.setdefault(seq.seq_id, out)
        return [firsts[s.seq_id] for s in seqs], [s.output_ids for s in seqs]

    (ref, _), ref_ids = scored(EngineCore(engine_config(llama_dir)))
    with tp2_engine(llama_dir) as tp2:
        (got, other), got_ids = scored(tp2)
    assert got_ids == ref_ids and other.prompt_logprobs is None
    assert len(got.prompt_logprobs) == len(PROMPTS[2]) - 1
    for a, b in zip(got.prompt_logprobs, ref.prompt_logprobs):
        assert a.token_id == b.token_id and a.rank == b.rank
        assert a.logprob == pytest.approx(b.logprob, abs=2e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_tp2_prefix_cache_hit_gives_the_same_output(model_dir):
    prefix = [(7 * i + 3) % 90 + 2 for i in range(41)]  # 10 full blocks and one token
    first, second = prefix + [17, 4], prefix + [25, 60, 9]
    with tp2_engine(model_dir) as tp2:
        generate(tp2, [first])
        (seq,) = generate(tp2, [second])
    assert seq.num_cached_tokens == 40
    (ref,) = generate(EngineCore(engine_config(model_dir, enable_prefix_caching=False)), [second])
    assert ref.num_cached_tokens == 0
    assert seq.output_ids == ref.output_ids


# ---- weights by shard ----------------------------------------------------------------------------


def shard_context(rank: int, size: int) -> ParallelContext:
    """A rank's place without a process group: enough to build and load a shard (not to run it)."""
    return ParallelContext(rank, size, torch.device("cpu"), group=None, control_group=None)


def expected_shard(whole: LlamaForCausalLM, rank: int, size: int) -> dict[str, torch.Tensor]:
    """The rank's slices of the whole model's tensors, fused as the shard fuses them."""
    layout = ShardLayout.of(whole.config, rank, size)
    out = {}
    for name, w in whole.state_dict().items():
        leaf = name.split(".")[-2]
        if leaf == "qkv_proj":
            q, k, v = whole.checkpoint_parts(name, w).values()
            out[name] = torch.cat([t.narrow(0, *layout.span(kind)) for t, kind in ((q, "q"), (k, "kv"), (v, "kv"))])
        elif leaf == "gate_up_proj":
            out[name] = torch.cat([t.narrow(0, *layout.span("mlp")) for t in whole.checkpoint_parts(name, w).values()])
        elif leaf in ("o_proj", "down_proj"):
            out[name] = w.narrow(1, *layout.span("q" if leaf == "o_proj" else "mlp"))
        elif leaf in ("embed_tokens", "lm_head"):
            rows = w.narrow(0, *layout.span("vocab"))
            out[name] = torch.cat([rows, rows.new_zeros(layout.vocab_per_rank - rows.shape[0], rows.shape[1])])
        else:
            out[name] = w
    return out


def assert_is_shard_of(shard: LlamaForCausalLM, whole: LlamaForCausalLM, rank: int, size: int) -> None:
    expected = expected_shard(whole, rank, size)
    got = shard.state_dict()
    assert got.keys() == expected.keys()
    for name, w in got.items():
        assert torch.equal(w, expected[name]), name


@pytest.mark.parametrize("rank", [0, 1])
def test_hf_and_gguf_shards_are_slices_of_the_whole_model(model_dir, rank, tmp_path):
    whole = load_model(model_dir, dtype=torch.float32, device="cpu").model
    shard = load_model(model_dir, dtype=torch.float32, device="cpu", parallel=shard_context(rank, 2)).model
    assert_is_shard_of(shard, whole, rank, 2)
    if whole.config.architecture == "llama":
        write_gguf(str(tmp_path / "tiny.gguf"), tiny_hf_model("llama"), "llama")
        whole = load_model(str(tmp_path / "tiny.gguf"), dtype=torch.float32, device="cpu").model
        shard = load_model(str(tmp_path / "tiny.gguf"), dtype=torch.float32, device="cpu",
                           parallel=shard_context(rank, 2)).model
        assert_is_shard_of(shard, whole, rank, 2)


@pytest.mark.parametrize("rank", [0, 3])
def test_dummy_shards_are_slices_of_the_same_random_model(rank):
    config = ModelConfig("qwen3", vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         qk_norm=True)
    whole = LlamaForCausalLM.empty(config, device=torch.device("cpu"), dtype=torch.float32)
    init_random_(whole, seed=5)
    shard = LlamaForCausalLM.empty(config, device=torch.device("cpu"), dtype=torch.float32,
                                   parallel=shard_context(rank, 4))
    shard.load_weights(random_checkpoint(config, 5, torch.device("cpu"), torch.float32))
    assert_is_shard_of(shard, whole, rank, 4)


def test_kv_heads_are_split_or_replicated():
    def kv_heads(kv: int, size: int) -> list[tuple[int, int]]:
        config = ModelConfig("llama", 96, 64, 96, 1, num_attention_heads=8, num_key_value_heads=kv, head_dim=8)
        return [(s.kv_head_start, s.num_kv_heads) for s in (ShardLayout.of(config, r, size) for r in range(size))]

    assert kv_heads(4, 2) == [(0, 2), (2, 2)]
    assert kv_heads(2, 4) == [(0, 1), (0, 1), (1, 1), (1, 1)]  # each rank's query heads attend to its copy
    assert kv_heads(1, 8) == [(0, 1)] * 8


# ---- sizes, lifetime ---------------------------------------------------------------------------


@pytest.mark.parametrize("size, words", [(3, "attention heads (4)"), (0, "at least 1")])
def test_bad_size_is_refused_before_any_worker_starts(llama_dir, size, words):
    with pytest.raises(TallowError) as e:
        EngineCore(engine_config(llama_dir, tensor_parallel_size=size))
    assert e.value.param == "tensor_parallel_size"
    assert f"tensor_parallel_size {size}" in e.value.message and words in e.value.message


def test_intermediate_and_kv_heads_must_split():
    from tallow.models.sharding import validate_tensor_parallel

    config = ModelConfig("llama", 96, 64, 100, 1, num_attention_heads=8, num_key_value_heads=8, head_dim=8)
    with pytest.raises(TallowError, match="intermediate size"):
        validate_tensor_parallel(config, 8)
    with pytest.raises(TallowError, match="KV heads"):
        validate_tensor_parallel(dataclasses.replace(config, intermediate_size=96, num_key_value_heads=6), 4)


def test_preloaded_model_and_replay_fixture_are_refused(llama_dir, tmp_path):
    loaded = load_model(llama_dir, dtype=torch.float32, device="cpu")
    with pytest.raises(TallowError, match="preloaded model cannot be sharded"):
        EngineCore(engine_config(llama_dir, tensor_parallel_size=2), loaded=loaded)
    with pytest.raises(TallowError, match="replay: test fixture cannot be sharded"):
        EngineCore(engine_config(f"replay:{tmp_path}/replies.json", tensor_parallel_size=2))


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_async_engine_shutdown_stops_the_workers(llama_dir):
    engine = AsyncEngine(EngineCore(engine_config(llama_dir, tensor_parallel_size=2)))
    workers = engine.core.workers.processes

    async def one_request():
        stream = engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        return [t async for out in stream for t in out.token_ids]

    import asyncio

    async def main():
        tokens = await one_request()
        await engine.shutdown()
        return tokens

    assert len(asyncio.run(main())) == 4
    assert [p.exitcode for p in workers] == [0]  # stopped by the shutdown header, not killed
    assert not torch.distributed.is_initialized()


@pytest.mark.slow  # fast-tier budget: CI runs it in the slow tier
def test_workers_exit_when_the_engine_process_dies(llama_dir):
    """The engine process is killed (no shutdown): its worker must not outlive it."""
    script = textwrap.dedent(f"""
        import os, signal
        from tallow.config import EngineConfig
        from tallow.engine.core import EngineCore
        core = EngineCore(EngineConfig(model={llama_dir!r}, device="cpu", quantization="none",
                                       num_kv_blocks=16, tensor_parallel_size=2))
        print(core.workers.processes[0].pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == -9, proc.stderr
    worker = int(proc.stdout.split()[0])
    wait_until(lambda: not _alive(worker), timeout=15, interval=0.1)  # else the worker outlived the engine


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
