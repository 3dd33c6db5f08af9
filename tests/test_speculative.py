"""Speculative decoding: the output is the target's, token for token under greedy and in
distribution under sampling; rejected guesses leave nothing behind; bad configurations
fail at startup."""

from __future__ import annotations

import argparse
import dataclasses
import random

import httpx
import openai
import pytest
import torch

from tokenworks import LLM
from tokenworks.config import EngineConfig, SpeculativeConfig, add_engine_arguments
from tokenworks.engine.engine import LLMEngine
from tokenworks.engine.request import SamplingParams, StructuredOutput
from tokenworks.engine.sampler import distribution
from tokenworks.engine.speculative import DraftModelError, acceptance
from tokenworks.engine.speculative.ngram import lookup
from tokenworks.models import load
from tokenworks.models.toy import toy_weights

CODE = (
    "def area(width, height):\n    return width * height\n\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\n\n"
    "Repeat the two functions above exactly, with a docstring added to each:\n"
)
STORY = "Once upon a time, there was a little"


def toy_draft(seed: int = 1):
    """A drafter with the toy's tokenizer and shape but other random weights."""
    toy = load("toy")
    return dataclasses.replace(toy, weights=toy_weights(toy.spec, seed), model_id=f"toy-{seed}")


# ---------------------------------------------------------------- the pieces


def test_ngram_lookup_takes_the_latest_longest_match():
    ids = torch.tensor([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]).numpy()
    assert lookup(ids, 2, 3, 2) == [7, 5]  # "1 2 3" last followed by 7 5
    assert lookup(ids, 2, 3, 8) == [7, 5, 1, 2, 3]  # up to k, but not past the end
    assert lookup(torch.tensor([4, 5, 6]).numpy(), 1, 3, 2) == []


def test_greedy_keeps_the_matching_prefix_and_the_targets_token():
    tokens = [r.token_id for r in acceptance.greedy_prefix([5, 6, 7], [5, 6, 9, 4])]
    assert tokens == [5, 6, 9]
    tokens = [r.token_id for r in acceptance.greedy_prefix([5, 6], [5, 6, 8])]
    assert tokens == [5, 6, 8]  # all accepted, then the bonus token


def test_the_residual_is_what_p_has_beyond_q():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(acceptance.residual(p, q, 1), torch.tensor([1.0, 0.0, 0.0]))
    # a point mass on token 0: the residual is p without it
    assert torch.allclose(acceptance.residual(p, None, 0), torch.tensor([0.0, 0.6, 0.4]))


def chi_square_p(observed: dict, expected: dict, draws: int) -> float:
    """The chi-square test's p-value, cells expected fewer than 5 times pooled."""
    stat, df, pooled_o, pooled_e = 0.0, -1, 0.0, 0.0
    for cell, prob in expected.items():
        e = prob * draws
        if e < 5:
            pooled_o, pooled_e = pooled_o + observed.get(cell, 0), pooled_e + e
            continue
        stat += (observed.get(cell, 0) - e) ** 2 / e
        df += 1
    unseen = sum(n for cell, n in observed.items() if cell not in expected)
    pooled_o += unseen
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        df += 1
    elif unseen:
        return 0.0  # tokens the target can never give
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def test_rejection_sampling_two_deep_gives_the_targets_distribution():
    """The rule alone, on fixed rows: the first two emitted tokens follow p1 x p2 even
    where q differs, and always accepting follows q instead."""
    g = torch.Generator().manual_seed(0)
    v = 6
    logits = torch.randn(3, v, generator=g) * 1.5
    q_logits = torch.randn(2, v, generator=g) * 1.5
    params = SamplingParams(temperature=1.0, max_tokens=8)
    p = distribution(logits, params)
    q = distribution(q_logits, params)
    expected = {(a, b): float(p[0, a] * p[1, b]) for a in range(v) for b in range(v)}
    draws = 20_000

    def sample(rule):
        seen: dict = {}
        for _ in range(draws):
            draft = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)]
            out = rule(logits, list(logits.argmax(-1)), draft, q, params, None, None, g)
            cell = (out[0].token_id, out[1].token_id) if len(out) > 1 else None
            if cell is None:  # rejected at once: the second token comes next round
                second = int(torch.multinomial(p[1], 1, generator=g))
                cell = (out[0].token_id, second)
            seen[cell] = seen.get(cell, 0) + 1
        return seen

    assert chi_square_p(sample(acceptance.verify), expected, draws) > 0.001


# ---------------------------------------------------------------- configuration


def test_bad_configurations_fail_at_startup():
    with pytest.raises(ValueError, match="speculative method 'medusa'"):
        EngineConfig(speculative_config={"method": "medusa"})
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match='needs "model"'):
        EngineConfig(speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(speculative_config={"method": "ngram", "k": 3})
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig(speculative_config="{method: ngram}")
    # vLLM's shape: a model alone means a draft model
    spec = SpeculativeConfig.parse('{"model": "toy", "num_speculative_tokens": 2}')
    assert spec.method == "draft_model"


def test_a_bad_flag_value_says_what_is_wrong():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(p)
    with pytest.raises(argparse.ArgumentError, match="num_speculative_tokens must be"):
        p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'])


def test_a_draft_with_another_vocabulary_is_refused(smol_loaded):
    config = EngineConfig(model="toy", dtype="float32", warmup=False,
                          speculative_config={"model": "smollm2-135m"})  # fmt: skip
    with pytest.raises(DraftModelError, match="vocabulary of 49152 tokens"):
        LLMEngine(config, load("toy"), smol_loaded)


def test_a_draft_larger_than_the_target_is_refused():
    toy = load("toy")
    big_spec = dataclasses.replace(toy.spec, n_layers=4)
    big = dataclasses.replace(toy, spec=big_spec, weights=toy_weights(big_spec), model_id="big")
    config = EngineConfig(model="toy", dtype="float32", warmup=False,
                          speculative_config={"model": "big"})  # fmt: skip
    with pytest.raises(DraftModelError, match="more than the target"):
        LLMEngine(config, toy, big)


# ---------------------------------------------------------------- the real model


def prompts_16() -> list[tuple[str, SamplingParams]]:
    """Sixteen mixed requests: copy-heavy and free text, short and long, greedy (checked)
    beside sampled neighbours (which only share the steps)."""
    rng = random.Random(0)
    out = []
    for i in range(16):
        text = [CODE, STORY, "List the days of the week: Monday, Tuesday,", CODE * 2][i % 4]
        if i % 5 == 4:
            params = SamplingParams(max_tokens=rng.randint(8, 24), temperature=0.8, seed=i)
        else:
            params = SamplingParams(max_tokens=rng.randint(8, 40), temperature=0)
        out.append((text, params))
    return out


def run(llm, requests):
    texts = [t for t, _ in requests]
    return [o.outputs[0].token_ids for o in llm.generate(texts, [p for _, p in requests])]


def default_llm(loaded, **kw) -> LLM:
    """The default model as a user runs it (its GGUF blocks, batch-invariant)."""
    return LLM("smollm2-135m", loaded=loaded, threads=2, max_num_seqs=16, kv_cache_memory=0.5,
               warmup=False, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def smol_reference(smol_loaded):
    llm = default_llm(smol_loaded)
    solo = run(llm, [(CODE, SamplingParams(max_tokens=48, temperature=0))])
    batch = run(llm, prompts_16())
    return solo, batch


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_output_is_unchanged_by_speculation(method, smol_loaded, smol_reference):
    """In the default configuration: a verify step's rows are computed as decoding
    computes them (batch invariance), so speculation never changes greedy tokens."""
    solo_ref, batch_ref = smol_reference
    greedy = [i for i, (_, p) in enumerate(prompts_16()) if p.temperature == 0]
    for k in (1, 3, 8):  # one token, an odd count, the most: each rejects apart
        spec = {"method": method, "num_speculative_tokens": k, "adaptive": False}
        if method == "draft_model":  # the target's own file as its drafter: no download
            spec |= {"model": "smollm2-135m"}
        llm = default_llm(smol_loaded, speculative_config=spec)
        solo = run(llm, [(CODE, SamplingParams(max_tokens=48, temperature=0))])
        assert solo == solo_ref, f"k={k}: solo"
        batch = run(llm, prompts_16())
        for i in greedy:
            assert batch[i] == batch_ref[i], f"k={k}: request {i} of the batch"
        m = llm.engine.speculator.metrics
        assert m.num_draft_tokens > 0 and m.num_accepted_tokens > 0, f"k={k}: nothing verified"
        assert llm.engine.blocks.usage == 0
        llm.engine.blocks.check()


def test_grammars_penalties_and_logprobs_work_with_speculation(smol_loaded, smol_llm):
    """A grammar checks each guess and masks each verify row; penalties and logprobs see
    each row's own history: the same tokens as without speculation."""
    schema = {"type": "object", "properties": {"name": {"type": "string"},
              "langs": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "langs"]}  # fmt: skip
    copy = 'Repeat this JSON exactly: {"name": "Ada Lovelace", "langs": ["python", "c"]}\n'
    guided = StructuredOutput.json(schema)
    requests = [
        (copy, SamplingParams(max_tokens=40, temperature=0, structured=guided)),
        (CODE, SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.2)),
        (CODE, SamplingParams(max_tokens=30, temperature=0, frequency_penalty=0.5, logprobs=2)),
    ]  # fmt: skip
    llm = LLM("smollm2-135m", dtype="float32", quantization="none", loaded=smol_loaded,
              threads=2, warmup=False, kv_cache_memory=0.25,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "adaptive": False})  # fmt: skip
    texts, params = [t for t, _ in requests], [p for _, p in requests]
    ours = llm.generate(texts, params, use_tqdm=False)
    theirs = smol_llm.generate(texts, params, use_tqdm=False)
    for a, b in zip(ours, theirs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for a, b in zip(ours[2].outputs[0].logprobs, theirs[2].outputs[0].logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert llm.engine.speculator.metrics.num_accepted_tokens > 0


def test_the_server_counts_speculation_in_its_metrics(smol_loaded):
    from conftest import start_server

    srv = start_server(smol_loaded, speculative_config='{"method": "ngram"}', warmup=False)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model="smollm2-135m", prompt=CODE, max_tokens=32,
                                      temperature=0)  # fmt: skip
        assert r.usage.completion_tokens == 32
        text = httpx.get(srv.url + "/metrics").text
        counts = {}
        for line in text.splitlines():
            if line.startswith("tokenworks:spec_decode_") and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                counts[name.split("{")[0]] = counts.get(name.split("{")[0], 0) + float(value)
        assert counts["tokenworks:spec_decode_num_draft_tokens_total"] > 0
        assert counts["tokenworks:spec_decode_num_accepted_tokens_total"] > 0
        assert (
            counts["tokenworks:spec_decode_num_accepted_tokens_per_pos_total"]
            == (counts["tokenworks:spec_decode_num_accepted_tokens_total"])
        )
        for gauge in ("sequences_proposing", "sequences_held_back", "guessing_loses",
                      "acceptance_estimate"):  # the controller's state  # fmt: skip
            assert f"tokenworks:spec_decode_{gauge}" in counts
    finally:
        srv.stop()


# ---------------------------------------------------------------- the distribution


def first_two_distribution(target, prompt_ids, params) -> dict:
    """The target's exact probability of each pair of first two tokens."""
    runner = target.engine.runner

    def probs(ids):
        return distribution(runner.run_uncached(ids)[-1].float(), params)

    p1 = probs(prompt_ids)
    out = {}
    for a in torch.nonzero(p1 > 0).flatten().tolist():
        if a in target.engine.tokenizer.eos_token_ids:  # the end: no second token
            out[(a,)] = float(p1[a])
            continue
        p2 = probs(prompt_ids + [a])
        for b in torch.nonzero(p2 > 0).flatten().tolist():
            out[(a, b)] = float(p1[a] * p2[b])
    return out


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_output_follows_the_targets_distribution(top_p, monkeypatch):
    toy = load("toy")
    target = LLM("toy", dtype="float32", loaded=toy, warmup=False)
    prompt = target.tokenizer.encode("O")
    params = SamplingParams(max_tokens=2, temperature=1.0, top_p=top_p)
    expected = first_two_distribution(target, prompt, params)
    spec = {"model": "toy-1", "num_speculative_tokens": 3, "adaptive": False}

    def draws(n):
        llm = LLM("toy", dtype="float32", loaded=toy, draft=toy_draft(), warmup=False,
                  max_num_seqs=1024, max_num_batched_tokens=4096, max_waiting=n,
                  speculative_config=spec)  # fmt: skip
        seeded = [dataclasses.replace(params, seed=s) for s in range(n)]
        outs = llm.generate([prompt] * n, seeded, use_tqdm=False)
        m = llm.engine.speculator.metrics
        assert m.num_draft_tokens > 0.9 * n  # the second tokens were verified guesses
        assert m.num_accepted_tokens > 0
        seen: dict = {}
        for o in outs:
            cell = tuple(o.outputs[0].token_ids)
            seen[cell] = seen.get(cell, 0) + 1
        return seen

    assert chi_square_p(draws(10_000), expected, 10_000) > 0.001
    assert acceptance.accept_probability(0.25, 0.5) == 0.5  # what was just run: p/q
    # the test has power: a rule that keeps every guess gives the drafter's distribution
    monkeypatch.setattr(acceptance, "accept_probability", lambda p, q: 1.0)
    assert chi_square_p(draws(4_000), expected, 4_000) < 0.001


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_rejections_and_cancellations_leave_the_pools_empty(method):
    toy = load("toy")
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "draft_model":
        spec["model"] = "toy-1"
    config = EngineConfig(model="toy", dtype="float32", warmup=False, max_num_seqs=8,
                          kv_cache_memory=0.002, block_size=4,
                          speculative_config=spec)  # fmt: skip
    engine = LLMEngine(config, toy, toy_draft() if method == "draft_model" else None)
    rng = random.Random(1)
    words = ["ab", "ab ab", "abc abc abc", "the cat sat on the mat, the cat sat"]
    for i in range(60):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
        params = SamplingParams(
            max_tokens=rng.randint(1, 30),
            temperature=rng.choice([0, 0.7, 1.0]),
            n=rng.choice([1, 1, 2]),
            seed=i,
        )
        engine.add_request(prompt=text, params=params, request_id=f"r{i}")
        for _ in range(rng.randint(0, 3)):
            engine.step()
        if i % 7 == 3:
            engine.abort_request(f"r{rng.randint(0, i)}")
    while engine.has_unfinished():
        engine.step()
    m = engine.speculator.metrics
    assert m.num_draft_tokens > m.num_accepted_tokens > 0  # guesses were kept and thrown
    assert engine.blocks.usage == 0
    engine.blocks.check()
    if method == "draft_model":
        drafter = engine.speculator.proposer
        assert drafter.blocks.num_free == drafter.blocks.num_blocks
        drafter.blocks.check()


def test_a_seed_fixes_the_output_with_speculation():
    """Adaptive speculation decides a seeded request's k from its own verdicts and fixed
    costs, never from timings: the same seed gives the same tokens."""
    toy = load("toy")
    small = dataclasses.replace(toy.spec, n_layers=1)
    drafter = dataclasses.replace(toy, spec=small, weights=toy_weights(small, 1), model_id="s")
    spec = {"model": "s", "num_speculative_tokens": 3}
    outs = []
    for _ in range(2):
        llm = LLM("toy", dtype="float32", loaded=toy, draft=drafter, warmup=False,
                  speculative_config=spec)  # fmt: skip
        params = SamplingParams(max_tokens=40, temperature=0.9, seed=7, ignore_eos=True)
        outs.append(llm.generate(["abc abc"], params, use_tqdm=False)[0].outputs[0].token_ids)
        assert llm.engine.speculator.metrics.num_draft_tokens > 0
    assert outs[0] == outs[1]


def test_the_controller_holds_back_guesses_that_do_not_pay():
    """A drafter of other random weights almost never guesses right: with the adaptive
    controller on, after its first verdicts the sequence mostly sits out (the gauges say
    so at each step), where a controller kept off guesses at every step."""
    toy = load("toy")
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    drafts = {}
    for adaptive in (True, False):
        config = EngineConfig(model="toy", dtype="float32", warmup=False, speculative_config={
            "model": "toy-1", "num_speculative_tokens": 4, "adaptive": adaptive})  # fmt: skip
        engine = LLMEngine(config, toy, toy_draft())
        engine.add_request(prompt="the cat sat", params=params)
        held = 0
        while engine.has_unfinished():
            engine.step()
            held += engine.speculator.metrics.held_back
        m = engine.speculator.metrics
        assert m.mean_acceptance is not None
        drafts[adaptive] = (m.num_drafts, held, m.num_accepted_tokens / max(1, m.num_draft_tokens))
    (on, held_on, rate), (off, held_off, _) = drafts[True], drafts[False]
    assert rate < 0.2  # the guesses do not pay
    assert on < off / 2 and held_on > 20 and held_off == 0


def test_a_drafter_reads_a_prompt_longer_than_a_step_in_pieces():
    toy = load("toy")
    config = EngineConfig(model="toy", dtype="float32", warmup=False, max_num_batched_tokens=32,
                          speculative_config={"model": "toy-1", "adaptive": False})  # fmt: skip
    engine = LLMEngine(config, toy, toy_draft())
    engine.add_request(prompt="abcdefgh " * 12, params=SamplingParams(max_tokens=12))
    while engine.has_unfinished():
        engine.step()
    assert engine.speculator.metrics.num_draft_tokens > 0
    drafter = engine.speculator.proposer
    assert drafter.blocks.num_free == drafter.blocks.num_blocks


def test_adaptive_speculation_stops_guessing_when_it_does_not_pay_and_probes_again():
    """Left on (the default), the controller proposes all k while a sequence's guesses
    are accepted; once they keep failing it sits out MIN_OFF decode steps, then probes with
    one guess and, still failing, sits out twice as long. Where steps with guesses emit
    fewer tokens a second than steps without, no step guesses but one in PROBE_EVERY."""
    from types import SimpleNamespace

    from tokenworks.engine.speculative.controller import (
        MIN_OFF,
        PROBE_EVERY,
        Controller,
        StepCosts,
    )

    seq = SimpleNamespace(params=SimpleNamespace(seed=7))  # seeded: fixed costs, no timings
    c = Controller(k_max=4, adaptive=True, rounds_per_token=False, static_cost=0.0)
    st = c.state(seq)
    for _ in range(12):
        st.update(proposed=4, accepted=4)
    assert c.choose(seq, batch=1, limit=4) == 4
    for _ in range(30):
        st.update(proposed=4, accepted=0)
    assert c.choose(seq, 1, 4) == 0  # no k gains a token: it stops guessing
    assert st.off_until == c.step + MIN_OFF
    first_off = st.off_until
    for step in range(c.step, first_off):
        c.step = step
        assert c.choose(seq, 1, 4) == 0
    c.step = first_off
    assert c.choose(seq, 1, 4) == 1  # back: one guess, to measure again
    assert st.off_until == first_off + 2 * MIN_OFF  # still losing: twice as long
    for _ in range(12):
        st.update(proposed=1, accepted=1)
    c.step = st.off_until
    assert c.choose(seq, 1, 4) == 4  # guesses pay again

    costs = StepCosts()
    costs.observe_rate(1, speculated=True, tokens_per_s=10.0)
    costs.observe_rate(1, speculated=False, tokens_per_s=20.0)
    answers = [costs.losing(1) for _ in range(2 * PROBE_EVERY)]
    assert answers.count(False) == 2 and answers[PROBE_EVERY - 1] is False
