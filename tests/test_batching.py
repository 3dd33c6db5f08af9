"""Continuous batching on the real model: invariance, prefix caching, chunking, preemption."""

from __future__ import annotations

import itertools
import random

import pytest

from tokenworks import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def mixed_prompts(tok, n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 3 to ~300 tokens cut from English text, all different."""
    words = (
        "the engine reads a prompt turns it into tokens runs the model over a batch of "
        "sequences writes keys and values into blocks and samples one token at a time while "
        "the scheduler decides who runs next under a budget of tokens and a cap on sequences"
    ).split()
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.choice([3, 9, 17, 40, 75, 130, 210, 300])
        text = f"Story {i}: " + " ".join(rng.choice(words) for _ in range(length))
        out.append(tok.encode(text)[:length] if length > 3 else tok.encode(text)[:3])
    return out


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def invariant_llm(smol_loaded):
    """Batch-invariant numerics on the default path (the file's blocks), a small budget so
    prompts are chunked beside decodes."""
    return LLM(
        "smollm2-135m",
        loaded=smol_loaded,
        batch_invariant=True,
        max_num_batched_tokens=128,
        max_num_seqs=16,
        kv_cache_memory=0.25,
    )


def test_sixteen_mixed_prompts_together_give_what_each_gives_alone(invariant_llm):
    prompts = mixed_prompts(invariant_llm.tokenizer, 16)
    together = tokens(invariant_llm.generate(prompts, GREEDY))
    stats = list(invariant_llm.engine.stats)
    assert max(s.batch_size for s in stats) >= 5  # they really ran together
    assert any(s.prefill_tokens and s.decode_tokens for s in stats)  # chunks beside decodes
    alone = [tokens(invariant_llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert together == alone


def test_a_chunked_prompt_gives_the_logits_of_one_pass(smol_llm, smol_loaded):
    chunked = LLM(
        "smollm2-135m",
        dtype="float32",
        quantization="none",
        loaded=smol_loaded,
        max_num_batched_tokens=48,
        kv_cache_memory=0.1,
    )
    prompt = mixed_prompts(chunked.tokenizer, 8, seed=3)[-1]
    while len(prompt) < 200:
        prompt = prompt + prompt
    out = chunked.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=10))
    assert sum(s.prefill_tokens > 0 for s in chunked.engine.stats) >= 4  # it was chunked
    full = chunked.engine.runner.run_uncached(prompt)[-1].float().log_softmax(-1)
    top = out[0].outputs[0].logprobs[0].top
    for token_id, _, logprob in top:
        assert abs(full[token_id].item() - logprob) < 1e-4


def test_a_prefix_cache_hit_gives_the_tokens_of_a_miss(smol_llm, smol_loaded):
    cold = LLM(
        "smollm2-135m",
        dtype="float32",
        quantization="none",
        loaded=smol_loaded,
        enable_prefix_caching=False,
        kv_cache_memory=0.1,
    )
    prompts = mixed_prompts(smol_llm.tokenizer, 4, seed=5)
    shared = prompts[0] * 3  # > 2 blocks of common prefix
    batch = [shared + p for p in prompts]
    expected = tokens(cold.generate(batch, GREEDY))
    warm = LLM(
        "smollm2-135m", dtype="float32", quantization="none", loaded=smol_loaded,
        kv_cache_memory=0.1,
    )  # fmt: skip
    alone = warm.generate(batch[:1], GREEDY)
    first = tokens(alone)
    rest = warm.generate(batch[1:], GREEDY)
    assert all(o.num_cached_tokens >= len(shared) - 16 for o in rest)  # hits
    assert alone[0].prefix_miss == "never_cached"
    assert first + tokens(rest) == expected


def test_a_shared_system_prompt_is_computed_once(smol_llm, smol_loaded):
    llm = LLM(
        "smollm2-135m", dtype="float32", quantization="none", loaded=smol_loaded,
        kv_cache_memory=0.25,
    )  # fmt: skip
    tok = llm.tokenizer
    system = (tok.encode("You are a careful assistant. " * 120))[:512]
    prompts = [system + tok.encode(f" Question {i}: what is {i} plus {i}?") for i in range(32)]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    t = llm.engine.totals
    assert t["prompt_tokens"] == sum(len(p) for p in prompts)
    saved = 1 - t["prefill_tokens"] / t["prompt_tokens"]
    assert saved >= 0.90, t
    prefix = llm.engine.blocks.prefix
    assert prefix.hit_tokens >= 31 * 512 and prefix.queried_tokens == t["prompt_tokens"]


def test_without_the_cache_every_prompt_token_is_computed(toy_llm):
    llm = LLM("toy", dtype="float32", loaded=toy_llm.engine.loaded, enable_prefix_caching=False)
    prompts = [[5] * 40 + [i] for i in range(6)]
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0))
    assert llm.engine.totals["prefill_tokens"] == sum(len(p) for p in prompts)


def test_salted_requests_do_not_share_cached_blocks(toy_llm):
    llm = LLM("toy", dtype="float32", loaded=toy_llm.engine.loaded)
    eng = llm.engine
    prompt = list(range(3, 70))
    for salt in ("tenant-a", "tenant-b", "tenant-a"):
        eng.add_request(prompt_token_ids=prompt, params=GREEDY, cache_salt=salt)
        while eng.has_unfinished():
            eng.step()
    assert eng.blocks.prefix.hit_tokens == 64  # only the second tenant-a request hit


def test_too_little_kv_memory_preempts_and_still_gives_each_output(invariant_llm, smol_loaded):
    prompts = mixed_prompts(invariant_llm.tokenizer, 8, seed=7)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [tokens(invariant_llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    # 22 blocks of 16 tokens: the longest request (324 tokens, 21 blocks) only just fits alone
    block_bytes = invariant_llm.engine.kv_bytes_per_token * 16
    tight = LLM(
        "smollm2-135m",
        loaded=smol_loaded,
        batch_invariant=True,
        max_num_batched_tokens=128,
        kv_cache_memory=22 * block_bytes / 1024**3,
    )
    assert tight.engine.blocks.num_blocks == 22
    together = tokens(tight.generate(prompts, params))
    assert tight.engine.totals["preemptions"] > 0
    assert together == alone
    assert tight.engine.blocks.num_free == 22


def test_parallel_samples_share_the_prompt_blocks_and_copy_on_write(toy_llm, device):
    llm = LLM("toy", dtype="float32", loaded=toy_llm.engine.loaded, block_size=8, device=device)
    prompt = list(range(3, 23))  # 20 tokens: 2 full blocks and a partial one
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3)
    out = llm.generate([prompt], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # independent samples
    assert llm.engine.blocks.cow_copies >= 2  # two siblings copied the shared partial block
    again = llm.generate([prompt], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, n=2))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_the_waiting_queue_is_bounded_and_oversized_requests_are_refused(toy_llm):
    from tokenworks.engine.admission import RequestTooLargeError
    from tokenworks.engine.messages import QueueFullError

    llm = LLM(
        "toy",
        dtype="float32",
        loaded=toy_llm.engine.loaded,
        max_waiting=3,
        max_num_seqs=1,
        kv_cache_memory=64 * toy_llm.engine.kv_bytes_per_token / 1024**3,
        block_size=16,
    )
    eng = llm.engine
    for _ in range(4):  # one takes the free running slot, three wait for it
        eng.add_request(prompt_token_ids=[5, 6, 7], params=GREEDY)
    with pytest.raises(QueueFullError, match="queue is full"):
        eng.add_request(prompt_token_ids=[5, 6, 7], params=GREEDY)
    with pytest.raises(RequestTooLargeError, match="KV blocks"):
        eng.add_request(prompt_token_ids=[5] * 60, params=SamplingParams(max_tokens=100))
    while eng.has_unfinished():
        eng.step()


def test_priority_policy_runs_urgent_requests_first(toy_llm):
    llm = LLM(
        "toy",
        dtype="float32",
        loaded=toy_llm.engine.loaded,
        max_num_seqs=1,
        scheduling_policy="priority",
    )
    eng = llm.engine
    low = eng.add_request(prompt_token_ids=[5, 6], params=GREEDY, priority=5)
    high = eng.add_request(prompt_token_ids=[7, 8], params=GREEDY, priority=0)
    eng.step()
    assert high.output_ids and not low.output_ids


def test_a_thousand_random_requests_with_cancellations_leak_no_blocks(toy_llm, device):
    llm = LLM(
        "toy",
        device=device,
        dtype="float32",
        loaded=toy_llm.engine.loaded,
        block_size=4,
        max_num_seqs=24,
        max_num_batched_tokens=96,
        kv_cache_memory=60 * toy_llm.engine.kv_bytes_per_token * 4 / 1024**3,
    )
    eng = llm.engine
    total = eng.blocks.num_blocks
    rng = random.Random(0)
    live: list[str] = []
    for i in range(1000):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.3:  # shared prefixes exercise the cache
            prompt = [9] * 8 + prompt
        params = SamplingParams(
            max_tokens=rng.randint(1, 12), temperature=1.0, seed=i, n=rng.choice([1, 1, 2])
        )
        eng.add_request(prompt_token_ids=prompt, params=params, request_id=f"r{i}")
        live.append(f"r{i}")
        if rng.random() < 0.6:
            eng.step()
        if rng.random() < 0.15 and live:
            eng.abort_request(live.pop(rng.randrange(len(live))))
        eng.blocks.check()
    while eng.has_unfinished():
        eng.step()
    eng.blocks.check()
    assert eng.blocks.num_free == total
    assert not eng.requests
    assert eng.totals["preemptions"] > 0  # the pool was small enough to matter


def test_step_stats_describe_each_step(toy_llm):
    llm = LLM("toy", dtype="float32", loaded=toy_llm.engine.loaded)
    llm.generate([[5] * 30, [6] * 10], SamplingParams(max_tokens=4, temperature=0))
    stats = list(llm.engine.stats)
    assert stats[0].prefill_tokens == 40 and stats[0].batch_size == 2
    assert stats[-1].decode_tokens >= 1 and all(0 <= s.kv_usage <= 1 for s in stats)
    assert sum(s.prefill_tokens + s.decode_tokens for s in stats) == 40 + 2 * 3
    assert [s.step for s in stats] == list(range(len(stats)))  # every step, in order
    assert all(0 < s.duration_s < 60 for s in stats)
    pairs = list(itertools.pairwise(stats))
    assert all(a.time <= b.time for a, b in pairs)
    # a step ends no sooner after the one before it than it took
    assert all(b.time - a.time >= b.duration_s * 0.99 for a, b in pairs)


def test_a_failed_forward_pass_aborts_its_requests_and_the_engine_carries_on(toy_llm):
    llm = LLM("toy", dtype="float32", loaded=toy_llm.engine.loaded)
    eng = llm.engine
    free = eng.blocks.num_free
    seqs = [eng.add_request(prompt_token_ids=[9] * 40 + [i], params=GREEDY) for i in range(3)]
    real_start = eng.runner.start

    def broken(*args, **kwargs):  # fault injection: the next forward pass raises
        eng.runner.start = real_start
        raise RuntimeError("injected fault")

    eng.runner.start = broken
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    assert all(s.finish_reason == "abort" for s in seqs)
    assert eng.blocks.num_free == free and not eng.has_unfinished()
    assert eng.blocks.prefix.lookup(seqs[0].block_hashes) == []  # nothing half-written is found
    out = llm.generate([[9] * 40 + [1]], GREEDY)  # the engine still serves
    assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_the_offline_llm_fails_a_request_as_the_server_does_and_goes_on(toy_llm, faults_here):
    """LLM.generate steps its engine through the server's loop: a request whose sampling
    raises ends alone with finish reason "error", a forward pass that raises ends the
    requests in its batch the same way, and neither stops the call or the engine."""
    import faults

    llm = LLM("toy", dtype="float32", loaded=toy_llm.engine.loaded, warmup=False)
    prompts = [[9] * 20 + [i] for i in range(3)]
    bad = SamplingParams(max_tokens=12, ignore_eos=True, seed=faults.SAMPLING_SEED)  # (sampled)
    out = llm.generate(prompts, [GREEDY, bad, GREEDY], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in out] == ["length", "error", "length"]
    assert [len(o.outputs[0].token_ids) for o in out[::2]] == [12, 12]
    broken = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, seed=faults.FORWARD_SEED)
    out = llm.generate(prompts[:2], [GREEDY, broken], use_tqdm=False)  # one batch: both end
    assert [o.outputs[0].finish_reason for o in out] == ["error", "error"]
    assert not llm.engine.has_unfinished() and not llm.loop.sent
    again = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert again[0].outputs[0].finish_reason == "length"


def test_no_warm_up_where_the_c_kernels_run_every_batch_as_whole_step_rows(toy_llm, monkeypatch):
    """Batch-invariant on the C kernels, a big step builds nothing the first request would
    pay for, and the warm-up pass would be a whole step of decode rows: it is skipped.
    Off that path (each batch size on its fastest products) the warm-up runs."""
    from tokenworks.engine.step_log import StepLog
    from tokenworks.kernels.build import library

    assert library() is not None, "the C kernels build wherever the tests run"
    steps = []
    record = StepLog.record
    monkeypatch.setattr(
        StepLog, "record", lambda self, out, *a: (steps.append(out), record(self, out, *a))
    )
    loaded = toy_llm.engine.loaded
    rows = LLM("toy", dtype="bfloat16", loaded=loaded, max_num_batched_tokens=256)
    assert rows.engine.c_kernels.invariant and steps == []
    fastest = LLM("toy", dtype="bfloat16", loaded=loaded, max_num_batched_tokens=256,
                  batch_invariant=False)  # fmt: skip
    assert not fastest.engine.c_kernels.invariant and len(steps) == 1


def test_the_warm_up_fills_a_step_and_leaves_no_trace(toy_llm, monkeypatch, caplog):
    from tokenworks.engine.prefix_cache import WARN_AFTER
    from tokenworks.engine.step_log import StepLog

    steps = []
    record = StepLog.record

    def spy(self, out, *args):
        steps.append(out.num_prefill_tokens)
        record(self, out, *args)

    monkeypatch.setattr(StepLog, "record", spy)
    warm = LLM("toy", dtype="float32", loaded=toy_llm.engine.loaded, max_num_batched_tokens=512)
    assert steps == [512]  # 4 filler prompts of 128 tokens in one forward pass
    eng = warm.engine
    assert not eng.requests and not eng.has_unfinished() and not eng.stats
    assert set(eng.totals.values()) == {0}
    assert len(eng.blocks.free) == eng.blocks.num_blocks  # nothing held, nothing cached
    prefix = eng.blocks.prefix
    assert (prefix.queried_tokens, prefix.hit_tokens, len(prefix.by_hash)) == (0, 0, 0)
    cold = LLM("toy", dtype="float32", loaded=toy_llm.engine.loaded, warmup=False)
    assert steps == [512]
    prompts = [[0] * 130, list(range(3, 40))]
    assert tokens(warm.generate(prompts, GREEDY)) == tokens(cold.generate(prompts, GREEDY))
    # its filler shares tokens under salts of its own: no miss counted, no warning
    with caplog.at_level("WARNING", logger="tokenworks.engine"):
        many = LLM("toy", dtype="float32", loaded=toy_llm.engine.loaded,
                   max_num_batched_tokens=128 * (WARN_AFTER + 2))  # fmt: skip
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert set(many.engine.blocks.prefix.misses.values()) == {0}
    # a context of one token holds no prompt: nothing to warm up with, and no error
    assert LLM("toy", loaded=toy_llm.engine.loaded, max_model_len=1).engine.totals["steps"] == 0
