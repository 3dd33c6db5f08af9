"""The engine core in its own process (engine/core.py) behind CoreClient: the same tokens
as the engine in-process, refusals raised by name, cancellation, and a core that dies
failing its requests at once instead of hanging them."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from conftest import tokens_through

from tokenworks.front.interface import Submission

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from tokenworks import LLM  # noqa: E402
from tokenworks.config import EngineConfig  # noqa: E402
from tokenworks.engine.admission import PromptTooLongError  # noqa: E402
from tokenworks.engine.messages import EngineCoreDiedError, RequestFailedError  # noqa: E402
from tokenworks.engine.request import SamplingParams  # noqa: E402
from tokenworks.front.core_client import CoreClient  # noqa: E402

CONFIG = EngineConfig(model="toy", warmup=False, max_num_seqs=8)
PROMPTS = [[5, 6, 7], [9] * 20, list(range(3, 40))]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


async def _collect(client, prompt, params=GREEDY):
    tokens = []
    async for update in client.generate(Submission(params, prompt)):
        tokens += update.deltas[0].token_ids
    return tokens


@pytest.fixture(scope="module")
def client():
    c = CoreClient(CONFIG, startup_timeout_s=120)
    c.start()
    yield c
    c.shutdown()


def test_the_core_gives_the_in_process_engines_tokens(client):
    llm = LLM("toy", warmup=False, max_num_seqs=8)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]

    async def run():
        return await asyncio.gather(*(_collect(client, p) for p in PROMPTS))

    assert asyncio.run(run()) == expected
    assert client.ready.pid != os.getpid() and client.ready.vocab_size == llm.engine.spec.vocab_size


async def _completions(client, prompt, params):
    """Each completion's text, tokens, logprobs and finish as the API process assembles
    them from the core's token-only updates."""
    out = {}
    async for update in client.generate(Submission(params, prompt)):
        out["id"] = update.request_id
        for d in update.deltas:
            c = out.setdefault(d.index, {"text": "", "ids": [], "logprobs": [], "end": None})
            c["text"] += d.text
            c["ids"] += d.token_ids
            c["logprobs"] += d.logprobs or []
            c["end"] = (d.finish_reason, d.stop_reason) if d.finish_reason else c["end"]
    request_id = out.pop("id")
    return request_id, [out[i] for i in sorted(out)]


class _Heard:
    """An observer (as serve/metrics.py's) keeping the timings of finished requests."""

    def __init__(self):
        self.finished = {}

    def on_inter_token(self, seconds):
        pass

    def on_step(self, preemptions, gauges):
        pass

    def on_request_finished(self, metrics):
        self.finished[metrics.request_id] = metrics


def test_the_api_process_detokenises_and_stop_strings_stop_the_core(client):
    llm = LLM("toy", warmup=False, max_num_seqs=8)
    prompt = PROMPTS[2]
    free = SamplingParams(max_tokens=40, temperature=1.0, seed=7, n=2, ignore_eos=True)
    text = llm.generate([prompt], free, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # met halfway through completion 0
    cases = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=7, n=2, ignore_eos=True,
                       stop=[stop], logprobs=2),
        SamplingParams(max_tokens=40, temperature=1.0, seed=7, n=2, ignore_eos=True,
                       stop=[stop], include_stop_str_in_output=True),
    ]  # fmt: skip
    heard = _Heard()
    client.configure(heard)
    for params in cases:
        expected = llm.generate([prompt], params, use_tqdm=False)[0].outputs
        request_id, got = asyncio.run(_completions(client, prompt, params))
        assert [c["text"] for c in got] == [o.text for o in expected]
        assert [c["ids"] for c in got] == [o.token_ids for o in expected]
        assert [c["end"] for c in got] == [(o.finish_reason, o.stop_reason) for o in expected]
        if params.logprobs:
            assert [c["logprobs"] for c in got] == [o.logprobs for o in expected]
        assert got[0]["end"] == ("stop", stop) and len(got[0]["ids"]) < 40
        # the request's timings count the tokens handed out, and how each completion ended
        deadline = time.monotonic() + 5
        while request_id not in heard.finished:
            assert time.monotonic() < deadline, "the core did not finish the request"
            time.sleep(0.02)
        timings = heard.finished[request_id]  # however far the core ran before it heard
        assert timings.generation_tokens == sum(len(c["ids"]) for c in got)
        assert timings.finish_reasons == [str(o.finish_reason) for o in expected]
    client.configure()


def test_a_refusal_is_raised_by_name_and_the_core_carries_on(client):
    async def run():
        too_long = [3] * (client.ready.max_model_len + 1)
        with pytest.raises(PromptTooLongError, match="context"):
            await client.submit(Submission(GREEDY, too_long))
        return await _collect(client, PROMPTS[0])

    assert len(asyncio.run(run())) == GREEDY.max_tokens


def test_a_command_the_core_cannot_read_is_refused_by_its_id(client):
    import msgspec

    from tokenworks.engine.detokenizer import RequestText
    from tokenworks.front.streams import Stream, next_item

    async def run():
        text = RequestText(GREEDY, client.engine.tokenizer, [])
        stream = Stream("bad-1", asyncio.get_running_loop(), asyncio.Queue(), text)
        client._streams["bad-1"] = stream
        bad = {"type": "AddRequest", "request_id": "bad-1", "prompt_token_ids": "x", "params": {}}
        with client._lock:
            client._commands.send(msgspec.msgpack.encode(bad))
        refused = await next_item(stream.queue, None)
        assert isinstance(refused, ValueError) and "invalid" in str(refused)
        return await _collect(client, PROMPTS[0])

    assert len(asyncio.run(run())) == GREEDY.max_tokens


def test_leaving_a_stream_early_cancels_its_request(client):
    async def run():
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        async for _update in client.generate(Submission(long, PROMPTS[1])):
            break  # generate()'s finally aborts it
        return await _collect(client, PROMPTS[2])

    assert len(asyncio.run(run())) == GREEDY.max_tokens
    assert not client._streams


def test_a_core_that_dies_fails_its_requests_within_two_seconds():
    c = CoreClient(CONFIG, startup_timeout_s=120)
    c.start()
    try:

        async def run():
            long = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
            stream = await c.submit(Submission(long, PROMPTS[0]))
            await stream.__anext__()
            os.kill(c.ready.pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(RequestFailedError, match="exited"):
                async for _ in stream:
                    pass
            return time.monotonic() - t0

        assert asyncio.run(run()) < 2.0
        assert not c.is_running
        with pytest.raises(RuntimeError, match="not running"):
            asyncio.run(c.submit(Submission(GREEDY, PROMPTS[0])))
    finally:
        c.shutdown()


def test_a_core_that_cannot_start_says_so():
    with pytest.raises(EngineCoreDiedError, match="before it was ready"):
        CoreClient(EngineConfig(model="/nonexistent/model.gguf"), startup_timeout_s=60).start()


def test_the_server_serves_through_a_core_process_and_says_when_it_died():
    """tokenworks serve --engine-process: the official client gets the in-process tokens,
    streamed or not, refusals are 400s from the API process's own admission, and once the
    core is killed /health says so and a request is a prompt 503, not a hang."""
    import httpx
    import openai

    from tokenworks.serve.app import build_app
    from tokenworks.serve.server import ServerThread, make_state

    c = CoreClient(CONFIG, startup_timeout_s=120)
    c.start()
    srv = ServerThread(build_app(make_state(c, ["toy"]))).start()
    assert c.observer is not None
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        ask = dict(model="toy", prompt="hello there", max_tokens=10, temperature=0)
        llm = LLM("toy", warmup=False, max_num_seqs=8)
        params = SamplingParams(max_tokens=10, temperature=0)
        expected = llm.generate(["hello there"], params, use_tqdm=False)[0].outputs[0].text
        assert client.completions.create(**ask).choices[0].text == expected
        streamed = client.completions.create(**ask, stream=True)
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == expected
        with pytest.raises(openai.BadRequestError, match="context"):
            client.completions.create(**ask | {"max_tokens": 10_000})
        metrics = {  # the core's steps and finished requests reach /metrics
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in httpx.get(srv.url + "/metrics").text.splitlines()
            if line.startswith("tokenworks:") and "{" in line
        }
        assert metrics["tokenworks:generation_tokens_total"] == 20
        assert metrics["tokenworks:prefix_cache_queries_total"] > 0
        assert metrics["tokenworks:inter_token_latency_seconds_count"] >= 18
        assert httpx.get(srv.url + "/health").status_code == 200
        os.kill(c.ready.pid, signal.SIGKILL)
        time.sleep(0.5)
        assert httpx.get(srv.url + "/health").status_code == 503
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(**ask)
        assert failed.value.status_code == 503 and time.monotonic() - t0 < 2
    finally:
        srv.stop()


def test_a_reader_that_falls_behind_is_cancelled_as_in_process():
    from tokenworks.engine.messages import ReaderTooSlowError

    c = CoreClient(CONFIG, startup_timeout_s=120, max_backlog=5)
    c.start()
    try:

        async def run():
            long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
            stream = await c.submit(Submission(long, PROMPTS[0]))
            await asyncio.sleep(1.0)  # read nothing while the core runs ahead
            with pytest.raises(ReaderTooSlowError, match="at most 5"):
                async for _ in stream:
                    pass

        asyncio.run(run())
        assert not c._streams
    finally:
        c.shutdown()


def test_with_restart_a_new_core_serves_after_one_dies():
    c = CoreClient(CONFIG, startup_timeout_s=120, restart=True)
    c.start()
    try:
        first = c.ready.pid
        os.kill(first, signal.SIGKILL)
        t0 = time.monotonic()
        while not (c.is_running and c.ready.pid != first) and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        assert c.restarts == 1 and c.ready.pid != first
        assert len(asyncio.run(_collect(c, PROMPTS[0]))) == GREEDY.max_tokens
    finally:
        c.shutdown()


def _children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    with open(path) as f:
        return [int(x) for x in f.read().split()]


def test_the_server_exits_non_zero_when_its_core_dies(tmp_path):
    """tokenworks serve without --restart-engine: a dead core stops the server with exit
    status 1 rather than leaving it up and useless."""
    import socket
    import subprocess
    import sys

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tokenworks.cli", "serve", "--model", "toy",
           "--no-warmup", "--port", str(port)]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 90:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        (core,) = _children(server.pid)
        os.kill(core, signal.SIGKILL)
        assert server.wait(timeout=15) == 1
    finally:
        server.kill()


def test_two_replicas_give_one_engines_tokens_and_prefix_routing_finds_the_cache():
    """Behind a router, every request's greedy tokens are a single engine's; on prompts
    sharing a 48-token prefix, routing by prefix finds more of them in the replicas' own
    prefix caches than round-robin does (each replica's own counters)."""
    from tokenworks.front.replicas import ReplicaRouter

    router = ReplicaRouter([CoreClient(CONFIG, startup_timeout_s=120) for _ in range(2)])
    router.start()
    try:
        got, expected = tokens_through(router, PROMPTS, GREEDY)
        assert got == expected
        assert min(router.routed) >= 1  # both replicas took work

        shared = list(range(10, 58))  # three 16-token blocks
        prompts = [shared + [100 + i, 101 + i, 102 + i] for i in range(8)]
        params = SamplingParams(max_tokens=2, temperature=0)

        def hits(policy: str) -> float:
            router.policy = policy
            before = [(r.gauges.prefix_hits, r.gauges.prefix_queried) for r in router.replicas]

            async def one_by_one():
                for p in prompts:  # one at a time: each finds what the last ones left
                    async for _ in router.generate(Submission(params, p, cache_salt=policy)):
                        pass

            asyncio.run(one_by_one())
            now = [(r.gauges.prefix_hits, r.gauges.prefix_queried) for r in router.replicas]
            hit = sum(n[0] - b[0] for n, b in zip(now, before, strict=True))
            asked = sum(n[1] - b[1] for n, b in zip(now, before, strict=True))
            return hit / asked

        assert hits("prefix") > hits("round_robin")
    finally:
        router.shutdown()
