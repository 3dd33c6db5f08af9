"""Prompt log-probabilities (SamplingParams.prompt_logprobs; /v1/completions with echo and
logprobs, and vLLM's prompt_logprobs): each prompt token's logprob given the tokens before
it, equal to transformers' on the same weights, whatever the chunking, the prefix cache or
the transport; max_tokens 0 scores a prompt without generating."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from tokenworks import LLM, SamplingParams

PROMPT = (
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy "
    "is Rome, and the capital of Spain is Madrid."
)


def oracle(hf, ids: list[int], top: int) -> list[tuple[float, list[int]]]:
    """transformers' logprob of each prompt token after the first, and its top ids."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    raw = logits.log_softmax(-1)
    return [
        (raw[i - 1, ids[i]].item(), torch.topk(raw[i - 1], top).indices.tolist())
        for i in range(1, len(ids))
    ]


def test_prompt_logprobs_equal_transformers(smol_llm, hf_smol):
    ids = smol_llm.tokenizer.encode(PROMPT)
    (out,) = smol_llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=3), False)
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for lp, token, (want, top) in zip(got[1:], ids[1:], oracle(hf_smol, ids, 3), strict=True):
        assert lp.token_id == token and abs(lp.logprob - want) < 1e-3
        assert [i for i, _, _ in lp.top] == top
        assert min(lp.rank, 4) == 1 + sum(v > lp.logprob for _, _, v in lp.top)
        assert lp.token == smol_llm.tokenizer.decode([token], False)


def test_prompt_logprobs_whatever_the_chunks_and_the_prefix_cache(smol_loaded):
    """A prompt cut into 16-token chunks beside other requests, then the same prompt again
    (its blocks are in the prefix cache, but prompt logprobs need every position), then a
    request without prompt logprobs that does hit the cache: the first two give the same
    logprobs, and the generated tokens match a plain request's."""
    llm = LLM(
        "smollm2-135m", loaded=smol_loaded, dtype="float32", quantization="none", threads=2,
        max_num_batched_tokens=16, kv_cache_memory=0.1, warmup=False,
    )  # fmt: skip
    ids = llm.tokenizer.encode(PROMPT)
    scored = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0)
    plain = SamplingParams(max_tokens=4, temperature=0)
    first, other = llm.generate([ids, ids[5:] + ids[:5]], [scored, plain], False)
    prefix = llm.engine.blocks.prefix
    hits = prefix.hit_tokens
    (again,) = llm.generate([ids], scored, False)
    assert prefix.hit_tokens == hits  # prompt logprobs ran the whole prompt
    (cached,) = llm.generate([ids], plain, False)
    assert prefix.hit_tokens > hits  # the blocks were there to hit
    assert [lp.logprob for lp in first.prompt_logprobs[1:]] == pytest.approx(
        [lp.logprob for lp in again.prompt_logprobs[1:]], abs=1e-5
    )
    assert all(lp.top == [] for lp in first.prompt_logprobs[1:])
    assert first.outputs[0].token_ids == cached.outputs[0].token_ids


@pytest.fixture(scope="module", params=["process", "thread"])
def scoring_server(smol_loaded, request):
    from conftest import start_server

    # float32 on the dequantised weights, as transformers computes them
    srv = start_server(smol_loaded, quantization="none", engine_process=request.param == "process")
    yield srv
    srv.stop()


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(scoring_server, hf_smol):
    """What lm-evaluation-harness's local-completions model sends to score a continuation
    (token ids, echo, logprobs 1, max_tokens 1), and max_tokens 0, through the server: the
    prompt's tokens with their logprobs (the first null), then the generated token's."""
    srv = scoring_server
    ids = srv.engine.tokenizer.encode(PROMPT)
    want = oracle(hf_smol, ids, 1)
    url = srv.url + "/v1/completions"
    body = {"model": "smollm2-135m", "prompt": [ids, ids[:12]], "echo": True, "logprobs": 1,
            "max_tokens": 1, "temperature": 0}  # fmt: skip
    r = httpx.post(url, json=body, timeout=120).json()
    first, short = sorted(r["choices"], key=lambda c: c["index"])
    lps = first["logprobs"]
    assert len(lps["token_logprobs"]) == len(ids) + 1
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for got, (lp, _) in zip(lps["token_logprobs"][1 : len(ids)], want, strict=True):
        assert abs(got - lp) < 1e-3
    for lp, top in zip(lps["token_logprobs"][1:], lps["top_logprobs"][1:], strict=True):
        assert len(top) == 1 and max(top.values()) >= lp - 1e-6
    assert first["text"].startswith(srv.engine.tokenizer.decode(ids, skip_special_tokens=False))
    assert lps["text_offset"][: len(ids)] == sorted(lps["text_offset"][: len(ids)])
    assert len(short["logprobs"]["tokens"]) == 13
    assert r["usage"]["completion_tokens"] == 2

    zero = httpx.post(url, json=body | {"max_tokens": 0, "prompt": ids}, timeout=120).json()
    (choice,) = zero["choices"]
    assert choice["logprobs"]["token_logprobs"] == lps["token_logprobs"][: len(ids)]
    assert choice["finish_reason"] == "length" and zero["usage"]["completion_tokens"] == 0


def test_vllm_prompt_logprobs_streamed_equal_non_streamed(scoring_server):
    srv = scoring_server
    url = srv.url + "/v1/completions"
    body = {"model": "smollm2-135m", "prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 3,
            "temperature": 0}  # fmt: skip
    whole = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    prompt_lps = whole["prompt_logprobs"]
    ids = srv.engine.tokenizer.encode(PROMPT)
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    for token, entry in zip(ids[1:], prompt_lps[1:], strict=True):
        assert str(token) in entry and 2 <= len(entry) <= 3
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] and all(math.isfinite(e["logprob"]) for e in entry.values())
    streamed, text = None, ""
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed = c.get("prompt_logprobs", streamed)
                    text += c["text"]
    assert streamed == prompt_lps and text == whole["text"]


def test_bad_prompt_logprobs_are_a_400(scoring_server):
    url = scoring_server.url + "/v1/completions"
    for extra, field in [({"prompt_logprobs": 999}, "prompt_logprobs"),
                         ({"prompt_logprobs": -1}, "prompt_logprobs"),
                         ({"max_tokens": -1}, "max_tokens")]:  # fmt: skip
        body = {"model": "smollm2-135m", "prompt": "hi"} | extra
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400 and field in r.text, r.text
