"""Structured output on CUDA: the bitmasks unpacked on the device equal the CPU path's, and the
engine's asynchronous CUDA path (graphs, async scheduling: a grammar step's forward is queued,
the step before resolved and the masks filled while it runs, then the step sampled) produces
outputs the grammar accepts, next to free rows, with forced tokens as chunks or one per step in
decode-graph replays. Marked gpu; skipped without CUDA.

Self-contained for the device machine: a byte-level tokenizer made here (256 byte tokens and an
end token) and a small random model whose vocabulary is wider than the tokenizer's (ids past it
must never be allowed)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from tallow.config import EngineConfig
from tallow.engine.core import EngineCore
from tallow.engine.grammar import GrammarSpec, apply_bitmasks, grammar_backend
from tallow.engine.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


def byte_tokenizer_dir(path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return str(path)


def test_bitmasks_unpacked_on_the_device_equal_the_cpu_path():
    rng = np.random.default_rng(0)
    words = rng.integers(-2**31, 2**31, size=(5, 40), dtype=np.int64).astype(np.int32)
    logits = torch.randn(7, 40 * 32 - 9)
    for x, rows in ((logits[:5], [0, 1, 2, 3, 4]), (logits, [1, 3, 4, 5, 6])):  # every row, some rows
        cpu = apply_bitmasks(x.clone(), rows, words, in_place=False)
        gpu = apply_bitmasks(x.cuda(), rows, words, in_place=True)
        assert torch.equal(cpu, gpu.cpu())
        assert torch.isinf(cpu).any() and torch.isfinite(cpu).any()


@pytest.mark.parametrize("chunk_max_seqs", [None, 4, 0])
def test_engine_on_cuda_follows_grammars_beside_free_rows(tmp_path, chunk_max_seqs):
    import llguidance as llg

    from tallow.models.config import ModelConfig
    from tallow.models.dummy import PRESETS, init_random_
    from tallow.models.llama import LlamaForCausalLM
    from tallow.models.loader import LoadedModel, TokenizerSource

    config = ModelConfig.from_hf_dict(dict(PRESETS["smollm2-135m"], vocab_size=320, hidden_size=64,
                                           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, eos_token_id=256, bos_token_id=None,
                                           pad_token_id=None))
    model = LlamaForCausalLM.empty(config, device=torch.device("cuda"), dtype=torch.float32)
    init_random_(model, 0)
    model = model.eval().requires_grad_(False)
    loaded = LoadedModel(config, model, TokenizerSource("hf", byte_tokenizer_dir(tmp_path)), {}, "tiny")
    cfg = dataclasses.replace(EngineConfig(model="tiny", device="cuda", dtype="float32", num_kv_blocks=256,
                                           max_num_seqs=16, jump_forward_chunk_max_seqs=chunk_max_seqs))
    core = EngineCore(cfg, loaded=loaded)
    assert core.async_scheduling and core.runner.graphs is not None
    assert core.scheduler.forced_chunk_max_seqs == chunk_max_seqs  # None: chunks at any batch
    tok = core.tokenizer
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA, separators=(",", ":")))
    prompts = [tok.encode(f"record {i}:") for i in range(6)]
    constrained = [core.make_sequences(p, SamplingParams(temperature=t, seed=i, max_tokens=120, grammar=spec))[0]
                   for i, (p, t) in enumerate(zip(prompts, [0.0, 1.0] * 3))]
    free = [core.make_sequences(p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
            for p in prompts[:3]]
    for s in free + constrained:
        core.add(s)
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        assert steps < 2000
    backend = grammar_backend(tok)
    for s in constrained:
        assert s.finish_reason == "stop", (s.finish_reason, tok.decode(s.output_ids))
        m = llg.LLMatcher(backend.ll_tokenizer, llg.LLMatcher.grammar_from_json_schema(
            spec.text, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}))
        assert m.try_consume_tokens(s.output_ids) == len(s.output_ids) and m.is_accepting()
        value = json.loads(tok.decode(s.output_ids))
        assert set(value) == {"name", "ok", "n"} and 0 <= value["n"] <= 99
        assert s.grammar.fill > 0
    assert all(s.num_output_tokens == 30 for s in free)
    # Grammar steps ran asynchronously: masks filled after the step before was resolved.
    assert core.num_overlapped_steps > 10 and core.num_masked_after_resolve > 0
    assert core.runner.graphs.num_replays > 0
