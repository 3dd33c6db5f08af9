"""Tool-call formats (serve/tool_formats.py): each family's calls read back whole and
streamed alike, and through a real server with the official SDKs, a forced call written in
the format's own syntax, read back, answered and followed by the model's reply, streamed
and not."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from tokenizers import Tokenizer

from tokenworks.serve import tool_formats
from tokenworks.serve.tools import Tool

MODEL = "smollm2-135m"
WEATHER = Tool(
    "get_weather",
    "Current weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city"],
    },
)
TIME = Tool(
    "get_time",
    "Current time in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
FORMATS = ["hermes", "llama3_json", "mistral", "qwen3_coder", "deepseek_v3", "deepseek_v32",
           "kimi_k2", "glm45", "command_r7b", "command_r", "gemma4", "minimax_m2", "minimax_m3",
           "kimi_k3", "seed_oss", "minicpm5", "lfm2", "nemotron", "gigachat", "apriel",
           "apertus", "firefunction", "functionary_v31", "functionary_v32", "atem",
           "harmony"]  # fmt: skip
SERVED = FORMATS[:-1]  # (harmony's are served under its own template: tests/test_harmony.py)


def read(fmt, pieces: list[str]) -> list[tuple]:
    parser = fmt.parser([WEATHER, TIME], "call_")
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    out = []
    for kind, value in events:
        if kind == "text":
            if out and out[-1][0] == "text":
                out[-1] = ("text", out[-1][1] + value)
            else:
                out.append(("text", value))
        elif kind == "call_end":
            out.append(("call", value.name, json.loads(value.arguments)))
    return out


@pytest.mark.parametrize("name", FORMATS)
def test_calls_read_back_whole_and_streamed(name):
    fmt = tool_formats.FORMATS[name]()
    calls = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"city": "Oslo"})]
    if name == "mistral":
        written = fmt.start + json.dumps([{"name": n, "arguments": a} for n, a in calls])
    elif name == "llama3_json":
        written = "; ".join(fmt.render_call(n, a) for n, a in calls)
    else:
        written = "\n".join(fmt.render_call(n, a) for n, a in calls)
    want = [("call", n, a) for n, a in calls]
    assert read(fmt, [written]) == read(fmt, list(written)) == want
    if name != "llama3_json":  # (whose calls are the whole answer)
        # (Functionary v3.2's text has a recipient too; its prompt wrote the first >>>)
        text = ("all\n" if name == "functionary_v32" else "") + "Let me look.\n" + written
        assert read(fmt, list(text)) == [("text", "Let me look.\n"), *want]
    assert read(fmt, list("No call, just {text} [and] <tags>")) == [
        ("text", "No call, just {text} [and] <tags>")
    ]


def test_deepseek_v31_writes_the_name_before_the_separator():
    fmt = tool_formats.DeepSeekV3()
    written = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "Rome"}'
               "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")  # fmt: skip
    assert read(fmt, list(written)) == [("call", "get_time", {"city": "Rome"})]


def test_other_spellings_and_broken_calls():
    mistral = tool_formats.Mistral()
    newer = '[TOOL_CALLS]get_time[ARGS]{"city": "Rome"}'
    assert read(mistral, list(newer)) == [("call", "get_time", {"city": "Rome"})]
    assert read(mistral, ["[TOOL_CALLS][{oops"]) == [("text", "[TOOL_CALLS][{oops")]
    llama = tool_formats.Llama3Json()
    tagged = '<|python_tag|>{"name": "get_time", "parameters": {"city": "Rome"}}'
    assert read(llama, list(tagged)) == [("call", "get_time", {"city": "Rome"})]
    assert read(llama, ["{not json"]) == [("text", "{not json")]


def test_the_format_follows_the_chat_template():
    def resolved(source):
        return tool_formats.resolve("auto", source, None).name

    assert resolved("{{ '<|python_tag|>' }} ipython") == "llama3_json"
    assert resolved("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert resolved("<tool_call>\n<function={{ name }}>") == "qwen3_coder"
    assert resolved("<tool_call>{{ tool | tojson }}</tool_call>") == "hermes"
    assert resolved("{{ '<|start|>assistant<|channel|>final<|message|>' }}") == "harmony"
    assert resolved("{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' }}") == "deepseek_v3"
    assert resolved("{{ '<|tool_calls_section_begin|>' }}") == "kimi_k2"
    assert resolved("<tool_call>{{ name }}<arg_key>{{ k }}</arg_key>") == "glm45"
    dsml = tool_formats.resolve("auto", "{{ '<｜DSML｜tool_calls>' }}", None)
    assert (dsml.name, dsml.wrapper) == ("deepseek_v32", "tool_calls")
    assert resolved("{{ '<|tools_prefix|>' }}") == "apertus"
    assert resolved("{{ '<tool_calls>[' }}") == "apriel"
    assert resolved("{{ ' functools[' }}") == "firefunction"
    assert resolved("{{ '<function=' + name + '>' + args }}") == "functionary_v31"
    assert resolved("{{ '>>>' + tool_call['function']['name'] }}") == "functionary_v32"
    assert resolved("{{- '<atem:function_calls>\\n<atem:invoke name=\"' -}}") == "atem"
    assert resolved(None) == "hermes"


def test_a_special_token_marker_is_matched_as_that_token(smol_llm):
    """Where the marker is one special token (Mistral's [TOOL_CALLS]), the grammar names
    the token and the output keeps special tokens, so the parser sees the marker."""
    from tokenworks.tokenizer.tokenizer import TokenizerWrapper

    tk = Tokenizer.from_str(smol_llm.tokenizer.tk.to_str())
    tk.add_special_tokens(["[TOOL_CALLS]"])
    fmt = tool_formats.Mistral(TokenizerWrapper(tk))
    marker = tk.token_to_id("[TOOL_CALLS]")
    assert fmt.special_marker and f"<[{marker}]>" in fmt.grammar([WEATHER])
    plain = tool_formats.Mistral(smol_llm.tokenizer)
    assert not plain.special_marker and '"[TOOL_CALLS]"' in plain.grammar([WEATHER])


@pytest.fixture(scope="module", params=SERVED)
def format_server(smol_loaded, request):
    from conftest import start_server

    # the default numerics (batch-invariant, so a prefix hit repeats a miss's tokens)
    srv = start_server(
        smol_loaded, dtype="auto", warmup=False, state_kw={"tool_call_parser": request.param}
    )
    srv.format = request.param
    yield srv
    srv.stop()


OPENAI_TOOLS = [
    {"type": "function", "function": t.as_openai()["function"]} for t in (WEATHER, TIME)
]


def _room(server) -> int:
    """Tokens a forced call needs: DeepSeek's, Kimi's, MiniMax M3's and ATEM's markers are
    many tokens in this vocabulary."""
    return 200 if server.format.startswith(("deepseek", "kimi", "minimax_m3", "atem")) else 60


def test_each_format_round_trips_through_the_openai_sdk(format_server):
    client = openai.OpenAI(base_url=format_server.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, messages=messages, tools=OPENAI_TOOLS, temperature=0,
              max_tokens=_room(format_server))
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(**kw, tool_choice=named)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(args.get("city"), str)
    streamed = {"name": "", "arguments": ""}
    finish = None
    for chunk in client.chat.completions.create(**kw, tool_choice=named, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                streamed["name"] += d.function.name or ""
                streamed["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert streamed == {"name": "get_weather", "arguments": call.function.arguments}
    either = client.chat.completions.create(**kw, tool_choice="required")
    assert either.choices[0].message.tool_calls[0].function.name in ("get_weather", "get_time")
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and sunny"},
    ]
    answer = client.chat.completions.create(**kw, tool_choice="none")
    assert answer.choices[0].message.content


def test_each_format_round_trips_through_the_anthropic_sdk(format_server):
    client = anthropic.Anthropic(base_url=format_server.url, api_key="x", max_retries=0)
    kw = dict(
        model=MODEL, max_tokens=_room(format_server), extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "What time is it in Oslo?"}],
        tools=[{"name": t.name, "description": t.description, "input_schema": t.parameters}
               for t in (WEATHER, TIME)],
        tool_choice={"type": "tool", "name": "get_time"},
    )  # fmt: skip
    message = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert message.stop_reason == final.stop_reason == "tool_use"
    uses = [[b for b in m.content if b.type == "tool_use"] for m in (message, final)]
    assert [(u[0].name, u[0].input) for u in uses] == [(uses[0][0].name, uses[0][0].input)] * 2
    assert uses[0][0].name == "get_time" and isinstance(uses[0][0].input.get("city"), str)
