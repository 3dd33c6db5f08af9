"""Every tokenizer llama.cpp tests itself with, exact: each `models/ggml-vocab-*.gguf` of the
pinned llama.cpp sources with its `.inp` texts and `.out` ids (written by the model's own
Hugging Face tokenizer), read as its test-tokenizer-0 reads them: no BOS added, special
tokens' text taken as text."""

from __future__ import annotations

from functools import cache

import pytest

from tokenworks.bench.llama_cpp_sources import vocab_vectors, vocabulary
from tokenworks.models.gguf_metadata import read_metadata
from tokenworks.tokenizer.tokenizer import tokenizer_from_gguf_fields

# the vocabularies with test vectors; test_every_vocabulary_with_vectors_is_listed notices a
# new one
VOCABULARIES = (
    "bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2",
    "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
)  # fmt: skip
# WordPiece lower-cases and drops accents and control characters: its text does not come back
_NORMALISED = ("bert-bge",)


_vocabulary = cache(vocabulary)  # each file read once for the tests that share it


def test_every_vocabulary_with_vectors_is_listed(llama_cpp_sources):
    found = {p.name[len("ggml-vocab-"):-len(".gguf.inp")]
             for p in (llama_cpp_sources / "models").glob("ggml-vocab-*.gguf.inp")}  # fmt: skip
    assert found == set(VOCABULARIES)


@pytest.mark.parametrize("name", VOCABULARIES)
def test_the_vocabulary_gives_llama_cpps_ids_for_every_text(llama_cpp_sources, name):
    path = llama_cpp_sources / "models" / f"ggml-vocab-{name}.gguf"
    tok = _vocabulary(path)
    vectors = vocab_vectors(path)
    assert len(vectors) >= 40
    wrong = [
        (text, want, got)
        for text, want in vectors
        if (got := tok.encode(text, add_special_tokens=False, parse_special=False)) != want
    ]
    assert not wrong, f"{len(wrong)} of {len(vectors)} texts tokenised otherwise: {wrong[:3]}"
    if name not in _NORMALISED:
        for text, want in vectors:
            assert tok.decode(want, skip_special_tokens=False) == text, text


def test_special_tokens_are_parsed_unless_asked_not_to(llama_cpp_sources):
    """The engine's prompts (chat templates) parse a control token's text as the token;
    test-tokenizer-0 and parse_special=False read it as text."""
    tok = _vocabulary(llama_cpp_sources / "models" / "ggml-vocab-qwen2.gguf")
    im_start = tok.tk.token_to_id("<|im_start|>")
    assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == im_start
    assert im_start not in tok.encode("<|im_start|>user", parse_special=False)


def test_phi3_control_tokens_take_the_spaces_after_them(llama_cpp_sources):
    """Phi-3's tokenizer.json strips the spaces right of its control tokens (and llama.cpp
    does the same): "<|user|>\\nHi" and "<|user|> Hi" are one prompt."""
    tok = _vocabulary(llama_cpp_sources / "models" / "ggml-vocab-phi-3.gguf")
    assert tok.encode("<|user|>\nHi", add_special_tokens=False) == tok.encode(
        "<|user|>Hi", add_special_tokens=False
    )
    assert tok.encode("<s> Hi", add_special_tokens=False) != tok.encode("<s>Hi")


def test_an_unknown_pre_tokeniser_is_refused_by_name(llama_cpp_sources):
    from tokenworks.tokenizer import TokenizerError

    fields = read_metadata(llama_cpp_sources / "models" / "ggml-vocab-gpt-2.gguf")
    with pytest.raises(TokenizerError, match="'no-such-splitting' is not known"):
        tokenizer_from_gguf_fields(fields | {"tokenizer.ggml.pre": "no-such-splitting"})
    with pytest.raises(TokenizerError, match="'rwkv' is not supported"):
        tokenizer_from_gguf_fields(fields | {"tokenizer.ggml.model": "rwkv"})
