"""Anthropic Messages and tool calling in both protocols, against a real server, with the
official `anthropic` and `openai` SDKs: a full round trip (call, tool result, answer),
streamed and not."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

MODEL = "smollm2-135m"
QUESTION = "What is the weather in Paris today?"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 40}},
                "required": ["city"],
            },
        },
    },
]
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in OPENAI_TOOLS
]


@pytest.fixture(scope="module")
def oai(smol_server):
    return openai.OpenAI(
        base_url=smol_server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def claude(smol_server):
    # This SDK no longer sends sampling fields (temperature...); they go in extra_body.
    return anthropic.Anthropic(
        base_url=smol_server.url, api_key="unused", max_retries=0, timeout=120
    )


def test_messages_stream_equals_non_stream(smol_server, claude):
    kw = dict(
        model=MODEL,
        max_tokens=20,
        messages=[{"role": "user", "content": "Hi!"}],
        system="You are terse.",
        extra_body={"seed": 11, "temperature": 0.7},
    )
    msg = claude.messages.create(**kw)
    tok = smol_server.engine.tokenizer
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    )
    assert msg.usage.input_tokens == len(tok.encode(rendered))
    with claude.messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text
    assert final.usage.output_tokens == msg.usage.output_tokens
    assert final.stop_reason == msg.stop_reason
    # the exact event sequence the protocol defines (text events are the SDK's own extras)
    wire = [e for e in events if e not in ("text",)]
    assert wire[0] == "message_start" and wire[1] == "content_block_start"
    assert set(wire[2:-3]) == {"content_block_delta"}
    assert wire[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_messages_stop_sequence(claude):
    msg = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        stop_sequences=[" "],
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Tell me a story."}],
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == " "
    assert " " not in msg.content[0].text


def _openai_round_trip(oai, stream: bool):
    messages = [{"role": "user", "content": QUESTION}]
    kw = dict(model=MODEL, messages=messages, tools=OPENAI_TOOLS, temperature=0, max_tokens=80)
    named = {"type": "function", "function": {"name": "get_weather"}}
    if stream:
        calls: dict[int, dict] = {}
        finish, pieces = None, 0
        for chunk in oai.chat.completions.create(**kw, tool_choice=named, stream=True):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    slot = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] += d.id or ""
                    slot["name"] += d.function.name or ""
                    slot["arguments"] += d.function.arguments or ""
                    pieces += bool(d.function.arguments)
        assert finish == "tool_calls" and len(calls) == 1
        assert pieces > 3  # the arguments stream as they are generated
        call = calls[0]
    else:
        r = oai.chat.completions.create(**kw, tool_choice=named)
        assert r.choices[0].finish_reason == "tool_calls"
        tc = r.choices[0].message.tool_calls[0]
        call = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    args = json.loads(call["arguments"])
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": '{"temperature": 21, "sky": "sun"}',
        },
    ]
    if stream:
        chunks = list(oai.chat.completions.create(**kw, tool_choice="none", stream=True))
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        answer = oai.chat.completions.create(**kw, tool_choice="none").choices[0].message.content
    assert answer and "<tool_call>" not in answer
    return answer


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_tool_round_trip(oai, stream):
    _openai_round_trip(oai, stream)


def test_openai_required_picks_a_declared_tool(oai):
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=OPENAI_TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time")
    json.loads(call.function.arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_anthropic_tool_round_trip(claude, stream):
    messages = [{"role": "user", "content": QUESTION}]
    kw = dict(
        model=MODEL,
        max_tokens=80,
        tools=ANTHROPIC_TOOLS,
        messages=messages,
        extra_body={"temperature": 0},
    )
    choice = {"type": "tool", "name": "get_weather"} if stream else {"type": "any"}
    if stream:
        with claude.messages.stream(**kw, tool_choice=choice) as s:
            deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
            msg = s.get_final_message()
        assert deltas.count("input_json_delta") > 3
    else:
        msg = claude.messages.create(**kw, tool_choice=choice)
    assert msg.stop_reason == "tool_use"
    use = [b for b in msg.content if b.type == "tool_use"][0]
    assert use.id.startswith("toolu_") and use.name in ("get_weather", "get_time")
    assert isinstance(use.input, dict) and "city" in use.input
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "21 degrees and sunny"}
            ],
        },
    ]
    if stream:
        with claude.messages.stream(**kw, tool_choice={"type": "none"}) as s:
            answer = s.get_final_message()
    else:
        answer = claude.messages.create(**kw, tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert text and "<tool_call>" not in text


def test_anthropic_count_tokens_counts_what_messages_reads(claude):
    """messages.count_tokens (the SDK's own call) gives the input tokens a Messages request
    with the same system prompt, conversation and tools reports."""
    kw = dict(
        model=MODEL,
        system="You answer briefly.",
        messages=[{"role": "user", "content": QUESTION}],
        tools=ANTHROPIC_TOOLS,
    )
    counted = claude.messages.count_tokens(**kw).input_tokens
    used = claude.messages.create(**kw, max_tokens=1).usage.input_tokens
    assert counted == used
    assert claude.messages.count_tokens(**kw | {"tools": []}).input_tokens < counted


def test_tool_call_parser_streams_like_one_piece():
    from tokenworks.serve.tools import ToolCallParser

    def run(text: str, pieces: list[str]):
        parser = ToolCallParser()
        events = []
        for p in pieces:
            events += parser.feed(p)
        events += parser.finish()
        out, args = [], ""
        for kind, value in events:  # join text runs; gather each call's argument pieces
            if kind == "text":
                if out and out[-1][0] == "text":
                    out[-1] = ("text", out[-1][1] + value)
                else:
                    out.append(("text", value))
            elif kind == "call_args":
                args += value
            elif kind == "call_end":
                assert args == value.arguments  # the pieces add up to the whole
                out.append(("call", value.name, json.loads(value.arguments)))
                args = ""
        return out, [kind for kind, _ in events]

    text = (
        'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": {"y": [1, 2]}}}\n'
        '</tool_call>\n<tool_call>{"arguments": {}, "name": "g"}</tool_call>\nDone'
    )
    whole, _ = run(text, [text])
    streamed, kinds = run(text, list(text))
    assert (
        whole
        == streamed
        == [
            ("text", "Let me check.\n"),
            ("call", "f", {"x": {"y": [1, 2]}}),
            ("call", "g", {}),
            ("text", "Done"),
        ]
    )
    # the first call's arguments arrive in many pieces, before the call ends
    assert kinds.count("call_args") > 10 and kinds.index("call_start") < kinds.index("call_args")
    broken, _ = run("<tool_call>{not json</tool_call>", ["<tool_call>{not json</tool_call>"])
    assert broken == [("text", "<tool_call>{not json</tool_call>")]
    # cut short (max_tokens) inside the closing tag: the call before it is whole
    cut = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool'
    assert run(cut, [cut])[0] == run(cut, list(cut))[0] == [("call", "f", {"x": 1})]


@pytest.mark.parametrize("parallel", [None, False])
def test_parallel_tool_calls_false_keeps_the_first_call(parallel):
    """Two calls in one answer come back as two, or with parallel_tool_calls false as the
    first alone, streamed and folded alike."""
    import asyncio

    from tokenworks.engine.messages import CompletionDelta, RequestUpdate
    from tokenworks.serve.answer_parser import AnswerParser
    from tokenworks.serve.chat_job import ChatJob
    from tokenworks.serve.openai_answer import chat_chunks, fold_chat, head
    from tokenworks.serve.tools import ToolCallParser

    text = "".join(
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}\n</tool_call>\n'
        for c in ("Paris", "Rome")
    )
    job = ChatJob([{"role": "user", "content": "x"}], parallel_tool_calls=parallel)

    async def updates():
        for j in range(0, len(text), 7):  # in pieces, as a stream gives it
            done = j + 7 >= len(text)
            delta = CompletionDelta(0, text[j : j + 7], [1], None, "stop" if done else None, None)
            yield RequestUpdate("r", [delta], done, 3, 0)

    async def chunks():
        parsers = lambda: AnswerParser(calls=ToolCallParser())  # noqa: E731
        return [c async for c in chat_chunks(job, updates(), parsers)]

    answer = fold_chat(
        asyncio.run(chunks()), head("chatcmpl-x", "chat.completion", MODEL), True, False
    )
    calls = answer["choices"][0]["message"]["tool_calls"]
    cities = [json.loads(c["function"]["arguments"])["city"] for c in calls]
    assert cities == (["Paris"] if parallel is False else ["Paris", "Rome"])
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
