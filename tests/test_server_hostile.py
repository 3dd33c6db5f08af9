"""What a careless or hostile client can send: each probe gets a 4xx naming the field (or
succeeds), the connection it came on stays usable, a request's failure stays its own, the
server's bounds hold, and API keys guard every endpoint but /health and /metrics, each
key's requests in a prefix cache of their own."""

from __future__ import annotations

import asyncio
import http.client
import json

import faults
import httpx
import pytest
from conftest import start_server

from tokenworks.serve.limits import ServerLimits

MODEL = "smollm2-135m"
KEYS = ("tenant-a-key", "tenant-b-key")
A, B = ({"authorization": f"Bearer {k}"} for k in KEYS)
USER = [{"role": "user", "content": "Say hi."}]
LIMITS = ServerLimits(
    max_body_mb=0.25, max_stop=8, max_n=4, max_logprobs=5, max_messages=50,
    max_tools=4, max_tools_kb=4, max_prompts=4,
)  # fmt: skip


@pytest.fixture(scope="module")
def guarded(smol_loaded):
    srv = start_server(smol_loaded, api_keys=KEYS, limits=LIMITS, max_num_seqs=12)
    yield srv
    srv.stop()


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **kw}


BAD = [
    # the template's own arguments through chat_template_kwargs
    ("/v1/chat/completions", _chat(chat_template_kwargs={"add_generation_prompt": False}),
     400, "chat_template_kwargs"),
    ("/v1/chat/completions", _chat(chat_template_kwargs={"messages": []}), 400,
     "chat_template_kwargs"),
    ("/v1/chat/completions", _chat(chat_template_kwargs={"tools": []}), 400,
     "chat_template_kwargs"),
    # malformed conversations
    ("/v1/chat/completions",
     _chat(messages=[*USER, {"role": "assistant", "content": "", "tool_calls": ["x"]}]),
     400, "messages"),
    ("/v1/chat/completions", _chat(messages=[*USER, "hello"]), 400, "messages"),
    ("/v1/chat/completions", _chat(tools=["x"]), 400, "tools"),
    ("/tokenize", {"messages": [{}]}, 400, "messages"),
    # values that cannot be sampled
    ("/v1/chat/completions", _chat(seed=2**64 - 1), 400, "seed"),
    ("/v1/chat/completions", _chat(seed=-1), 400, "seed"),
    ("/v1/chat/completions", _chat(n=2, seed=2**64 - 1), 400, "seed"),
    ("/v1/chat/completions", _chat(repetition_penalty=1e-45), 400, "repetition_penalty"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": USER, "seed": 2**64},
     400, None),
    # the server's bounds
    ("/v1/chat/completions", _chat(max_tokens=10**30), 400, "max_tokens"),
    ("/v1/chat/completions", _chat(max_completion_tokens=9000), 400, "max_completion_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**30}, 400,
     "max_tokens"),
    ("/v1/chat/completions", _chat(stop=[f"s{i}" for i in range(9)]), 400, "stop"),
    ("/v1/chat/completions", _chat(stop=["x" * 2000]), 400, "stop"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": USER,
                      "stop_sequences": [f"s{i}" for i in range(9)]}, 400, None),
    ("/v1/chat/completions", _chat(n=5), 400, "n"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=6), 400, "top_logprobs"),
    ("/v1/chat/completions", _chat(messages=USER * 51), 400, "messages"),
    ("/v1/chat/completions",
     _chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(5)]),
     400, "tools"),
    ("/v1/chat/completions",
     _chat(tools=[{"type": "function", "function": {"name": "f", "description": "d" * 5000}}]),
     400, "tools"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 5, "max_tokens": 1}, 400, "prompt"),
    # text that is not text: a lone UTF-16 surrogate is valid JSON but cannot be encoded
    ("/v1/completions", {"model": MODEL, "prompt": "a\ud800", "max_tokens": 1}, 400, "prompt"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "\udfff"}]), 400,
     "messages"),
    ("/v1/chat/completions", _chat(stop=["ok", "\ud800"]), 400, "stop"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4,
                      "messages": [{"role": "user", "content": "\ud83d"}]}, 400, None),
    ("/tokenize", {"prompt": "\udc80"}, 400, "prompt"),
]  # fmt: skip


def _conn(srv) -> http.client.HTTPConnection:
    host, port = srv.url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=60)


def _post(conn, path: str, body, headers=A) -> tuple[int, dict]:
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json", **headers})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_bad_bodies_get_a_4xx_naming_the_field_on_a_connection_that_stays(guarded):
    conn = _conn(guarded)
    conn.connect()
    sock = conn.sock
    for path, body, status, field in BAD:
        got, err = _post(conn, path, body)
        assert got == status, (path, body, err)
        if field is not None:
            assert err["error"]["param"].split(".")[0] == field, (path, err)
        if "surrogate" in err["error"]["message"]:  # the field, down to the string
            assert "content" in err["error"]["message"] or field in err["error"]["message"]
        assert conn.sock is sock, f"{path} closed the connection"
    got, ok = _post(conn, "/v1/chat/completions", _chat(temperature=1e-45))  # greedy
    assert got == 200 and ok["choices"][0]["finish_reason"] == "length"
    assert conn.sock is sock
    guarded.engine.blocks.check()


def test_a_chunked_body_over_the_limit_gets_413(guarded):
    def chunks():
        for _ in range(64):
            yield b" " * 16384  # 1 MiB in all, sent without a Content-Length

    r = httpx.post(guarded.url + "/v1/completions", content=chunks(), headers=A, timeout=60)
    assert r.status_code == 413, r.text
    r = httpx.post(guarded.url + "/v1/messages", content=chunks(), headers=A, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_one_request_never_fails_another(guarded):
    """Eight streams run while other requests carry values that once made the engine step
    raise (and aborted every request in it): the eight finish, the others get 400s or
    (a temperature too small to divide by) greedy answers."""
    url = guarded.url + "/v1/chat/completions"
    innocent = _chat(max_tokens=24, temperature=0.7, seed=1, stream=True, ignore_eos=True)
    hostile = [
        _chat(temperature=1e-45, max_tokens=6),
        _chat(repetition_penalty=1e-45, max_tokens=6),
        _chat(n=2, seed=2**64 - 1, temperature=1.0, max_tokens=6),
        _chat(temperature=1e-45, repetition_penalty=1.2, max_tokens=6),
    ]

    async def stream(http):
        finishes = []
        async with http.stream("POST", url, json=innocent, headers=A) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    for c in chunk["choices"]:
                        if c["finish_reason"]:
                            finishes.append(c["finish_reason"])
        return finishes

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            streams = [asyncio.ensure_future(stream(http)) for _ in range(8)]
            await asyncio.sleep(0.5)
            others = [await http.post(url, json=b, headers=A) for b in hostile]
            return await asyncio.gather(*streams), others

    finishes, others = asyncio.run(main())
    assert finishes == [["length"]] * 8
    assert [r.status_code for r in others] == [200, 400, 400, 200]
    assert others[1].json()["error"]["param"] == "repetition_penalty"
    assert others[2].json()["error"]["param"] == "seed"
    assert guarded.engine.requests == {} and guarded.engine.blocks.usage == 0


def test_a_request_whose_sampling_fails_gets_a_500_and_the_others_finish(guarded, faults_here):
    url = guarded.url + "/v1/chat/completions"

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            bodies = [
                _chat(max_tokens=12, temperature=0.9, seed=s)
                for s in (1, 2, faults.SAMPLING_SEED, 3)
            ]
            claude = {
                "model": MODEL,
                "max_tokens": 8,
                "messages": USER,
                "seed": faults.SAMPLING_SEED,
            }
            calls = [http.post(url, json=b, headers=A) for b in bodies]
            calls.append(http.post(guarded.url + "/v1/messages", json=claude, headers=A))
            return await asyncio.gather(*calls)

    rs = asyncio.run(main())
    assert [r.status_code for r in rs] == [200, 200, 500, 200, 500]
    assert rs[2].json()["error"]["type"] == "server_error"
    assert "injected sampling fault" in rs[2].json()["error"]["message"]
    assert rs[4].json()["error"]["type"] == "api_error"
    assert guarded.engine.blocks.usage == 0


def test_api_keys_guard_every_endpoint_but_health_and_metrics(guarded):
    url = guarded.url
    for method, path, body in [
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/detokenize", {"tokens": [1, 2]}),
        ("GET", "/openapi.json", None),
        ("GET", "/v1/models", None),
        ("GET", "/tokenizer_info", None),
        ("POST", "/v1/embeddings", {"model": MODEL, "input": "hi"}),
        ("POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": USER}),
        ("POST", "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": USER}),
    ]:
        r = httpx.request(method, url + path, json=body)
        assert r.status_code == 401, (path, r.text)
        r = httpx.request(method, url + path, json=body, headers={"x-api-key": KEYS[1]})
        assert r.status_code == 200, (path, r.text)
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200


def test_the_openapi_schema_documents_the_errors(guarded):
    schema = httpx.get(guarded.url + "/openapi.json", headers=A).json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/tokenize"):
        codes = set(schema["paths"][path]["post"]["responses"])
        assert {"400", "401", "404", "413", "429", "504", "529"} <= codes, (path, codes)


def test_each_key_has_its_own_prefix_cache(guarded):
    """The same long prompt: a hit for the tenant that sent it before, a miss for another,
    so one tenant cannot learn from its time to first token what another has sent."""
    prompt = "A shared preamble about rivers and mills. " * 20

    def cached(headers) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        r = httpx.post(guarded.url + "/v1/completions", json=body, headers=headers, timeout=60)
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(A) == 0
    assert cached(A) > 100
    assert cached(B) == 0
    assert cached(B) > 100
