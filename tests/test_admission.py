"""Admission (engine/admission.py): whether a request can ever be served, decided before
any work, with the reason and the limit it hits; the engine and the server ask the same
function."""

from __future__ import annotations

import pytest

from tokenworks.engine.admission import Admission, PromptTooLongError, RequestTooLargeError


def admission(**kw) -> Admission:
    base = dict(vocab_size=100, context=64, context_source="the model's", num_blocks=8,
                block_size=4)  # fmt: skip
    return Admission(**base | kw)


def test_a_request_that_fits_is_admitted():
    assert admission().check([1] * 10, max_tokens=20) is None
    assert admission().check([1] * 10) is None  # no max_tokens: the rest of the context


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "n", "limit", "field", "words"),
    [
        ([], 4, 1, "context", "prompt", "empty"),
        ([1, 100], 4, 1, "vocabulary", "prompt", "outside the vocabulary"),
        ([1] * 64, None, 1, "context", "prompt", "context holds 64 \\(the model's"),
        ([1] * 60, 10, 1, "max_tokens", "max_tokens", "at most 4 new tokens fit"),
        ([1] * 20, 20, 1, "kv_memory", "max_tokens", "needs up to 10 KV blocks"),
        ([1] * 8, 8, 3, "kv_memory", "n", "n=3"),
    ],
)
def test_each_refusal_says_what_limit_it_hits_and_what_to_change(
    prompt, max_tokens, n, limit, field, words
):
    refusal = admission().check(prompt, max_tokens, n)
    assert (refusal.limit, refusal.field) == (limit, field)
    with pytest.raises(ValueError, match=words):
        raise refusal.error()


def test_errors_keep_their_kinds():
    assert isinstance(admission().check([1] * 64).error(), PromptTooLongError)
    assert isinstance(admission().check([1] * 20, 20).error(), RequestTooLargeError)


def test_the_offline_engine_clamps_max_tokens_to_the_context_and_the_server_refuses():
    a = admission(num_blocks=100)
    assert a.check([1] * 60, 100, clamp=True) is None  # generates 4, ends with "length"
    assert a.check([1] * 60, 100).limit == "max_tokens"


def test_the_engine_names_where_its_context_comes_from(toy_llm):
    """A prompt past the context is refused before any work, saying which limit it hit."""
    from tokenworks import LLM

    engine = toy_llm.engine
    with pytest.raises(PromptTooLongError, match=f"context holds {engine.max_model_len}"):
        engine.add_request(prompt_token_ids=[5] * engine.max_model_len)
    short = LLM("toy", dtype="float32", loaded=engine.loaded, max_model_len=32, warmup=False)
    with pytest.raises(PromptTooLongError, match="max_model_len 32 set for this engine"):
        short.engine.add_request(prompt_token_ids=[5] * 40)
    assert not short.engine.has_unfinished()  # nothing was queued


def test_a_context_past_the_models_is_refused_not_cut(toy_llm):
    """Asked for more context than the model's positions reach, the engine says so and
    names the flag, rather than quietly serving less."""
    from tokenworks import LLM

    loaded = toy_llm.engine.loaded
    longest = loaded.spec.max_position
    with pytest.raises(ValueError, match=f"--max-model-len {longest + 1} is past the {longest}"):
        LLM("toy", dtype="float32", loaded=loaded, max_model_len=longest + 1, warmup=False)
    exact = LLM("toy", dtype="float32", loaded=loaded, max_model_len=longest, warmup=False)
    assert exact.engine.max_model_len == longest
