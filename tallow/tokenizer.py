"""Tokenizer: text <-> ids, and the exact bytes each token adds to the text.

Built on the `tokenizers` library, either from a GGUF file's metadata (vocabulary, merges and token
types stored under llama.cpp's key names) or from a Hugging Face folder (tokenizer.json and friends).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import mmap
import os
import struct
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from tallow.errors import ModelLoadError

logger = logging.getLogger(__name__)

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Split patterns for byte-level BPE, by `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp applies
# them: each pattern splits the pieces the previous one left.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's TEKKEN pattern (Mistral Nemo): its rewrite of tokenizer.json's case-split letter runs
# (\p{Lu}... classes), where a letter outside ASCII counts as both upper and lower case.
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
           r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
# DeepSeek LLM / Coder (llama.cpp's DEEPSEEK_LLM and DEEPSEEK_CODER): newlines alone, then letter
# runs (DEEPSEEK_LLM: Latin, Greek, Cyrillic and other cased scripts only), punctuation runs, CJK runs
# and digits, each taking one whitespace character in front.
_DEEPSEEK_LLM = [r"[\r\n]",
                 r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
                 r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}+"]
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"]
# BLOOM, Poro and GPT-3 Finnish: runs of anything but whitespace and a few punctuation marks
# (the parentheses and "|" in the class are literal characters, as in llama.cpp); viking then
# splits digits apart.
_BLOOM = [r" ?[^(\s|.,!?…。，、।۔،)]+"]
_VIKING = [*_BLOOM, r"\p{N}"]
# Seed-Coder: qwen2-like single digits, but punctuation runs never take the newlines after them.
_SEED_CODER = [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"]
# Kimi K2 as llama.cpp splits it (its hand-written unicode_regex_split_custom_kimi_k2): Han runs apart
# from other letters, which run whatever their case (tokenization_kimi.py's pattern would split
# " iPhone" at the case change; llama.cpp does not), then up to 3 digits.
_KIMI_K2 = [r"\p{Han}+|[^\r\n\p{L}\p{N}]?[\p{L}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
_FALCON = [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]
# What llama.cpp splits with for pre = "default", or no pre at all (not GPT-2's: "don't" -> "don", "'", "t").
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]
_CHAMELEON = [r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
              r"[\p{P}!-/:-@\[-`{-~]", _GPT2]
# Names llama.cpp reads as its LLAMA3 pre-tokenizer (which also ignores merges and adds BOS).
_LLAMA3_NAMES = ["llama3", "llama-bpe", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                 "jina-v5-nano"]
_PRE_SPLITS: dict[str, list[str]] = {
    "default": _DEFAULT,
    **dict.fromkeys(["gpt2", "gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "exaone4", "mpt", "olmo", "jais",
                     "trillion", "granite-docling"], [_GPT2]),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
                    [r"\p{N}", _GPT2]),
    **dict.fromkeys([*_LLAMA3_NAMES, "smaug-bpe", "dbrx"], [_LLAMA3]),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                     "solar-open"], [_QWEN2]),
    "qwen35": [_QWEN35],
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], [_GPT4O]),
    "tekken": [_TEKKEN],
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], _DEEPSEEK3),
    "falcon": _FALCON,
    "chameleon": _CHAMELEON,
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
    **dict.fromkeys(["chatglm-bpe", "glm4", "glm5"], [_LLAMA3]),  # CHATGLM4: llama3's pattern
    "viking": _VIKING,
    **dict.fromkeys(["bloom", "poro-chat", "gpt3-finnish"], _BLOOM),
    "seed-coder": _SEED_CODER,
    "kimi-k2": _KIMI_K2,
    "grok-2": [_QWEN2],
}
# llama.cpp's BPE ignores the merges for a word that is a whole vocabulary entry, for these.
_IGNORE_MERGES = {*_LLAMA3_NAMES, "tekken", "glm4", "glm5"}
# Byte-level vocabularies llama.cpp puts BOS in front of unless the file's add_bos_token says otherwise
# (a SentencePiece vocabulary always).
_ADD_BOS = {*_LLAMA3_NAMES, "tekken", "chameleon"}
# Tokens that end a turn, though the file names another eos (llama.cpp's end-of-generation list):
# whatever their type, and they are special (llama.cpp makes them CONTROL).
_END_OF_TURN = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                "<EOT>", "_<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>"}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table for byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


class Tokenizer:
    """Encode/decode plus the special ids and the chat template a model ships with.

    `token_bytes(id)` is the raw contribution of one token to the decoded text, so a detokenizer can
    join tokens byte-exactly and emit text only at UTF-8 boundaries. For SentencePiece vocabularies the
    decoder also drops the space a leading "▁" stands for at the very start of a text; token_bytes
    keeps it.
    """

    def __init__(self, backend: Backend, *, byte_level: bool, bos_token_id: int | None,
                 eos_token_id: int | None, pad_token_id: int | None, extra_eos_ids: Iterable[int] = (),
                 add_bos: bool = False, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None):
        self.backend = backend
        self.byte_level = byte_level
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.eos_token_ids = frozenset(i for i in (eos_token_id, *extra_eos_ids) if i is not None)
        added = backend.get_added_tokens_decoder()
        self._added_text = {i: t.content for i, t in added.items()}
        self.special_token_ids = frozenset(i for i, t in added.items() if t.special)
        # The text of each special token ("<|im_start|>", ...): what a chat template may write and
        # what a client's message text may not turn into (ChatTemplate's literal spans).
        self.special_tokens = tuple(added[i].content for i in sorted(self.special_token_ids))
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        # The text a chat template writes for them ({{ bos_token }}): the vocabulary entry unless the
        # caller knows better (a GGUF's plain-text token, where the entry may be re-spelled).
        if bos_token is None and bos_token_id is not None:
            bos_token = self.id_to_token(bos_token_id)
        if eos_token is None and eos_token_id is not None:
            eos_token = self.id_to_token(eos_token_id)
        self.bos_token, self.eos_token = bos_token, eos_token

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], cache_path: str | None = None) -> "Tokenizer":
        """From GGUF metadata as `read_gguf_tokenizer_metadata` returns it (keys `tokenizer.*`).

        cache_path: where a SentencePiece vocabulary's merges are kept (.npy of token id pairs,
        read back when it exists, written after they are derived): deriving them from the
        vocabulary takes seconds for a large one (Gemma 3's 262,144 tokens: ~5 s here), reading
        them back a fraction of that. The caller names the file by the GGUF's identity and this
        module's source (loader.tokenizer_cache_path)."""
        kind = meta.get("tokenizer.ggml.model")
        if "tokenizer.ggml.tokens" not in meta:
            raise ModelLoadError("the GGUF file holds no tokenizer (no tokenizer.ggml.tokens)")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        if kind not in ("gpt2", "llama"):
            raise ModelLoadError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
        # llama.cpp makes the end-of-turn tokens CONTROL whatever the file says (llama-vocab.cpp).
        special_types = [CONTROL if t in _END_OF_TURN else ty for t, ty in zip(tokens, types)]
        pre = meta.get("tokenizer.ggml.pre")
        if kind == "gpt2":
            if pre is None:
                logger.warning("the GGUF file names no pre-tokenizer (tokenizer.ggml.pre): splitting as llama.cpp's "
                               "'default', which may not be how the model was trained (llama.cpp warns the same)")
            backend = _byte_level_bpe(tokens, special_types, meta["tokenizer.ggml.merges"], pre or "default")
        else:
            backend = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.scores"), types,
                                         meta.get("tokenizer.ggml.add_space_prefix", True), cache_path)
        _add_special_tokens(backend, tokens, special_types, rstrip=_phi3_rstrip(meta, tokens, special_types))

        eos = meta.get("tokenizer.ggml.eos_token_id")
        extra_eos = [meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id")]
        end_of_turn = {t: i for i, t in enumerate(tokens) if t in _END_OF_TURN}
        if {"<|return|>", "<|call|>", "<|end|>"} <= end_of_turn.keys():
            # gpt-oss (harmony): <|end|> closes a message, not the turn; llama.cpp does not stop on it.
            del end_of_turn["<|end|>"]
        extra_eos += end_of_turn.values()
        bos = meta.get("tokenizer.ggml.bos_token_id")

        def text(i: int | None) -> str | None:  # the token as the file writes it, not re-spelled
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        return cls(
            backend,
            byte_level=kind == "gpt2",
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            extra_eos_ids=extra_eos,
            # llama.cpp adds BOS to a SentencePiece vocabulary, and to a byte-level one of some
            # pre-tokenizers (llama3, tekken, ...), unless the file says otherwise.
            add_bos=meta.get("tokenizer.ggml.add_bos_token", kind == "llama" or pre in _ADD_BOS),
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token=text(bos),
            eos_token=text(eos),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """From tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json and
        config.json (the last three optional)."""
        path = Path(path)
        try:
            backend = Backend.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # missing file, or a format this tokenizers version cannot read
            raise ModelLoadError(f"cannot load {path / 'tokenizer.json'}: {e}") from e
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")

        def token_id(name: str) -> int | None:
            token = config.get(name)
            if isinstance(token, dict):
                token = token.get("content")
            return backend.token_to_id(token) if isinstance(token, str) else None

        bos = token_id("bos_token")
        if bos is None:
            bos = generation.get("bos_token_id", model_config.get("bos_token_id"))
        eos_ids = [i for c in (generation, model_config) for i in _as_list(c.get("eos_token_id"))]
        eos = token_id("eos_token")
        if eos is None and eos_ids:
            eos = eos_ids[0]
        pad = token_id("pad_token")
        if pad is None:
            pad = generation.get("pad_token_id", model_config.get("pad_token_id"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # the post-processor decides: does it put BOS in front of an empty text?
            add_bos = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos]
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.exists() else _named_template(config.get("chat_template"))
        return cls(backend, byte_level=_is_byte_level(backend), bos_token_id=bos, eos_token_id=eos,
                   pad_token_id=pad, extra_eos_ids=eos_ids, add_bos=bool(add_bos), chat_template=template)

    # ---- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False, *,
               literal_spans: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids of `text`. Special-token strings in it (like "<|im_start|>") become their ids;
        add_special_tokens puts BOS in front when the model wants one.

        literal_spans: sorted, disjoint character spans [start, end) of `text` (a chat prompt's client
        text, ChatTemplate.render_prompt) where a special token's string is plain text: a special
        token that overlaps one is not matched, and the text between the special tokens that are
        matched is tokenized whole with special tokens read as characters ("<|im_end|>" -> "<", "|",
        "im", ...). Without spans, or where they hold no special-token string, the ids are exactly
        those of the plain encode.
        """
        encoding = _encode(self.backend, text)
        ids = encoding.ids if not literal_spans else self._encode_around(text, encoding, literal_spans)
        if add_special_tokens and self.add_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def _encode_around(self, text: str, encoding, literal_spans: Sequence[tuple[int, int]]) -> list[int]:
        """The special tokens the plain encode matched outside the spans (their offsets include any
        whitespace an lstrip/rstrip token takes), and the text between them encoded literally: the
        same pieces the plain encode splits at, less the ones inside client text."""
        starts = [s for s, _ in literal_spans]
        pieces: list[str | int] = []  # text to encode literally, and special token ids, in order
        done = 0
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
            if token_id not in self.special_token_ids or _overlaps(literal_spans, starts, start, end):
                continue
            if start > done:
                pieces.append(text[done:start])
            pieces.append(token_id)
            done = end
        if done < len(text):
            pieces.append(text[done:])
        texts = [p for p in pieces if isinstance(p, str)]
        encoded = iter(_encode_all(self._literal_backend, texts))
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, str):
                ids += next(encoded).ids
            else:
                ids.append(piece)
        return ids

    @cached_property
    def _literal_backend(self) -> Backend:
        """A copy of the backend that reads special-token strings as text (`encode_special_tokens`;
        added tokens that are not special still match). A copy, so the flag never changes under a
        concurrent encode of the shared backend."""
        backend = Backend.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def count(self, text: str) -> int:
        return len(_encode(self.backend, text).ids)

    def id_to_token(self, id: int) -> str:
        """The vocabulary entry as stored, e.g. "Ġhello" or "▁hello"."""
        token = self.backend.id_to_token(id)
        if token is None:
            raise IndexError(f"token id {id} is outside the vocabulary ({self.vocab_size})")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, id: int) -> bytes:
        """The exact bytes this token adds to decoded text (a fragment of UTF-8 for byte tokens).
        Ids past the vocabulary have no text: a model's embedding table is often padded past its
        tokenizer (Qwen's 151,936 rows), and such an id can still be sampled."""
        table = self._bytes_table
        return table[id] if id < len(table) else b""

    def token_bytes_table(self) -> list[bytes]:
        """`token_bytes` for every id, computed once."""
        return self._bytes_table

    @cached_property
    def _bytes_table(self) -> list[bytes]:
        return [self._compute_token_bytes(i) for i in range(self.vocab_size)]

    def _compute_token_bytes(self, id: int) -> bytes:
        if id in self._added_text:
            return self._added_text[id].encode("utf-8")
        token = self.backend.id_to_token(id)
        if token is None:  # a hole in the vocabulary
            return b""
        if self.byte_level:
            if all(c in _CHAR_TO_BYTE for c in token):
                return bytes(_CHAR_TO_BYTE[c] for c in token)
            return token.encode("utf-8")
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return token.replace("\u2581", " ").encode("utf-8")


# Texts at least this long are encoded with encode_batch, which releases the GIL while the Rust
# side works (encode holds it: a few MB of text held every other thread, the event loop's
# included, for seconds); shorter ones with encode, which costs less per call.
_RELEASE_GIL_CHARS = 16384


def _encode(backend: Backend, text: str):
    """backend.encode(text) without special tokens added; the GIL released for a long text."""
    if len(text) < _RELEASE_GIL_CHARS:
        return backend.encode(text, add_special_tokens=False)
    return backend.encode_batch([text], add_special_tokens=False)[0]


def _encode_all(backend: Backend, texts: list[str]) -> list:
    """_encode of each text (one encode_batch call for those that are long together)."""
    if sum(len(t) for t in texts) < _RELEASE_GIL_CHARS:
        return [backend.encode(t, add_special_tokens=False) for t in texts]
    return backend.encode_batch(texts, add_special_tokens=False)


def _overlaps(spans: Sequence[tuple[int, int]], starts: list[int], start: int, end: int) -> bool:
    """Whether [start, end) overlaps one of the sorted, disjoint spans (starts: their starts)."""
    k = bisect.bisect_left(starts, end) - 1  # the last span starting before `end`
    return k >= 0 and spans[k][1] > start


# ---- GGUF -------------------------------------------------------------------------------------


def _read_merges(path: str | None, vocab_size: int) -> np.ndarray | None:
    """Cached merges ([n, 2] token ids, in merge order), or None (none, or unreadable)."""
    if not path or not os.path.exists(path):
        return None
    try:
        pairs = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        pairs = None
    if pairs is None or pairs.ndim != 2 or pairs.shape[1] != 2 or (pairs.size and pairs.max() >= vocab_size):
        logger.warning("ignoring an unreadable cached merges file %s", path)
        return None
    return pairs


def _write_merges(path: str | None, pairs: np.ndarray) -> None:
    """Keep derived merges for _read_merges; failing to write costs only the next start."""
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp.npy"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.save(tmp, pairs, allow_pickle=False)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)


def builder_digest() -> str:
    """A digest of this module's source: merges derived by other code are never read."""
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def read_gguf_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    """The `tokenizer.*` keys, `general.architecture` and `general.name` of a GGUF file, as plain
    Python values.

    Reads only the metadata section, with struct on a memory map: ~0.1 s for SmolLM2, where
    gguf.GGUFReader takes ~3 s building a numpy view for every string of the vocabulary.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file")
        version, _, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ModelLoadError(f"{path}: GGUF v{version} is not supported")
        meta, pos = {}, 24
        for _ in range(kv_count):
            key, pos = _gguf_string(buf, pos)
            (value_type,) = struct.unpack_from("<I", buf, pos)
            wanted = key.startswith("tokenizer.") or key in ("general.architecture", "general.name")
            value, pos = _gguf_value(buf, pos + 4, value_type, keep=wanted)
            if wanted:
                meta[key] = value
        return meta


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_string(buf, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"), pos + 8 + n


def _gguf_value(buf, pos: int, value_type: int, keep: bool) -> tuple[Any, int]:
    if value_type in _GGUF_SCALARS:
        fmt = "<" + _GGUF_SCALARS[value_type]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _GGUF_STRING:
        return _gguf_string(buf, pos)
    if value_type != _GGUF_ARRAY:
        raise ModelLoadError(f"unknown GGUF metadata type {value_type}")
    item_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item_type in _GGUF_SCALARS:
        dtype = np.dtype("<" + _GGUF_SCALARS[item_type])
        end = pos + count * dtype.itemsize
        return (np.frombuffer(buf[pos:end], dtype).tolist() if keep else None), end
    items = []
    for _ in range(count):
        item, pos = _gguf_value(buf, pos, item_type, keep)
        if keep:
            items.append(item)
    return (items if keep else None), pos


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str) -> Backend:
    """GPT-2-style byte-level BPE, split the way llama.cpp splits for this `tokenizer.ggml.pre`.

    A CONTROL or USER_DEFINED token keeps its text as written, which llama.cpp matches in the raw
    text: converters write added tokens as plain text ("<｜User｜>", MPT's "  "), and the added token
    _add_special_tokens makes of it resolves to this entry. A NORMAL token not spelled in the byte
    alphabet (plain text from a few converters) is re-spelled in it, so merges can reach it, unless
    another entry already has that spelling (Command-R's "\u200d" and "âĢį": llama.cpp finds the
    latter); between entries of the same text the last wins, as in llama.cpp."""
    vocab: dict[str, int] = {}
    respelled: list[tuple[str, int]] = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (CONTROL, USER_DEFINED) or all(c in _CHAR_TO_BYTE for c in t):
            vocab[t] = i
        else:
            respelled.append(("".join(_BYTE_TO_CHAR[b] for b in t.encode()), i))
    for t, i in respelled:
        vocab.setdefault(t, i)
    backend = Backend(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                 ignore_merges=pre in _IGNORE_MERGES))
    splits = _PRE_SPLITS.get(pre)
    if splits is None:
        logger.warning("unknown GGUF pre-tokenizer %r: splitting like GPT-2", pre)
        splits = [_GPT2]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], scores: list[float] | None, types: list[int],
                       add_space_prefix: bool, cache_path: str | None = None) -> Backend:
    """llama.cpp's SentencePiece tokenizer as a BPE: repeatedly join the adjacent pair whose join is
    the best-scoring vocabulary entry, then spell unknown characters as <0xXX> byte tokens.
    cache_path: the merges kept as token id pairs (from_gguf_metadata)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = _read_merges(cache_path, len(tokens))
    if pairs is None:
        if scores is None:  # no scores: earlier entries win, as in files whose scores follow their order
            scores = [-float(i) for i in range(len(tokens))]
        candidates = []
        for t, ty, score in zip(tokens, types, scores):
            if ty not in (NORMAL, USER_DEFINED) or len(t) < 2:
                continue
            for k in range(1, len(t)):
                left, right = t[:k], t[k:]
                if left in vocab and right in vocab:
                    candidates.append((-score, vocab[t], left, right))
        candidates.sort()
        pairs = np.array([(vocab[a], vocab[b]) for *_, a, b in candidates], dtype=np.int32).reshape(-1, 2)
        _write_merges(cache_path, pairs)
    unk = next((t for t, ty in zip(tokens, types) if ty == UNKNOWN), None)
    backend = Backend(models.BPE(vocab=vocab, merges=[(tokens[a], tokens[b]) for a, b in pairs.tolist()],
                                 unk_token=unk, byte_fallback=True, fuse_unk=True))
    replace = normalizers.Replace(" ", "\u2581")
    # Per piece of text between added tokens, as llama.cpp (and Llama's original tokenizer.json) do:
    # "a<tok>b" gets a space in front of both "a" and "b" (sentencepiece itself only before "a").
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if add_space_prefix else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_special_tokens(backend: Backend, tokens: list[str], types: list[int], rstrip: frozenset[str] = frozenset()
                        ) -> None:
    """CONTROL tokens become special added tokens and USER_DEFINED ones plain added tokens, so the text
    "<|im_start|>" (or "<｜User｜>") encodes to its one id, as llama.cpp matches them in the raw text.
    Their text is their vocabulary key in both kinds of vocabulary (_byte_level_bpe), so each resolves
    to its own id. rstrip: tokens that swallow the whitespace after them (_phi3_rstrip)."""
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=t in rstrip)
                                for t, ty in zip(tokens, types) if ty == CONTROL and t])
    backend.add_tokens([AddedToken(t, special=False, normalized=False, rstrip=t in rstrip)
                        for t, ty in zip(tokens, types) if ty == USER_DEFINED and t])


def _phi3_rstrip(meta: dict[str, Any], tokens: list[str], types: list[int]) -> frozenset[str]:
    """Phi-3's added tokens whose tokenizer.json says rstrip: every special token ("<|user|>",
    "<|end|>", "<|assistant|>", ...) and "</s>", but not "<unk>", "<s>" or "<|endoftext|>", so the
    newline its chat template writes after "<|user|>" or "<|end|>" is swallowed. llama.cpp sets the
    same, for a file whose general.name says phi3 or phi-3; here also for any Phi-3-architecture file
    with Phi-3's SentencePiece vocabulary (Phi-3, Phi-3.5), whatever its name: tokenizer.json has
    rstrip on them regardless, and a fine-tune is often named otherwise. (Phi-4-mini, also "phi3" but
    with a byte-level vocabulary, is left to the name rule, as in llama.cpp.)"""
    name = str(meta.get("general.name") or "").lower()
    phi3_vocab = (meta.get("general.architecture") == "phi3" and meta.get("tokenizer.ggml.model") == "llama"
                  and "<|end|>" in tokens)
    if not (phi3_vocab or "phi3" in name or "phi-3" in name):
        return frozenset()
    special = {t for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED, UNKNOWN)}
    return frozenset((special | ({"</s>"} & set(tokens))) - {"<unk>", "<s>", "<|endoftext|>"})


# ---- HF folder --------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _named_template(value) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template} (take "default")."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value}
        return named.get("default") or next(iter(named.values()), None)
    return value


def _is_byte_level(backend: Backend) -> bool:
    """Whether the vocabulary is spelled in GPT-2's byte alphabet (its decoder maps it back)."""
    return backend.decoder is not None and b'"ByteLevel"' in backend.decoder.__getstate__()
