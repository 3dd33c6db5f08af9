"""Batch invariance, the default: a token's logits are the same bits whatever else its step
holds (other sequences, prompt chunks of any size, decodes, prefix-cache hits), on the
default model's paths this CPU runs: the GGUF file's own blocks and bfloat16.

Each row's logits are captured as the runner hands them to the sampler, keyed by the
sequence's prompt and how many tokens it has seen; the reference is each prompt alone, in
one prompt pass, then decoded."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenworks import LLM, SamplingParams

BUDGETS = (16, 61, 256)  # the step budgets (tokens) the batched runs cut prompts by
QUANTS = ("gguf", "none")  # the file's blocks (the default) and bfloat16


def capture(llm: LLM) -> dict:
    """Record every sampling row's logits of llm's engine into the dict returned: (prompt,
    tokens seen) -> logits [V]."""
    runner, seen = llm.engine.runner, {}
    real = runner.start

    def start(batch, argmax_only=False, copies=()):
        finish = real(batch, False, copies)

        def captured():
            out, row = finish(), 0
            for item in batch:
                if item.sample:
                    s = item.seq
                    key = (tuple(s.prompt_ids), s.n_cached + item.n_tokens)
                    seen[key] = out.logits[row].clone()
                    row += 1
            return out

        return captured

    runner.start = start
    return seen


@pytest.fixture(scope="module")
def engines(smol_loaded):
    """(quantisation, budget) -> (LLM, its captured logits); budget None: the reference,
    whose budget takes any prompt in one pass."""
    out = {}
    for quant in QUANTS:
        for budget in (None, *BUDGETS):
            llm = LLM(
                "smollm2-135m", loaded=smol_loaded, quantization=quant, threads=2,
                max_num_seqs=16, max_num_batched_tokens=budget or 512, kv_cache_memory=0.1,
                warmup=False,
            )  # fmt: skip
            assert llm.engine.invariance == "kernels", llm.engine.kernels()
            out[quant, budget] = (llm, capture(llm))
    return out


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def reference(engines, quant: str, prompt: list[int], n: int) -> dict:
    """The logits of each of the prompt's rows, the prompt alone."""
    llm, seen = engines[quant, None]
    seen.clear()
    llm.generate([prompt], greedy(n), use_tqdm=False)
    return dict(seen)


@st.composite
def compositions(draw):
    """Prompts (some sharing a prefix, so the batched run hits its prefix cache), each
    one's new tokens, the step budget and how many steps pass before the later half
    arrives."""
    rng = random.Random(draw(st.integers(0, 2**16)))
    shared = [rng.randrange(100, 40000) for _ in range(draw(st.integers(0, 33)))]
    prompts = []
    for _ in range(draw(st.integers(1, 8))):
        own = [rng.randrange(100, 40000) for _ in range(draw(st.integers(1, 60)))]
        prompts.append((shared if draw(st.booleans()) else []) + own)
    news = [draw(st.integers(1, 5)) for _ in prompts]
    return prompts, news, draw(st.sampled_from(BUDGETS)), draw(st.integers(0, 4))


@pytest.mark.parametrize("quant", QUANTS)
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=compositions())
def test_a_row_gets_the_same_logits_in_any_batch(engines, quant, case):
    prompts, news, budget, later = case
    llm, seen = engines[quant, budget]
    seen.clear()
    engine = llm.engine
    half = len(prompts) // 2
    for p, n in zip(prompts[:half], news[:half], strict=True):
        engine.add_request(prompt_token_ids=p, params=greedy(n))
    for _ in range(later):
        if engine.has_unfinished():
            engine.step()
    for p, n in zip(prompts[half:], news[half:], strict=True):
        engine.add_request(prompt_token_ids=p, params=greedy(n))
    while engine.has_unfinished():
        engine.step()
    for p, n in zip(prompts, news, strict=True):
        alone = reference(engines, quant, p, n)
        assert len(alone) == n
        for key, logits in alone.items():
            assert key in seen, "the batched run decoded other tokens than the prompt alone"
            assert seen[key].view(-1).equal(logits.view(-1)), f"row {key[1]} differs"


def test_a_prefix_cache_hit_gives_the_logits_of_a_miss(engines):
    """The same prompt twice in one engine: the second run reads its prefix from the cache
    and computes only the rest, and gets the first run's logits bit for bit."""
    llm, seen = engines["gguf", 16]
    prompt = list(range(1000, 1070))
    seen.clear()
    llm.generate([prompt], greedy(3), use_tqdm=False)
    miss = dict(seen)
    seen.clear()
    prefix = llm.engine.blocks.prefix
    hits = prefix.hit_tokens
    llm.generate([prompt], greedy(3), use_tqdm=False)
    assert prefix.hit_tokens - hits >= 64  # the prompt's four full blocks
    assert seen.keys() == miss.keys()
    assert all(seen[k].equal(miss[k]) for k in miss)


def test_the_server_gives_a_request_its_tokens_whoever_else_is_served(smol_loaded):
    """Through the real server (its core in a process of its own, default numerics): 24
    copies of one greedy request at once, then 8 prompts x 2 copies, each equal to the
    request sent alone; and two replicas behind a router give the same 8 x 2."""
    import asyncio

    import httpx
    from conftest import start_server

    srv = start_server(smol_loaded, engine_process=True, dtype="auto", max_num_seqs=64)
    url = srv.url + "/v1/completions"
    prompts = [f"Copy this list exactly, one per line: {i} apple, banana, cherry, damson, fig"
               for i in range(8)]  # fmt: skip

    async def texts(bodies):
        async with httpx.AsyncClient(timeout=300) as http:
            rs = await asyncio.gather(*(http.post(url, json=b) for b in bodies))
        return [r.json()["choices"][0]["text"] for r in rs]

    def body(prompt):
        return {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}  # fmt: skip

    try:
        alone = [asyncio.run(texts([body(p)]))[0] for p in prompts]
        assert asyncio.run(texts([body(prompts[0])] * 24)) == [alone[0]] * 24
        assert asyncio.run(texts([body(p) for p in prompts * 2])) == alone * 2
    finally:
        srv.stop()
    srv = start_server(smol_loaded, replicas=2, router="round_robin", dtype="auto",
                       max_num_seqs=64)  # fmt: skip
    url = srv.url + "/v1/completions"
    try:
        assert asyncio.run(texts([body(p) for p in prompts * 2])) == alone * 2
        assert min(srv.state.engine.routed) >= 8  # both replicas took work
    finally:
        srv.stop()
