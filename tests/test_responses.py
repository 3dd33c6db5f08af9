"""The Responses API (serve/responses.py) through the official openai SDK, on both
transports: text, streamed events equal to the non-streamed response, a function tool
round trip over previous_response_id, structured output (text.format), the store's
retrieve / delete and its bounds."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tokenworks.serve.response_store import ResponseStore

MODEL = "smollm2-135m"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_text_streamed_and_not_equal_the_chat_answer(client):
    kw = dict(model=MODEL, instructions="You are terse.", input="Name a fruit.",
              max_output_tokens=16, temperature=0)  # fmt: skip
    r = client.responses.create(**kw)
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0,
        messages=[{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Name a fruit."}],
    )  # fmt: skip
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response." + r.status.replace("completed", "completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == r.output_text
    assert "response.output_text.done" in kinds and "response.output_item.done" in kinds


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_function_tool_round_trip(client, stream):
    kw = dict(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=60,
              tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    question = "What is the weather in Paris?"
    if stream:
        events = list(client.responses.create(**kw, input=question, stream=True))
        pieces = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        r = events[-1].response
        assert pieces == r.output[0].arguments
    else:
        r = client.responses.create(**kw, input=question)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    follow = client.responses.create(
        model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=30,
        previous_response_id=r.id, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "21 degrees and sunny"}],
    )  # fmt: skip
    assert follow.output[0].type == "message" and follow.output_text
    assert follow.previous_response_id == r.id


def test_structured_output(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"type": "integer"}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=MODEL, input="Give a city as JSON.", temperature=0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
    )  # fmt: skip
    value = json.loads(r.output_text)
    assert set(value) == {"city", "rank"} and isinstance(value["rank"], int)


def test_the_store_retrieves_deletes_and_refuses_strangers(client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    again = client.responses.create(
        model=MODEL, input="And again?", previous_response_id=r.id, max_output_tokens=4
    )
    assert again.previous_response_id == r.id
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=r.id)
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_bad_responses_requests_are_a_400(smol_server):
    import httpx

    for body, field in [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": [{"type": "image", "url": "x"}]}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input"),
        ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "nope"},
          "tools": [WEATHER]}, "tool_choice"),
    ]:  # fmt: skip
        r = httpx.post(smol_server.url + "/v1/responses", json={"model": MODEL, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == field, r.text


def test_the_store_is_bounded_in_count_and_age():
    store = ResponseStore(capacity=2, ttl_s=0.3)
    for rid in ("a", "b", "c"):
        store.put(rid, "tenant", [], {"id": rid})
    assert store.get("a", "tenant") is None  # the oldest went first
    assert store.get("b", "tenant") is not None and store.get("b", "other") is None
    time.sleep(0.35)
    assert store.get("c", "tenant") is None
