"""The server under generated input: schemathesis against its own /openapi.json, and
hypothesis posting random JSON (and random values under the real field names) to every
endpoint. Whatever arrives, the answer is a 2xx or a 4xx, never a 5xx, and the connection
it came on still serves the next request. The model's context is short so that the bodies
that are valid finish quickly."""

from __future__ import annotations

import http.client
import json

import pytest
import schemathesis
from conftest import start_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "smollm2-135m"
POSTS = [
    "/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/embeddings", "/v1/responses", "/tokenize", "/detokenize",
]  # fmt: skip
GETS = ["/v1/models", "/v1/models/" + MODEL, "/health", "/metrics", "/tokenizer_info"]


@pytest.fixture(scope="module")
def fuzz_server(smol_loaded):
    srv = start_server(  # hostile input crosses to the engine core process too
        smol_loaded, dtype="bfloat16", max_model_len=96, max_num_seqs=4, warmup=False,
        engine_process=True,
    )  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


def _server_error(status: int, body: bytes) -> bool:
    """A 5xx, but for the 504 of a request whose own deadline passed (a client may ask
    for 1e-300 seconds)."""
    return status >= 500 and not (status == 504 and b"deadline_exceeded" in body)


@schemathesis.check
def no_server_error(ctx, response, case):
    if _server_error(response.status_code, response.content):
        raise AssertionError(f"{response.status_code}: {response.content[:500]!r}")


def test_schemathesis_finds_no_server_error(api_schema):
    """Cases schemathesis generates from each operation of the schema (bounded: 30 an
    operation, the same on every run)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 15
    for operation in operations:

        @settings(
            max_examples=30,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        @given(case=operation.as_strategy())
        def call(case):
            case.call_and_validate(checks=[no_server_error])

        call()


# JSON of any shape, and bodies with the endpoints' own field names holding any JSON; its
# strings may hold lone UTF-16 surrogates (valid JSON, "\ud800", but not text)
TEXT = st.text(st.characters(exclude_categories=()), max_size=20)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "n", "stream", "stream_options", "stop", "stop_sequences",
    "seed", "logprobs", "top_logprobs", "tools", "tool_choice", "response_format",
    "chat_template_kwargs", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "repetition_penalty", "presence_penalty", "frequency_penalty", "system",
    "echo", "tokens", "deadline", "priority", "cache_salt", "stop_token_ids", "ignore_eos",
    "add_generation_prompt", "best_of", "suffix", "metadata", "output_format",
    "prompt_logprobs", "logit_bias", "parallel_tool_calls", "input", "encoding_format",
    "dimensions", "reasoning_effort", "max_reasoning_tokens", "thinking", "instructions",
    "previous_response_id", "text", "max_output_tokens", "store", "reasoning",
]  # fmt: skip
SMALL_INT = st.integers(-3, 40) | st.sampled_from([10**30, -(2**63), 2**64])
USER = [{"role": "user", "content": "hi"}]
VALUE = JSON | SMALL_INT | st.just(MODEL) | st.just(USER)
# a valid body of each endpoint, with up to three fields set to anything
VALID = {
    "/v1/completions": {"model": MODEL, "prompt": "Once upon", "max_tokens": 4},
    "/v1/chat/completions": {"model": MODEL, "messages": USER, "max_tokens": 4},
    "/v1/messages": {"model": MODEL, "messages": USER, "max_tokens": 4},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": USER},
    "/v1/embeddings": {"model": MODEL, "input": "Once upon"},
    "/v1/responses": {"model": MODEL, "input": "Once upon", "max_output_tokens": 4},
    "/tokenize": {"prompt": "Once upon"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
OVERRIDES = st.dictionaries(st.sampled_from(FIELDS), VALUE, max_size=3)


def _body(path: str):
    return JSON | OVERRIDES.map(lambda d: {**VALID[path], **d})


def _conn(srv) -> http.client.HTTPConnection:
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.connect()
    return conn


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_random_bodies_get_2xx_or_4xx_and_the_connection_stays(fuzz_server, data):
    path = data.draw(st.sampled_from(POSTS))
    body = data.draw(_body(path))
    conn = _conn(fuzz_server)
    sock = conn.sock
    try:
        payload = json.dumps(body)
        conn.request("POST", path, payload, {"content-type": "application/json"})
        r = conn.getresponse()
        text = r.read()
        assert not _server_error(r.status, text), (path, payload, text)
        for get in GETS:  # the same connection answers the next request
            conn.request("GET", get)
            again = conn.getresponse()
            again.read()
            assert again.status == 200 and conn.sock is sock, (path, payload, get)
    finally:
        conn.close()
    assert fuzz_server.state.engine.is_running
