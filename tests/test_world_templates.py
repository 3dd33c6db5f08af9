"""The 70 real chat templates in llama.cpp's models/templates render as transformers renders
them (the oracle vLLM uses): a plain chat, a tool round trip and a reasoning turn, given the
same messages, tools and special tokens. Where transformers refuses a conversation (a
template that wants another shape of tools, or no system turn), ours refuses it too."""

from __future__ import annotations

import pytest

from tokenworks.bench.world import CONVERSATIONS
from tokenworks.models.gguf_metadata import read_metadata
from tokenworks.tokenizer import ChatTemplateError, TokenizerWrapper
from tokenworks.tokenizer.chat import ChatTemplate
from tokenworks.tokenizer.tokenizer import tokenizer_from_gguf_fields

# templates whose `x | map(...) | tojson` transformers refuses (its tojson is given the map
# filter's generator); llama.cpp renders the list it yields, and so does tokenworks
MAP_TO_JSON = {("llama-cpp-deepseek-r1.jinja", "tool round trip")}

transformers_chat = pytest.importorskip("transformers.utils.chat_template_utils")

@pytest.fixture(scope="module")
def templates(llama_cpp_sources):
    found = sorted((llama_cpp_sources / "models" / "templates").glob("*.jinja"))
    assert len(found) == 70
    return found


@pytest.fixture(scope="module")
def spm_tokenizer(llama_cpp_sources):
    """A real vocabulary's <s> and </s>, the bos_token and eos_token both renderers get."""
    metadata = read_metadata(llama_cpp_sources / "models" / "ggml-vocab-llama-spm.gguf")
    return TokenizerWrapper(
        tokenizer_from_gguf_fields(metadata, "llama"), bos_token_id=1, eos_token_ids=(2,)
    )


def _theirs(source: str, messages, tools, special: dict) -> str | Exception:
    try:
        rendered, _ = transformers_chat.render_jinja_template(
            [messages], tools=tools, chat_template=source, add_generation_prompt=True, **special
        )
        return rendered[0]
    except Exception as e:  # a template's own refusal, or its failure on this shape of input
        return e


def test_every_template_renders_as_transformers_does(templates, spm_tokenizer):
    rendered, refused, differ = 0, [], []
    for path in templates:
        source = path.read_text(encoding="utf-8")
        ours = ChatTemplate(source, spm_tokenizer)
        special = ours.special_tokens()
        assert special == {"bos_token": "<s>", "eos_token": "</s>"}
        for name, (messages, tools) in CONVERSATIONS.items():
            # (the variables given to both, so the time now is the same: Firefunction's)
            variables = ours.variables(tools)
            theirs = _theirs(source, messages, tools, special | variables)
            if (path.name, name) in MAP_TO_JSON:
                assert "generator" in str(theirs)
                assert '"name": "' in ours.render(messages, tools=tools, **variables)
                continue
            if isinstance(theirs, Exception):
                with pytest.raises(ChatTemplateError):
                    ours.render(messages, tools=tools, **variables)
                refused.append((path.name, name))
                continue
            if ours.render(messages, tools=tools, **variables) != theirs:
                differ.append((path.name, name))
            rendered += 1
    assert not differ
    # the conversations are ones nearly every template takes (the refusals: tools of another
    # shape, string arguments, a system turn Gemma 2 has no place for)
    assert rendered >= 195, refused  # (197 of the 210)


def test_the_generation_tag_renders_its_body(spm_tokenizer):
    """LFM2.5's and Laguna's templates mark the assistant's words for training masks."""
    source = (
        "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert ChatTemplate(source, spm_tokenizer).render(messages) == "<user>hi<assistant>yo"
