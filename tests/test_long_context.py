"""The long-context bench's parts that decide what is measured: haystacks and the context's
edge (bench/long_context.py). The measurements themselves are benchmarks, not tests."""

from __future__ import annotations

import pytest

from tokenworks.bench.long_context import NEEDLE, QUESTION, accepts, haystack
from tokenworks.models.toy import byte_tokenizer
from tokenworks.tokenizer import TokenizerWrapper

TEXT = "It was a fine day. The sea was calm. " * 8


@pytest.fixture(scope="module")
def tok():
    return TokenizerWrapper(byte_tokenizer())


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("length", [300, 1200])  # 1200: past the text, which repeats
def test_a_haystack_has_its_length_the_needle_at_its_depth_and_the_question_last(
    tok, length, depth
):
    text_ids = tok.encode(TEXT, add_special_tokens=False)
    ids = haystack(tok, text_ids, length, depth, 12345)
    assert len(ids) == length
    text = tok.decode(ids)
    needle = NEEDLE.format(number=12345)
    assert text.endswith(QUESTION) and text.count(needle) == 1
    room = length - len(needle) - len(QUESTION)  # a byte is a token here
    assert int(depth * room) - 64 <= text.index(needle) <= int(depth * room)  # at most 64 back
    if 0 < depth < 1:  # put after a full stop, not inside a sentence
        assert text[: text.index(needle)].rstrip().endswith(".")


def test_a_haystack_too_short_for_its_needle_is_refused(tok):
    with pytest.raises(ValueError, match="no room"):
        haystack(tok, tok.encode(TEXT, add_special_tokens=False), 20, 0.5, 1)


def test_the_context_edge_is_what_admission_says():
    from tokenworks.config import EngineConfig
    from tokenworks.engine.engine import LLMEngine
    from tokenworks.models.toy import load_toy

    engine = LLMEngine(EngineConfig(model="toy", warmup=False), load_toy())
    edge = accepts(engine)
    assert edge["accepts_prompt_of"] == engine.max_model_len - 1
    assert edge["refusal_at_context"]["limit"] == "context"
    assert str(engine.max_model_len) in edge["refusal_at_context"]["reason"]
