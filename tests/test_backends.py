"""Backends behind the server's one EngineFront interface, several models in one server
(--backend NAME=KIND:MODEL): transformers' generate (front/hf_front.py) on the default
model's file gives the native engine's greedy text in float32, through both protocols,
streamed and not, under the same /v1/models and metrics; what it cannot do is a 400."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


HF = "smol-hf"


@pytest.fixture(scope="module")
def server(smol_loaded):
    """One server: the default model natively, and as HF through transformers."""
    from conftest import start_server

    from tokenworks.front.hf_front import HFFront
    from tokenworks.serve.server import add_model

    srv = start_server(smol_loaded, quantization="none", warmup=False)
    front = HFFront(MODEL)
    front.start()  # (a started front, as a core client is when it is added)
    add_model(srv.state, HF, front)
    srv.hf_front = front
    yield srv
    front.shutdown()
    srv.stop()


def test_transformers_gives_the_native_greedy_text(server):
    answers = {}
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert [m.id for m in oai.models.list().data] == [MODEL, HF]
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    for model in (MODEL, HF):
        kw = dict(model=model, messages=CHAT, max_tokens=24, temperature=0)
        plain = oai.chat.completions.create(**kw)
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in oai.chat.completions.create(**kw, stream=True)
            if c.choices
        )
        stopped = oai.chat.completions.create(**kw | {"stop": [","]})
        message = claude.messages.create(
            model=model, messages=CHAT, max_tokens=24, extra_body={"temperature": 0}
        )
        answers[model] = (
            plain.choices[0].message.content,
            streamed,
            stopped.choices[0].message.content,
            message.content[0].text,
            plain.usage.completion_tokens,
            plain.choices[0].finish_reason,
        )
        assert answers[model][0] == streamed == message.content[0].text
    assert answers[HF] == answers[MODEL]
    metrics = httpx.get(server.url + "/metrics").text
    assert f'model_name="{HF}"' in metrics and f'model_name="{MODEL}"' in metrics


def test_llm_over_a_backend_gives_the_native_tokens(server, smol_llm):
    """LLM.over(front): the offline API through the backend interface, batched prompts
    (text and token ids) and a stop string, as the native LLM gives them."""
    from tokenworks import LLM, SamplingParams

    llm = LLM.over(server.hf_front)
    prompts = ["The capital of France is", smol_llm.tokenizer.encode("Once upon a time")]
    params = [SamplingParams(max_tokens=12, temperature=0),
              SamplingParams(max_tokens=12, temperature=0, stop=[","])]  # fmt: skip
    theirs = smol_llm.generate(prompts, params, use_tqdm=False)
    ours = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, theirs, strict=True):
        got, want = a.outputs[0], b.outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text,
            want.token_ids,
            want.finish_reason,
            want.stop_reason,
        )


def test_what_transformers_cannot_do_is_a_400(server):
    url = server.url + "/v1/chat/completions"
    for extra, what in [
        ({"logprobs": True}, "logprobs"),
        ({"n": 2}, "n > 1"),
        ({"response_format": {"type": "json_object"}}, "structured output"),
    ]:
        r = httpx.post(url, json={"model": HF, "messages": CHAT, "max_tokens": 4, **extra})
        assert r.status_code == 400, r.text
        assert what in r.json()["error"]["message"]


def test_backend_flags_are_checked():
    from tokenworks.serve.serve_config import ServeConfig

    both = ["a=native:gemma3-270m", "b=transformers:smollm2-135m"]
    assert ServeConfig(backend=both).backends == {
        "a": "native:gemma3-270m",
        "b": "transformers:smollm2-135m",
    }
    assert ServeConfig(backend=["u=remote:m@http://10.0.0.1:8000/v1"]).backends["u"]
    for bad in (["a"], ["a=remote:x"], ["a=other:x"], ["=native:x"], ["a=native:"],
                ["a=native:x", "a=native:y"], ["a=remote:m@ftp://x"]):  # fmt: skip
        with pytest.raises(ValueError, match="--backend"):
            ServeConfig(backend=bad)


@pytest.fixture(scope="module")
def proxy(server, smol_loaded):
    """A second server: the same model natively, and as "remote", relayed to the first
    server's native model (a tokenworks server standing in as the remote engine)."""
    from conftest import start_server

    from tokenworks.serve.remote import RemoteBackend
    from tokenworks.serve.server import add_model

    srv = start_server(smol_loaded, quantization="none", warmup=False)
    upstream = RemoteBackend("remote", f"{MODEL}@{server.url}/v1")
    upstream.start()
    add_model(srv.state, "remote", upstream)
    yield srv
    srv.stop()


def test_a_remote_engine_gives_its_text_through_every_protocol(proxy):
    oai = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0, timeout=120)
    answers = {}
    for model in (MODEL, "remote"):
        kw = dict(model=model, messages=CHAT, max_tokens=24, temperature=0)
        chat = oai.chat.completions.create(**kw)
        chunks = oai.chat.completions.create(**kw, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        text = oai.completions.create(model=model, prompt="The sky is", max_tokens=8,
                                      temperature=0).choices[0].text  # fmt: skip
        akw = dict(model=model, messages=CHAT, max_tokens=24, extra_body={"temperature": 0})
        message = claude.messages.create(**akw)
        with claude.messages.stream(**akw) as stream:
            final = stream.get_final_message()
        rkw = dict(model=model, input=CHAT[0]["content"], max_output_tokens=24, temperature=0)
        response = oai.responses.create(**rkw)
        events = list(oai.responses.create(**rkw, stream=True))
        answers[model] = (chat.choices[0].message.content, text, chat.usage.completion_tokens)
        assert chat.choices[0].message.content == streamed == message.content[0].text
        assert final.content[0].text == response.output_text == events[-1].response.output_text
        assert message.usage.output_tokens == response.usage.output_tokens == 24 or (
            message.stop_reason == "end_turn"
        )
    assert answers["remote"] == answers[MODEL]
    assert [m.id for m in oai.models.list().data] == [MODEL, "remote"]


def test_tools_reach_a_remote_engine_in_both_protocols(proxy):
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
               "required": ["city"]}  # fmt: skip
    claude = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0, timeout=120)
    kw = dict(model="remote", max_tokens=60, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=[{"name": "get_weather", "description": "Weather", "input_schema": weather}],
              tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    message = claude.messages.create(**kw)
    use = [b for b in message.content if b.type == "tool_use"][0]
    assert message.stop_reason == "tool_use" and isinstance(use.input["city"], str)
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b for b in final.content if b.type == "tool_use"][0].input == use.input
    oai = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = oai.responses.create(
        model="remote", input="Weather in Paris?", max_output_tokens=60, temperature=0,
        tools=[{"type": "function", "name": "get_weather", "parameters": weather}],
        tool_choice={"type": "function", "name": "get_weather"},
    )  # fmt: skip
    assert r.output[0].type == "function_call" and r.output[0].name == "get_weather"


def test_a_failing_remote_engine_is_a_clear_502_or_504(proxy):
    """A refused connection and a 5xx are 502s, no answer before the deadline a 504, each
    at once, and the server goes on serving."""
    import asyncio
    import socket

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from tokenworks.serve.remote import RemoteBackend
    from tokenworks.serve.server import ServerThread, add_model

    broken = FastAPI()

    @broken.post("/v1/chat/completions")
    async def chat(request: dict):
        if request.get("max_tokens") == 1:
            await asyncio.sleep(6)  # (never answers before the 1 s deadline)
        return JSONResponse({"error": {"message": "out of memory"}}, status_code=500)

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with ServerThread(broken) as failing:
        for name, url in (("refused", f"http://127.0.0.1:{closed}/v1"),
                          ("failing", failing.url + "/v1")):  # fmt: skip
            if name not in proxy.state.others:
                front = RemoteBackend(name, f"m@{url}")
                front.start()
                add_model(proxy.state, name, front)
        body = {"messages": CHAT, "max_tokens": 4}
        for model, stream, status, word in [
            ("refused", False, 502, "could not be reached"),
            ("refused", True, 502, "could not be reached"),
            ("failing", False, 502, "out of memory"),
            ("failing", True, 502, "out of memory"),
        ]:
            r = httpx.post(proxy.url + "/v1/chat/completions", timeout=30,
                           json={"model": model, "stream": stream, **body})  # fmt: skip
            assert r.status_code == status and word in r.json()["error"]["message"], r.text
        r = httpx.post(proxy.url + "/v1/messages", timeout=30, json={
            "model": "failing", "messages": CHAT, "max_tokens": 4})  # fmt: skip
        assert r.status_code == 502 and "out of memory" in r.text
        t0 = time.monotonic()
        r = httpx.post(proxy.url + "/v1/chat/completions", timeout=30, json={
            "model": "failing", "messages": CHAT, "max_tokens": 1, "deadline": 1})  # fmt: skip
        assert r.status_code == 504 and time.monotonic() - t0 < 5, r.text
    ok = httpx.post(proxy.url + "/v1/chat/completions", timeout=60,
                    json={"model": MODEL, "messages": CHAT, "max_tokens": 2})  # fmt: skip
    assert ok.status_code == 200
