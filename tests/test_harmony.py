"""gpt-oss's harmony channels through a real server and the three protocols: the analysis
channel comes back as reasoning, the final channel as the answer, a call on the commentary
channel as a tool call, streamed and not.

The default model is served under gpt-oss's real chat template (from llama.cpp's sources),
so the server reads its answers as harmony; a guided choice, or the grammar of a forced
call, makes it write the channels' markers (plain text in its vocabulary, as gpt-oss's own
tokens decode to)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

MODEL = "smollm2-135m"
ANSWER = ("<|channel|>analysis<|message|>The user says hi.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Hello there!")  # fmt: skip
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"]}}  # fmt: skip
USER = [{"role": "user", "content": "Hi! What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def harmony_server(smol_loaded, llama_cpp_sources):
    from conftest import start_server

    template = llama_cpp_sources / "models" / "templates" / "openai-gpt-oss-120b.jinja"
    srv = start_server(smol_loaded, warmup=False, state_kw={"chat_template": str(template)})
    assert srv.state.tool_format.name == "harmony"
    yield srv
    srv.stop()


def test_the_channels_come_back_as_reasoning_and_answer(harmony_server):
    client = openai.OpenAI(base_url=harmony_server.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=MODEL, messages=USER, max_tokens=60, temperature=0,
              extra_body={"guided_choice": [ANSWER]})  # fmt: skip
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == ("The user says hi.", "Hello there!")
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == ("The user says hi.", "Hello there!")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_forced_call_is_written_on_the_commentary_channel_and_read_back(harmony_server,
                                                                          stream):  # fmt: skip
    url = harmony_server.url
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    tools = [{"type": "function", "function": WEATHER}]
    chat_kw = dict(model=MODEL, messages=USER, max_tokens=60, temperature=0, tools=tools,
                   tool_choice=named)  # fmt: skip
    if stream:
        name, args, finish = "", "", None
        for chunk in oai.chat.completions.create(**chat_kw, stream=True):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    name += d.function.name or ""
                    args += d.function.arguments or ""
    else:
        r = oai.chat.completions.create(**chat_kw)
        call, finish = r.choices[0].message.tool_calls[0], r.choices[0].finish_reason
        name, args = call.function.name, call.function.arguments
    assert (name, finish) == ("get_weather", "tool_calls")
    assert isinstance(json.loads(args)["city"], str)

    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    messages_kw = dict(model=MODEL, messages=USER, max_tokens=60, extra_body={"temperature": 0},
                       tools=[{"name": WEATHER["name"], "description": WEATHER["description"],
                               "input_schema": WEATHER["parameters"]}],
                       tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    if stream:
        with claude.messages.stream(**messages_kw) as s:
            message = s.get_final_message()
    else:
        message = claude.messages.create(**messages_kw)
    use = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and use[0].name == "get_weather"
    assert isinstance(use[0].input["city"], str)

    responses_kw = dict(model=MODEL, input=USER[0]["content"], temperature=0,
                        max_output_tokens=60, tools=[{"type": "function", **WEATHER}],
                        tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    if stream:
        r = list(oai.responses.create(**responses_kw, stream=True))[-1].response
    else:
        r = oai.responses.create(**responses_kw)
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
