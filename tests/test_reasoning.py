"""Reasoning (serve/reasoning.py, engine/thinking.py): the text between a model's think
markers comes back apart from its answer, streamed equal to non-streamed, in both
protocols; a budget of N stops the thinking at N tokens (the end marker is forced) and
the answer follows; thinking tokens are counted in usage.

The default model does not think, so the server renders chats with a template that opens
<think> at the start of the answer, as Qwen3's does: every answer then starts as thinking,
and with a budget the engine must end it."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenworks import SamplingParams
from tokenworks.engine.request import Thinking
from tokenworks.serve.reasoning import Reasoning, ReasoningSplitter

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
QWEN3 = Reasoning("<think>", "</think>")
USER = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "smollm2-135m"


def split(pieces: list[str], opened: bool) -> tuple[str, str]:
    splitter = ReasoningSplitter(QWEN3, opened)
    events = []
    for j, piece in enumerate(pieces):
        events += splitter.feed(piece, j == len(pieces) - 1)
    return (
        "".join(v for k, v in events if k == "reasoning"),
        "".join(v for k, v in events if k == "text"),
    )


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(
        [
            ("<think>\nhm, 1 < 2</think>\n\nParis.", False, "\nhm, 1 < 2", "Paris."),
            ("  <think>a</think>b", False, "a", "b"),
            ("<thin", False, "", "<thin"),
            ("Paris <think>x</think>", False, "", "Paris <think>x</think>"),
            ("step 1</think>\nanswer</think>", True, "step 1", "answer</think>"),
            ("cut sho", True, "cut sho", ""),
            ("<think>twice</think>x", True, "twice", "x"),
        ]
    ),
    st.data(),
)
def test_the_split_is_the_same_however_the_text_streams(case, data):
    text, opened, reasoning, answer = case
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(text) - 1, 1)), max_size=8)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert split([p for p in pieces if p] or [""], opened) == (reasoning, answer)


@pytest.mark.parametrize("budget", [0, 1, 7])
def test_a_budget_forces_the_end_marker_after_n_tokens(smol_llm, budget):
    tok = smol_llm.tokenizer
    end = tuple(tok.encode("</think>", add_special_tokens=False))
    thinking = Thinking(end_ids=end, opened=True, budget=budget)
    prompt = "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    plain = SamplingParams(max_tokens=budget + len(end) + 6, temperature=0)
    out = smol_llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0]
    bounded = SamplingParams(max_tokens=plain.max_tokens, temperature=0, thinking=thinking)
    got = smol_llm.generate([prompt], bounded, use_tqdm=False)[0].outputs[0]
    assert got.token_ids[:budget] == out.token_ids[:budget]  # the model's own thinking
    assert tuple(got.token_ids[budget : budget + len(end)]) == end
    assert got.reasoning_tokens == budget + len(end)
    assert len(got.token_ids) > budget + len(end)  # and the answer follows


def test_a_budget_holds_under_speculation(smol_loaded, smol_llm):
    from tokenworks import LLM

    llm = LLM(
        MODEL, loaded=smol_loaded, dtype="float32", quantization="none", threads=2,
        kv_cache_memory=0.1, warmup=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 6, "adaptive": False},
    )  # fmt: skip
    tok = smol_llm.tokenizer
    end = tuple(tok.encode("</think>", add_special_tokens=False))
    prompt = "<|im_start|>user\nRepeat: a b a b a b a b<|im_end|>\n<|im_start|>assistant\n<think>\n"
    params = SamplingParams(
        max_tokens=40, temperature=0, thinking=Thinking(end_ids=end, opened=True, budget=9)
    )
    want = smol_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert tuple(got.token_ids[9 : 9 + len(end)]) == end


@pytest.fixture(scope="module", params=["process", "thread"])
def thinking_server(smol_loaded, request):
    from conftest import start_server

    srv = start_server(
        smol_loaded, quantization="none", engine_process=request.param == "process",
        state_kw={"chat_template": THINKING_TEMPLATE, "reasoning_parser": "qwen3",
                  "reasoning_budget": 4},
    )  # fmt: skip
    yield srv
    srv.stop()


def expected(smol_llm, budget: int) -> tuple[str, int]:
    """The in-process engine's thinking text and token count for USER under the template."""
    from tokenworks.tokenizer.chat import ChatTemplate

    tok = smol_llm.tokenizer
    prompt = ChatTemplate(THINKING_TEMPLATE, tok).render(USER)
    end = tuple(tok.encode("</think>", add_special_tokens=False))
    params = SamplingParams(
        max_tokens=40, temperature=0, thinking=Thinking(end_ids=end, opened=True, budget=budget)
    )
    out = smol_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return tok.decode(out.token_ids[:budget]), out.reasoning_tokens


def test_openai_reasoning_content_streamed_and_not(thinking_server, smol_llm):
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=MODEL, messages=USER, max_tokens=40, temperature=0)
    r = client.chat.completions.create(**kw, extra_body={"max_reasoning_tokens": 4})
    message = r.choices[0].message
    thought, counted = expected(smol_llm, 4)
    assert message.reasoning_content == thought
    assert r.usage.completion_tokens_details.reasoning_tokens == counted
    assert message.content and "</think>" not in message.content
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True},
        extra_body={"max_reasoning_tokens": 4},
    )  # fmt: skip
    reasoning, content, usage = "", "", None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)
    assert usage.completion_tokens_details.reasoning_tokens == counted
    # effort "minimal" is a budget of 0: the end marker comes first
    r = client.chat.completions.create(**kw, reasoning_effort="minimal")
    assert not getattr(r.choices[0].message, "reasoning_content", None)
    assert r.choices[0].message.content


def test_anthropic_thinking_blocks_streamed_and_not(thinking_server, smol_llm):
    client = anthropic.Anthropic(base_url=thinking_server.url, api_key="x", max_retries=0)
    kw = dict(
        model=MODEL, messages=USER, max_tokens=40, extra_body={"temperature": 0},
        thinking={"type": "enabled", "budget_tokens": 3},
    )  # fmt: skip
    r = client.messages.create(**kw)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == expected(smol_llm, 3)[0]
    with client.messages.stream(**kw) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in kinds and "text_delta" in kinds
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in r.content]
    off = client.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"]  # the template closed it in the prompt
    counted = client.messages.count_tokens(model=MODEL, messages=USER)
    assert counted.input_tokens > 0


def test_responses_reasoning_items(thinking_server, smol_llm):
    """The Responses API: the thinking is a reasoning item before the message, bounded by
    the server's --reasoning-budget (4 here), its tokens counted."""
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=MODEL, input=USER[0]["content"], max_output_tokens=40, temperature=0)
    r = client.responses.create(**kw)
    thought, counted = expected(smol_llm, 4)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == thought
    assert r.usage.output_tokens_details.reasoning_tokens == counted
    events = list(client.responses.create(**kw, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == thought and events[-1].response.output_text == r.output_text


def test_reasoning_fields_are_bounded(thinking_server):
    url = thinking_server.url
    for path, body, field in [
        ("/v1/chat/completions", {"max_reasoning_tokens": 10**9}, "max_reasoning_tokens"),
        ("/v1/chat/completions", {"max_reasoning_tokens": -1}, "max_reasoning_tokens"),
        ("/v1/chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort"),
        ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 10**9}},
         "thinking.budget_tokens"),
        ("/v1/messages", {"thinking": {"type": "sometimes"}}, "thinking.type"),
    ]:  # fmt: skip
        r = httpx.post(url + path, json={"model": MODEL, "messages": USER, "max_tokens": 4, **body})
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert field in (error.get("param") or error.get("message")), r.text


def test_the_markers_follow_the_chat_template():
    from tokenworks.serve.reasoning import resolve

    def markers(source):
        found = resolve("auto", source, None)
        return found and (found.open, found.close)

    assert markers("{{ '<think>' }}...{{ '</think>' }}") == ("<think>", "</think>")
    assert markers("[THINK]{{ m.thinking }}[/THINK]") == ("[THINK]", "[/THINK]")
    assert markers("<|START_THINKING|>x<|END_THINKING|>") == (
        "<|START_THINKING|>", "<|END_THINKING|>"
    )
    assert markers("<|start|>assistant<|channel|>final<|message|>") == (
        "<|channel|>analysis<|message|>", "<|end|>"
    )
    assert markers("{{ messages[0].content }}") is None


@pytest.mark.parametrize(
    ("text", "reasoning", "answer"),
    [
        # thinking the template opened, never closed, ends where a call starts
        ("Let me look.\n<tool_call>{}</tool_call>", "Let me look.\n", "<tool_call>{}</tool_call>"),
        # a call the end marker follows is part of the thinking
        ("maybe <tool_call>{}</tool_call>?</think>No.", "maybe <tool_call>{}</tool_call>?", "No."),
    ],
)
def test_a_call_ends_thinking_that_is_never_closed(text, reasoning, answer):
    for size in range(1, len(text) + 1):
        splitter = ReasoningSplitter(QWEN3, opened=True, call_starts=("<tool_call>",))
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        events = [e for j, p in enumerate(pieces) for e in splitter.feed(p, j == len(pieces) - 1)]
        got = ("".join(v for k, v in events if k == "reasoning"),
               "".join(v for k, v in events if k == "text"))  # fmt: skip
        assert got == (reasoning, answer), size
