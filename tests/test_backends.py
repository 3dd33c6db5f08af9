"""Backends behind the server's one EngineFront interface, several models in one server
(--backend NAME=KIND:MODEL): transformers' generate (engine/hf_front.py) on the default
model's file gives the native engine's greedy text in float32, through both protocols,
streamed and not, under the same /v1/models and metrics; what it cannot do is a 400."""

from __future__ import annotations

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

    from tokenworks.engine.hf_front import HFFront
    from tokenworks.serve.server import add_model

    srv = start_server(smol_loaded, quantization="none", warmup=False)
    front = HFFront(MODEL)
    front.start()  # (a started front, as a core client is when it is added)
    add_model(srv.state, HF, front)
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
    for bad in (["a"], ["a=remote:x"], ["=native:x"], ["a=native:"], ["a=native:x", "a=native:y"]):
        with pytest.raises(ValueError, match="--backend"):
            ServeConfig(backend=bad)
