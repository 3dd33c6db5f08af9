"""tokenworks as a Ray Serve application (serve/ray_serve.py), started with `serve run` on a
local Ray cluster: the SDK gets `tokenworks serve`'s answers, a prompt goes to the
replica whose prefix cache holds its prefix (as its KV events say), /metrics counts what
the replicas generated, and the application's options are checked before anything
starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray
from ray import serve

from tokenworks.bench.peer_engines import free_port
from tokenworks.serve.ray_serve import RayServeOptions, engine_options, options_of

ENGINE = {  # as conftest's smol_core_server runs it, each replica on one of the two CPUs
    "model": "smollm2-135m", "dtype": "float32", "threads": "2", "max_num_seqs": "8",
    "kv_cache_memory": "0.25", "replica_cpus": "1",
}  # fmt: skip


@pytest.fixture(scope="module")
def ray_app():
    """Two engine replicas and the API replica, deployed by `serve run` onto a local
    cluster whose HTTP proxy listens on a free port of 127.0.0.1."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    pairs = [f"{k}={v}" for k, v in (ENGINE | {"min_replicas": 2, "max_replicas": 2}).items()]
    command = [str(Path(sys.executable).parent / "serve"), "run", "--non-blocking",
               "--address", ray.get_runtime_context().gcs_address, "--name", "tokenworks",
               "--route-prefix", "/", "tokenworks.serve.ray_serve:application", *pairs]  # fmt: skip
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    subprocess.run(command, check=True, env=env, timeout=600)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while not _healthy(url):
        assert time.monotonic() < deadline, "the application did not come up"
        time.sleep(0.5)
    yield url
    serve.shutdown()
    ray.shutdown()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_the_sdk_gets_what_tokenworks_serve_answers(ray_app, smol_core_server):
    ask = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Name a colour."}],
           "max_tokens": 12, "temperature": 0}  # fmt: skip
    expected = _client(smol_core_server.url).chat.completions.create(**ask)
    got = _client(ray_app).chat.completions.create(**ask)
    assert got.choices[0].message.content == expected.choices[0].message.content
    assert got.usage.completion_tokens == expected.usage.completion_tokens
    chunks = _client(ray_app).chat.completions.create(**ask, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected.choices[0].message.content


def test_a_repeated_prefix_goes_to_the_replica_that_holds_it(ray_app):
    """Six new prefixes, each then extended: each extension finds its prefix cached. With
    two replicas chosen at random, all six would come back cached one time in 64."""
    client = _client(ray_app)
    filler = " ".join(f"w{i}" for i in range(120))
    for topic in range(6):
        prompt = f"Topic {topic}: {filler}"
        first = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=2,
                                          temperature=0)  # fmt: skip
        again = client.completions.create(model="smollm2-135m", prompt=prompt + " and then",
                                          max_tokens=2, temperature=0)  # fmt: skip
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens - 16, (topic, cached)


def test_metrics_count_what_the_replicas_generated(ray_app):
    def generated() -> float:
        text = httpx.get(ray_app + "/metrics").text
        line = next(x for x in text.splitlines()
                    if x.startswith("tokenworks:generation_tokens_total"))  # fmt: skip
        return float(line.split()[-1])

    before = generated()
    answer = _client(ray_app).completions.create(
        model="smollm2-135m", prompt="Once upon a time", max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert answer.usage.completion_tokens == 5
    assert generated() - before == 5


def test_a_prompt_too_long_is_refused_as_tokenworks_serve_refuses_it(ray_app):
    with pytest.raises(openai.BadRequestError, match="prompt"):
        _client(ray_app).completions.create(
            model="smollm2-135m", prompt="word " * 20_000, max_tokens=2
        )


def test_the_options_are_checked_before_anything_starts():
    for bad, says in [
        ({"port": "9000"}, "Ray Serve's HTTP proxy"),
        ({"data_parallel_size": "2"}, "min_replicas"),
        ({"min_replicas": "3", "max_replicas": "2"}, "min_replicas <= max_replicas"),
        ({"colour": "red"}, "not an option"),
        ({"enable_prefix_caching": "false"}, "power_of_two"),
        ({"enable_prefix_caching": "maybe"}, "true or false"),
    ]:
        with pytest.raises(ValueError, match=says):
            options_of(bad)


def test_the_engine_deployment_scales_between_the_bounds():
    config, options, _, _ = options_of({"max_num_seqs": "4"})
    scaled = engine_options(config, options, RayServeOptions(min_replicas=1, max_replicas=3))
    assert scaled["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8.0,
    }  # fmt: skip
    assert scaled["max_ongoing_requests"] == 8  # twice max_num_seqs
    assert "num_replicas" not in scaled
    assert scaled["request_router_config"].request_router_class.endswith("KVEventsRouter")
    fixed = engine_options(
        config, options, RayServeOptions(min_replicas=2, max_replicas=2,
                                         request_router="power_of_two"),
    )  # fmt: skip
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert "request_router_config" not in fixed
