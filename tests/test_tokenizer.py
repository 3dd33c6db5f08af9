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
