"""The OpenAI API of a real server on 127.0.0.1, driven by the official `openai` SDK."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m"
HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(
        base_url=smol_server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )


def prompt_count(srv, messages) -> int:
    tok = srv.engine.tokenizer
    return len(tok.encode(tok.apply_chat_template(messages)))


def test_models_health_and_tokenize(smol_server, client):
    assert [m.id for m in client.models.list().data] == ["smollm2-135m", "smol"]
    assert client.models.retrieve("smol").id == "smol"
    assert httpx.get(smol_server.url + "/health").json() == {"status": "ok"}
    r = httpx.post(smol_server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == smol_server.engine.tokenizer.encode("Hello world")
    r = httpx.post(smol_server.url + "/tokenize", json={"messages": HELLO}).json()
    assert r["count"] == prompt_count(smol_server, HELLO)
    text = httpx.post(smol_server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert "Write one sentence about the sea." in text["prompt"]
    info = httpx.get(smol_server.url + "/tokenizer_info").json()
    tok = smol_server.engine.tokenizer
    assert tok.encode(info["eos_token"], add_special_tokens=False) == [tok.eos_token_ids[0]]
    assert info["chat_template"] == tok.chat.source


def test_chat_usage_counts_and_logprobs(smol_server, client):
    r = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = r.choices[0]
    assert r.usage.prompt_tokens == prompt_count(smol_server, HELLO)
    assert r.usage.completion_tokens == len(choice.logprobs.content) == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert choice.finish_reason == "length"
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    for t in choice.logprobs.content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
    # greedy: the chosen token is the most likely one
    assert all(t.token == t.top_logprobs[0].token for t in choice.logprobs.content)


def test_chat_stream_equals_non_stream_for_a_seed(client):
    kw = dict(model=MODEL, messages=HELLO, max_tokens=24, temperature=0.9, seed=7)
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        full.choices[0].finish_reason
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        full.usage.completion_tokens
    )
    assert chunks[0].choices[0].delta.role == "assistant"


def test_chat_n_stop_and_penalties(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=20,
        temperature=0.8,
        seed=3,
        n=3,
        stop=["."],
        presence_penalty=0.5,
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert "." not in c.message.content
        assert c.finish_reason in ("stop", "length")


REPEATS = "The sea, the sea, the sea"


def _tokens(client, **kw):
    """(token ids, [(token id, logprob, {top id: logprob})] per step) of one completion."""
    r = client.completions.create(
        model=MODEL, prompt=REPEATS, max_tokens=24, logprobs=5,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True, **kw.pop("extra", {})},
        **kw,
    )  # fmt: skip
    lp = r.choices[0].logprobs
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    tops = [{int(k.removeprefix("token_id:")): v for k, v in d.items()} for d in lp.top_logprobs]
    return ids, list(zip(ids, lp.token_logprobs, tops, strict=True))


def test_presence_and_frequency_penalties_choose_what_the_sampler_defines(client):
    """Greedy with penalties picks, at each step, the token whose raw logprob minus its
    penalty (presence: once if already generated; frequency: per time generated) is the
    largest: checked against every candidate the server reports, and different from the
    plain greedy choice where the penalty bites."""
    plain, _ = _tokens(client, temperature=0)
    ids, steps = _tokens(client, temperature=0, presence_penalty=1.5, frequency_penalty=0.7)

    def score(token, logprob, before):
        n = before.count(token)
        return logprob - 1.5 * (n > 0) - 0.7 * n

    for t, (chosen, logprob, top) in enumerate(steps):
        best = score(chosen, logprob, ids[:t])
        for cand, cand_lp in top.items():
            assert best >= score(cand, cand_lp, ids[:t]) - 1e-3, (t, chosen, cand)
    assert ids != plain  # a prompt of repeats: the penalties change the greedy path


def test_top_k_min_p_and_repetition_penalty_have_their_effect(smol_server, client):
    """top_k=1 and min_p=1 keep only the most likely token: a hot sampler then gives the
    greedy tokens; without them it does not. A repetition penalty repeats fewer of the
    prompt's and its own tokens than plain greedy does."""
    greedy, _ = _tokens(client, temperature=0)
    hot = dict(temperature=1.5, seed=11)
    assert _tokens(client, **hot, extra={"top_k": 1})[0] == greedy
    assert _tokens(client, **hot, extra={"min_p": 1.0})[0] == greedy
    assert _tokens(client, **hot)[0] != greedy
    penalised, _ = _tokens(client, temperature=0, extra={"repetition_penalty": 1.8})
    prompt_ids = set(smol_server.engine.tokenizer.encode(REPEATS))

    def repeats(ids):
        return sum(t in prompt_ids or t in ids[:i] for i, t in enumerate(ids))

    assert penalised != greedy
    assert repeats(penalised) < repeats(greedy)


def test_logit_bias_steers_the_choice_and_leaves_logprobs_raw(client):
    """A bias of -100 on each greedy token turns greedy elsewhere at that step; +100 on one
    token makes it every choice, its logprob still the model's own (below 0)."""
    greedy, steps = _tokens(client, temperature=0)
    banned, _ = _tokens(client, temperature=0, logit_bias={str(greedy[0]): -100})
    assert banned[0] != greedy[0]
    forced, steps = _tokens(client, temperature=0, logit_bias={"42": 100})
    assert forced == [42] * len(forced)
    assert all(lp < -1e-3 for _, lp, _ in steps[:3])
    sampled, _ = _tokens(client, temperature=1.0, seed=3, logit_bias={"42": 100})
    assert sampled == forced  # +100 leaves every other token a probability near 0


def test_completions_stream_and_echo(smol_server, client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=0)
    full = client.completions.create(**kw, logprobs=2)
    assert full.usage.prompt_tokens == len(smol_server.engine.tokenizer.encode(kw["prompt"]))
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == full.usage.completion_tokens == 10
    assert "".join(lp.tokens) == full.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(d) == 2 for d in lp.top_logprobs)
    text = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert text == full.choices[0].text
    echoed = client.completions.create(**kw, echo=True)
    assert echoed.choices[0].text == kw["prompt"] + full.choices[0].text


def test_completions_many_prompts_and_token_ids(client):
    r = client.completions.create(
        model="smol", prompt=["One, two,", "A, B,"], max_tokens=4, temperature=0, n=2
    )
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: both completions agree
    ids = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_ignore_eos_runs_to_max_tokens(client):
    r = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 30 and r.choices[0].finish_reason == "length"


def test_metrics_parse_and_move(smol_server, client):
    def scrape() -> dict:
        text = httpx.get(smol_server.url + "/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                label = next((s.labels[k] for k in ("finished_reason", "phase", "reason")
                              if k in s.labels), "")  # fmt: skip
                key = s.name + "{" + label + "}"
                samples[key] = samples.get(key, 0) + s.value
        return samples

    before = scrape()
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0)
    after = scrape()
    assert after["tokenworks:request_success_total{length}"] == (
        before.get("tokenworks:request_success_total{length}", 0) + 1
    )
    assert after["tokenworks:generation_tokens_total{}"] == (
        before["tokenworks:generation_tokens_total{}"] + 5
    )
    assert after["tokenworks:prompt_tokens_total{}"] > before["tokenworks:prompt_tokens_total{}"]
    assert after["tokenworks:e2e_request_latency_seconds_count{}"] == (
        before["tokenworks:e2e_request_latency_seconds_count{}"] + 1
    )
    for name in (
        "tokenworks:time_to_first_token_seconds_count{}",
        "tokenworks:inter_token_latency_seconds_count{}",
        "tokenworks:request_time_per_output_token_seconds_count{}",
        "tokenworks:request_queue_time_seconds_count{}",
        "tokenworks:prefix_cache_queries_total{}",
        "tokenworks:prefix_cache_hits_total{}",
        "tokenworks:num_preemptions_total{}",
    ):
        assert name in after
    assert after["tokenworks:time_to_first_token_seconds_count{}"] > 0
    assert after["tokenworks:prefix_cache_hits_total{}"] > 0  # HELLO's prompt came again
    for phase in ("parse", "template", "tokenize", "detokenize", "respond"):
        assert after[f"tokenworks:api_process_seconds_count{{{phase}}}"] == (
            before.get(f"tokenworks:api_process_seconds_count{{{phase}}}", 0) + 1
        )
    assert after["tokenworks:num_requests_running{}"] == 0
    assert after["tokenworks:kv_cache_usage_perc{}"] == 0
    # the same prompt once more: every full block is found, the first missing is partial
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, temperature=0)
    again = scrape()
    key = "tokenworks:prefix_cache_misses_total{not_full}"
    assert again[key] == after.get(key, 0) + 1


def test_metrics_prefix_gives_vllms_own_names():
    """--metrics-prefix vllm: every series under vLLM's names (what its dashboards read);
    a prefix that is not a metric name is refused."""
    from tokenworks.serve.metrics import ServerMetrics
    from tokenworks.serve.serve_config import ServeConfig

    ours = ServerMetrics(MODEL).render().decode()
    theirs = ServerMetrics(MODEL, ServeConfig(metrics_prefix="vllm").metrics_prefix)
    names = {f.name for f in text_string_to_metric_families(theirs.render().decode())}
    assert "vllm:num_requests_running" in names and "vllm:time_to_first_token_seconds" in names
    assert all(n.startswith("vllm:") for n in names)
    assert len(names) == len({f.name for f in text_string_to_metric_families(ours)})
    with pytest.raises(ValueError, match="metrics-prefix"):
        ServeConfig(metrics_prefix="vllm:")
