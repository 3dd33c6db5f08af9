"""How the server fails: bad input gets the documented 4xx (never a 500), a full queue gets
429 / 529 with Retry-After, a client that leaves frees its blocks, a deadline cancels, an
engine failure fails only the requests it touched, and the server keeps serving."""

from __future__ import annotations

import contextlib

import anthropic
import faults
import httpx
import openai
import pytest
from conftest import engine_idle, start_server, wait_for

MODEL = "smollm2-135m"
KEY = "test-key"
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}


def _tiny(loaded, engine_process: bool):
    """One running slot, one waiting slot, an API key and a 64 KiB body limit."""
    from tokenworks.serve.limits import ServerLimits

    return start_server(
        loaded,
        api_keys=(KEY,),
        limits=ServerLimits(max_body_mb=1 / 16),
        engine_process=engine_process,
        max_num_seqs=1,
        max_waiting=1,
    )


@pytest.fixture(scope="module", params=["process", "thread"])
def tiny_server(smol_loaded, request):
    """A tiny server on each transport, tests/faults.py's faults in its engine."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "thread":
            faults.install(patch.setattr)
        srv = _tiny(smol_loaded, engine_process=request.param == "process")
        yield srv
        srv.stop()


def _running_waiting(srv) -> tuple[int, int]:
    gauges = srv.state.engine.gauges
    return (gauges.running, gauges.waiting) if gauges else (0, 0)


@pytest.mark.parametrize(
    "path, body, status, field",
    [
        ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [', 400, "body"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -5},
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": "high"},
            400,
            "top_p",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
            400,
            "messages",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": [99999999]}, 400, "prompt"),
        ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "prompt_logprobs": 50},
            400,
            "prompt_logprobs",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}},
            400,
            "logit_bias",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "logit_bias": {"the": 1}},
            400,
            "logit_bias",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "logit_bias": {"99999999": 1}},
            400,
            "logit_bias",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}},
            400,
            "logit_bias",
        ),
        ("/v1/nothing", {}, 404, None),
    ],
)
def test_bad_input_gets_an_openai_4xx(smol_server, path, body, status, field):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(smol_server.url + path, headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if field is not None:
        assert err["param"] == field, err


def test_bad_input_gets_an_anthropic_4xx(smol_server):
    url = smol_server.url + "/v1/messages"
    r = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400
    assert r.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    r = httpx.post(
        url,
        json={"model": "claude-9", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(
        url,
        json={
            "model": MODEL,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        },
    )
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]


def test_api_key_and_body_limit(tiny_server):
    url = tiny_server.url + "/v1/completions"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert httpx.post(url, json=body).status_code == 401
    assert httpx.post(url, json=body, headers={"authorization": "Bearer nope"}).status_code == 401
    assert httpx.post(url, json=body, headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.post(url, json=body, headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(tiny_server.url + "/health").status_code == 200  # open, like vLLM
    big = {**body, "prompt": "word " * 20_000}
    r = httpx.post(url, json=big, headers={"x-api-key": KEY})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = httpx.post(tiny_server.url + "/v1/messages", json=big, headers={"x-api-key": KEY})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_disconnect_frees_blocks_within_a_step(smol_server):
    core = smol_server.state.engine  # the engine core process's client
    body = {"model": MODEL, "prompt": "Count:", "stream": True, **LONG, "max_tokens": 2000}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", smol_server.url + "/v1/completions", json=body) as r:
            got = []
            for line in r.iter_lines():
                if line.startswith("data:"):
                    got.append(line)
                if len(got) == 3:
                    break
            assert core.gauges.running == 1 and core.gauges.kv_usage > 0
            tokens_at_close = core.gauges.generation_tokens
    wait_for(lambda: engine_idle(smol_server))
    # the abort is applied before the next step: at most the steps under way finish (the
    # one the core is in, and one more the API process had not heard of)
    assert core.gauges.generation_tokens - tokens_at_close <= 3


def test_deadline_cancels(smol_server):
    client = openai.OpenAI(
        base_url=smol_server.url + "/v1", api_key="x", max_retries=0, timeout=120
    )
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(
            model=MODEL, prompt="Go:", extra_body={"deadline": 0.3, **LONG}, max_tokens=400
        )
    assert e.value.status_code == 504 and "deadline" in e.value.message
    wait_for(lambda: engine_idle(smol_server))


def test_overload_gives_429_and_529_and_the_server_carries_on(tiny_server):
    oai = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=tiny_server.url, api_key=KEY, max_retries=0, timeout=120)
    body = {"model": MODEL, "prompt": "Go:", "stream": True, **LONG}
    headers = {"x-api-key": KEY}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", tiny_server.url + "/v1/completions", json=body, headers=headers):
            wait_for(lambda: _running_waiting(tiny_server) == (1, 0))
            with http.stream(
                "POST", tiny_server.url + "/v1/completions", json=body, headers=headers
            ):
                wait_for(lambda: _running_waiting(tiny_server) == (1, 1))
                with pytest.raises(openai.RateLimitError) as e:
                    oai.completions.create(model=MODEL, prompt="x", max_tokens=2)
                assert e.value.response.headers["retry-after"] == "1"
                assert "queue is full" in e.value.message
                with pytest.raises(anthropic.APIStatusError) as e:
                    claude.messages.create(
                        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
                    )
                assert e.value.status_code == 529
                assert e.value.body["error"]["type"] == "overloaded_error"
    wait_for(lambda: engine_idle(tiny_server))
    r = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_two_replicas_refuse_when_both_are_full_cancel_and_label_their_metrics(smol_loaded):
    """Behind a router, a request whose replica's queue is full goes to another, 429/529
    come only once every replica's is, a client that leaves and a deadline free their
    replica's blocks, and /metrics gives each replica's series its own engine label."""
    from prometheus_client.parser import text_string_to_metric_families

    srv = start_server(smol_loaded, api_keys=(KEY,), replicas=2, router="least_loaded",
                       threads=1, max_num_seqs=1, max_waiting=1, warmup=False)  # fmt: skip
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=120)
    cores = srv.state.engine.replicas
    body = {"model": MODEL, "prompt": "Go:", "stream": True, **LONG}
    headers = {"x-api-key": KEY}
    router = srv.state.engine
    try:
        with contextlib.ExitStack() as streams, httpx.Client(timeout=60) as http:
            router.pick = lambda *_: 0  # a policy that always picks replica 0
            for _ in range(4):  # two fill replica 0 (one running, one waiting), two overflow
                streams.enter_context(
                    http.stream("POST", srv.url + "/v1/completions", json=body, headers=headers)
                )
            del router.pick
            assert router.routed == [2, 2]
            wait_for(lambda: all(c.gauges and (c.gauges.running, c.gauges.waiting) == (1, 1)
                                 for c in cores))  # fmt: skip
            with pytest.raises(openai.RateLimitError) as e:
                oai.completions.create(model=MODEL, prompt="x", max_tokens=2)
            assert e.value.response.headers["retry-after"] == "1"
            with pytest.raises(anthropic.APIStatusError) as e:
                claude.messages.create(
                    model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
                )
            assert e.value.status_code == 529
        wait_for(lambda: engine_idle(srv))  # the four left: both replicas free their blocks
        with pytest.raises(openai.APIStatusError) as e:
            oai.completions.create(
                model=MODEL, prompt="Go:", extra_body={"deadline": 0.3, **LONG}, max_tokens=400
            )
        assert e.value.status_code == 504
        wait_for(lambda: engine_idle(srv))
        router.policy = "round_robin"
        for _ in range(2):
            r = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
            assert r.usage.completion_tokens == 3
        text = httpx.get(srv.url + "/metrics", headers=headers).text
    finally:
        srv.stop()
    tokens = {
        s.labels["engine"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "tokenworks:generation_tokens_total"
    }
    assert tokens == {"0": 3, "1": 3}  # only finished requests count: one each


@pytest.mark.parametrize(
    "seed, fault",
    [(faults.FORWARD_SEED, "forward"), (faults.SCHEDULE_SEED, "scheduling"),
     (faults.SAMPLING_SEED, "sampling")],
)  # fmt: skip
def test_engine_failure_fails_its_requests_only(tiny_server, seed, fault):
    """A forward pass, scheduling or sampling that raises fails the request it touched with a
    500 that says why, and the next request is served."""
    oai = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    with pytest.raises(openai.InternalServerError) as e:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=3, seed=seed)
    assert f"injected {fault} fault" in e.value.message
    r = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    assert httpx.get(tiny_server.url + "/health").json() == {"status": "ok"}
    wait_for(lambda: engine_idle(tiny_server))


def _wait_up(proc, url: str) -> None:
    """Until a `tokenworks serve` subprocess answers /health (its output if it dies)."""

    def up():
        assert proc.poll() is None, proc.stdout.read()
        try:
            return httpx.get(url + "/health").status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, timeout=120)


def test_the_serve_command(smol_loaded):
    """`tokenworks serve` as a user runs it: its own process, 127.0.0.1, an API key."""
    import subprocess
    import sys

    from tokenworks.serve.server import _free_port

    port = _free_port("127.0.0.1")
    cmd = [
        sys.executable,
        "-m",
        "tokenworks.cli",
        "serve",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--max-num-seqs",
        "2",
        "--kv-cache-memory",
        "0.05",
        "--api-key",
        KEY,
        "--served-model-name",
        "smol",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        _wait_up(proc, url)
        oai = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        r = oai.completions.create(model="smol", prompt="Hello", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _tree_pss(pid: int) -> int:
    """Proportional resident bytes of a process and all its descendants (pages they share,
    such as torch's libraries, counted once between them)."""
    rollup = open(f"/proc/{pid}/smaps_rollup").read()
    pss = int(next(x for x in rollup.splitlines() if x.startswith("Pss:")).split()[1]) * 1024
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return pss + sum(_tree_pss(int(child)) for child in f.read().split())


def test_the_default_server_idles_under_1_2_gb_and_says_what_it_runs(smol_loaded):
    """`tokenworks serve` with its defaults (bfloat16, the KV pool sized by default, the
    engine in a core process) and --max-waiting 0: it starts, logs what it loads, holds
    under 1.2 GB idle with its core (the 4 GiB pool's pages are taken only as they are
    written; each process has its own torch) and serves."""
    import subprocess
    import sys

    from tokenworks.serve.server import _free_port

    port = _free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "tokenworks.cli", "serve", "--port", str(port),
           "--max-waiting", "0", "--api-key", KEY, "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        _wait_up(proc, url)
        pss = _tree_pss(proc.pid)  # the server process and its engine core
        assert pss < 1.2e9, f"idle {pss / 1e6:.0f} MB"
        oai = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        r = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
        assert httpx.post(url + "/tokenize", json={"prompt": "hi"}).status_code == 401
    finally:
        proc.terminate()
        log = proc.communicate(timeout=30)[0]
    for said in ("model smollm2-135m", "dtype bfloat16", "kernels:", "KV ", "context 8192",
                 "threads", "warm-up", "ready"):  # fmt: skip
        assert said in log, (said, log)
