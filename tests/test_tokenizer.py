"""Tokenizer from GGUF metadata, incremental detokenisation, sandboxed chat templates."""

from __future__ import annotations

import random

import pytest

from tokenworks.tokenizer import ChatTemplateError, DecodeStream, TokenizerWrapper

TEXTS = [
    "Hello world! 12345 abc",
    "  leading spaces\n\nnewlines\ttabs",
    "héllo wörld 日本語 😀 emoji",
    "def f(x):\n    return x**2  # 3.14159",
    "<|im_start|>user\nhi<|im_end|>",
    "I'm you'll they've 1,000,000",
]


@pytest.fixture(scope="module")
def hf_tokenizer(smol_loaded):
    from pathlib import Path

    from transformers import AutoTokenizer

    p = Path(smol_loaded.file_path)
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers_and_round_trips(smol_llm, hf_tokenizer, text):
    ours = smol_llm.tokenizer.encode(text)
    assert ours == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert smol_llm.tokenizer.decode(ours, skip_special_tokens=False) == text


def stream_pieces(tok, ids):
    ds = DecodeStream(tok, skip_special_tokens=False)
    pieces = [ds.step(i) for i in ids]
    return pieces + [ds.flush()]


@pytest.mark.parametrize("seed", range(5))
def test_stream_pieces_concatenate_to_the_full_decode(smol_llm, seed):
    tok = smol_llm.tokenizer
    rng = random.Random(seed)
    ids = [rng.randrange(tok.vocab_size) for _ in range(200)]
    assert "".join(stream_pieces(tok, ids)) == tok.decode(ids, skip_special_tokens=False)


def test_stream_never_emits_a_broken_character(toy_llm):
    tok = toy_llm.tokenizer  # byte-level: every multi-byte character spans several tokens
    text = "naïve 日本語 😀 done"
    ids = tok.encode(text)
    pieces = stream_pieces(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert len([p for p in pieces if p]) == len(text)


def test_chat_template_runs_in_a_sandbox(toy_llm):
    from jinja2.exceptions import SecurityError

    from tokenworks.tokenizer.chat import ChatTemplate

    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", toy_llm.tokenizer)
    with pytest.raises((SecurityError, ChatTemplateError)):
        evil.render([{"role": "user", "content": "x"}])


def test_chat_template_rejects_bad_messages(toy_llm):
    with pytest.raises(ChatTemplateError, match="role"):
        toy_llm.tokenizer.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="non-empty"):
        toy_llm.tokenizer.apply_chat_template([])


def test_template_exceptions_become_clear_errors(toy_llm):
    from tokenworks.tokenizer.chat import ChatTemplate

    t = ChatTemplate("{{ raise_exception('only user turns') }}", toy_llm.tokenizer)
    with pytest.raises(ChatTemplateError, match="only user turns"):
        t.render([{"role": "user", "content": "x"}])


def test_a_model_without_tokenizer_says_so():
    from tokenworks.models.toy import load_toy
    from tokenworks.tokenizer import TokenizerError

    loaded = load_toy()
    loaded.tokenizer_source = {}
    with pytest.raises(TokenizerError, match="no tokenizer"):
        TokenizerWrapper.from_loaded(loaded)


def _sentencepiece_gguf(path) -> None:
    """A Llama GGUF whose vocabulary is a small SentencePiece one: specials, the 256 byte
    pieces, then pieces ranked by score (no merges, as llama.cpp writes them)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(4)
    toks, scores, types = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [2, 3, 3]
    toks += [f"<0x{b:02X}>" for b in range(256)]
    scores += [0.0] * 256
    types += [6] * 256
    pieces = (
        "▁ e t a o n h l r s d w i g ö ß 1 2 3 ▁t he ▁the ll llo ▁he ▁hello ▁w or orl ▁world "
        "in ing ▁s ▁sing 12 123 ▁▁ ▁a an and ▁and er re ▁re ed ▁red"
    ).split(" ")
    toks += pieces
    scores += [-float(i) for i in range(len(pieces))]
    types += [1] * len(pieces)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(toks), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_llama_sentencepiece_gguf_tokenises_as_transformers_reads_it(tmp_path):
    """Llama 2 / Mistral style: merges from scores, a "▁" in front, byte fallback for
    characters no piece covers. transformers' reader leaves the "▁" out before text that
    starts with a space (its Metaspace's prepend_scheme "first"); SentencePiece and llama.cpp
    put it there too (" x" is "▁▁x": tests/test_vocab_vectors.py holds it to llama.cpp's
    vectors), so such a text is compared with transformers' reading of one more space."""
    import gguf

    transformers = pytest.importorskip("transformers")
    from tokenworks.tokenizer.sentencepiece import sentencepiece_from_gguf

    _sentencepiece_gguf(tmp_path / "tiny.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    reader = gguf.GGUFReader(tmp_path / "tiny.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.")}
    ours = sentencepiece_from_gguf(fields, "llama")
    for text in ["hello world", " the red and hello", "singing in the  rain 123 ößx",
                 "Hello\tworld\n", "  leading", "x", "日本 €"]:  # fmt: skip
        ids = ours.encode(text, add_special_tokens=False).ids
        spelled = f" {text}" if text.startswith(" ") else text
        assert ids == theirs(spelled, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids), text


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        # o200k (gpt-oss): a word keeps its contraction and its case runs split
        ("gpt-4o", ["Hello", " world's", " ", "123", "45", " Camel", "Case"]),
        # cl100k (OLMo 2's dbrx, SmolLM3's smaug-bpe): Llama 3's splitting
        ("dbrx", ["Hello", " world", "'s", " ", "123", "45", " CamelCase"]),
        ("smaug-bpe", ["Hello", " world", "'s", " ", "123", "45", " CamelCase"]),
    ],
)
def test_the_newer_families_pre_tokenisers_split_as_their_models_do(pre, pieces):
    from tokenworks.tokenizer.splitting import SPLITTINGS

    split = SPLITTINGS[pre].pre_tokenizer().pre_tokenize_str("Hello world's 12345 CamelCase")
    assert [s.replace("\u0120", " ") for s, _ in split] == pieces
