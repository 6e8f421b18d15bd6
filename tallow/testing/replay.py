"""replay:<file.json>: a TEST FIXTURE model that replays scripted replies.

Registered as a model source by importing tallow.testing (register_replay_source); the
shipped loader does not know it.

Not a language model. It lets end-to-end tests drive the real tokenizer, scheduler, KV cache,
sampler and completion sink with a reply chosen in advance (tool-call markup, reasoning
blocks, multi-byte text), so streams have real token boundaries and exact expected results.

The file holds the replies, optionally with a chat template that replaces the default one
(for testing what a template selects, such as the tool-call or reasoning parser):

    {"chat_template": "...",                                  (optional)
     "step_delay_s": 0.01,     (optional: each forward sleeps this long, to pace a stream)
     "replies": [{"match": "weather", "reply": "<tool_call>...</tool_call>"},
                 {"reply": "I can only talk about the weather."}]}

or just the list of replies. The tokenizer is the default model's (SmolLM2). For each
sequence the model reads its whole context back from the KV slots, splits it into a prompt
and the part of a reply generated so far, and forces the reply's next token (then eos) with
a one-hot row of logits, so any sampling settings give the scripted text. The context is kept
in the KV cache itself (each slot holds its token id), so it is the engine's block tables,
prefix cache and preemption that the replay depends on.

Which reply: the one already under way (the longest reply prefix that ends the context);
before that, the one whose "match" occurs latest in the prompt (in a conversation, the newest
message decides); then the earlier entry; entries without "match" are fallbacks. A prompt
that nothing matches fails the step (the engine reports finish_reason "error"). A prompt that
ends with the beginning of its own reply is ambiguous: that beginning counts as generated.
The forward pass runs Python per sequence: run it eagerly (no CUDA graph capture).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from tallow.attention.metadata import AttentionMetadata
from tallow.errors import ModelLoadError
from tallow.models.config import ModelConfig
from tallow.models.loader import LoadedModel, TokenizerSource, default_model_path, register_model_source
from tallow.tokenizer import Tokenizer, read_gguf_tokenizer_metadata

_MAX_POSITIONS = 8192  # the default model's context
_DIGITS = 3  # a KV slot holds its token id as base-256 digits: exact in any float dtype
_OTHER_LOGIT = -1e4  # finite, so logprobs stay valid JSON


@dataclass(frozen=True)
class ScriptedReply:
    match: str | None  # None: a fallback
    token_ids: tuple[int, ...]


class ReplayModel(nn.Module):
    """Same interface as LlamaForCausalLM: forward() -> one "hidden" row per token (here the
    row's index in the step: the contexts stay with the model), compute_logits() -> for each
    row it is given, a one-hot row of the token that follows that row's context (so every row
    of a query can be sampled, as speculative decoding's drafted rows are)."""

    def __init__(self, config: ModelConfig, tokenizer: Tokenizer, replies: list[ScriptedReply],
                 step_delay_s: float = 0.0):
        super().__init__()
        self.step_delay_s = step_delay_s
        self.config = config
        self.tokenizer = tokenizer
        self.replies = replies
        self.eos_token_id = tokenizer.eos_token_id

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        cache = kv_caches[0][0]  # [num_blocks, block_size, 1, _DIGITS]
        block_size = cache.shape[1]
        cache = cache.view(-1, _DIGITS)
        written = meta.slot_mapping >= 0
        shifts = torch.arange(_DIGITS, device=input_ids.device) * 8
        digits = (input_ids[written, None] >> shifts) & 255
        cache[meta.slot_mapping[written]] = digits.to(cache.dtype)

        offsets = torch.arange(block_size, device=input_ids.device)
        starts = meta.query_start_loc.tolist()
        # Flat row -> (its sequence's context, the context's length up to and with that row).
        self._rows = rows = []
        for b, seq_len in enumerate(meta.seq_lens_cpu):
            blocks = meta.block_tables[b, : (seq_len + block_size - 1) // block_size].long()
            slots = (blocks[:, None] * block_size + offsets).flatten()[:seq_len]
            context = (cache[slots].long() << shifts).sum(dim=1).tolist()
            q = starts[b + 1] - starts[b]
            rows += [(context, seq_len - q + 1 + r) for r in range(q)]
        return torch.arange(input_ids.shape[0], device=input_ids.device).unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        next_ids = [self._next_token(context[:length]) for context, length in
                    (self._rows[r] for r in hidden[:, 0].tolist())]
        logits = torch.full((hidden.shape[0], self.config.vocab_size), _OTHER_LOGIT,
                            dtype=torch.float32, device=hidden.device)
        index = torch.tensor(next_ids, dtype=torch.long, device=hidden.device).unsqueeze(1)
        return logits.scatter_(1, index, 0.0)

    def _next_token(self, context: list[int]) -> int:
        """The token after context: the next one of the reply that the prompt selects."""
        best_key, best_next = None, None
        for order, reply in enumerate(self.replies):
            found = self._progress(context, reply)
            if found is None:
                continue
            at, done = found
            key = (done, at, -order)
            if best_key is None or key > best_key:
                ids = reply.token_ids
                best_key, best_next = key, ids[done] if done < len(ids) else self.eos_token_id
        if best_next is None:
            prompt = self.tokenizer.decode(context, skip_special_tokens=False)
            raise ValueError(f"replay: no scripted reply matches the prompt ending {prompt[-200:]!r}")
        return best_next

    def _progress(self, context: list[int], reply: ScriptedReply) -> tuple[int, int] | None:
        """(where the match is in the prompt, -1 for a fallback; reply tokens already in the
        context) for the longest reply prefix that ends the context after a matching prompt."""
        ids = reply.token_ids
        for done in range(min(len(ids), len(context)), -1, -1):
            if context[len(context) - done:] != list(ids[:done]):
                continue
            if reply.match is None:
                return -1, done
            prompt = self.tokenizer.decode(context[:len(context) - done], skip_special_tokens=False)
            at = prompt.rfind(reply.match)
            if at != -1:
                return at, done
        return None


def load_replay(path: str, *, dtype: torch.dtype, device: torch.device | str) -> LoadedModel:
    """The replay model for a script file (see the module docstring), with the default model's
    tokenizer. dtype is unused: the model has no weights."""
    try:
        with open(path, encoding="utf-8") as f:
            script = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the replay script {path}: {e}") from e
    entries = script.get("replies") if isinstance(script, dict) else script
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("reply"), str)
                                                for e in entries):
        raise ModelLoadError(f"{path}: expected a list of {{\"match\": ..., \"reply\": ...}} entries")

    gguf_path = default_model_path()
    metadata = read_gguf_tokenizer_metadata(gguf_path)
    if isinstance(script, dict) and script.get("chat_template") is not None:
        metadata["tokenizer.chat_template"] = script["chat_template"]
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    assert tokenizer.vocab_size <= 256 ** _DIGITS
    delay = script.get("step_delay_s", 0.0) if isinstance(script, dict) else 0.0
    if not isinstance(delay, (int, float)) or isinstance(delay, bool) or not 0 <= delay <= 10:
        raise ModelLoadError(f"{path}: step_delay_s must be a number of seconds between 0 and 10")
    replies = [ScriptedReply(e.get("match") or None, tuple(tokenizer.encode(e["reply"]))) for e in entries]
    config = ModelConfig(architecture="llama", vocab_size=tokenizer.vocab_size, hidden_size=1,
                         intermediate_size=1, num_hidden_layers=1, num_attention_heads=1,
                         num_key_value_heads=1, head_dim=_DIGITS, max_position_embeddings=_MAX_POSITIONS,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=[tokenizer.eos_token_id])
    model = ReplayModel(config, tokenizer, replies, float(delay)).to(device).eval().requires_grad_(False)
    name = f"replay:{os.path.basename(path)}"
    return LoadedModel(config, model, TokenizerSource("gguf", gguf_path, metadata), {}, name)


def register_replay_source() -> None:
    """`replay:<file.json>` loads the replay model from now on (in this process)."""
    register_model_source("replay", load_replay, "the replay: test fixture")
