"""The prefix cache's host tier (--kv-offload-gib) on a real engine: a prefix evicted from
the pool and copied back gives what a prefix never evicted gives, bit for bit."""

from __future__ import annotations

import pytest

from tokenworks import LLM, SamplingParams
from tokenworks.engine.kv_budget import GiB

PREFIX = [5 + i % 50 for i in range(80)]  # 5 blocks of 16 tokens
QUESTION = PREFIX + [3, 1, 4, 1, 5]
PARAMS = SamplingParams(max_tokens=4, temperature=0, logprobs=5)


def _answer(llm: LLM):
    [out] = llm.generate([QUESTION], PARAMS, use_tqdm=False)
    c = out.outputs[0]
    return out, c.token_ids, [(lp.logprob, [(t, p) for t, _, p in lp.top]) for lp in c.logprobs]


@pytest.mark.parametrize("offload_gib", [0.0, 0.001])
def test_a_prefix_copied_back_from_host_memory_gives_the_never_evicted_logits(toy_llm, offload_gib):
    loaded = toy_llm.engine.loaded
    kw = dict(dtype="float32", loaded=loaded, warmup=False)
    kept = LLM("toy", **kw)  # a pool that never evicts
    kept.generate([PREFIX + [1]], SamplingParams(max_tokens=1), use_tqdm=False)
    want, tokens, logprobs = _answer(kept)
    assert want.num_cached_tokens == len(PREFIX)

    blocks = 12  # room for the prefix, not for it and the fillers after it
    small = LLM("toy", kv_cache_memory=blocks * kept.engine.block_bytes / GiB,
                kv_offload_gib=offload_gib, **kw)  # fmt: skip
    eng = small.engine
    assert eng.blocks.num_blocks == blocks
    small.generate([PREFIX + [1]], SamplingParams(max_tokens=1), use_tqdm=False)
    for i in range(3):  # each filler takes most of the pool: the prefix's blocks go
        filler = [200 + i] * (9 * 16)
        small.generate([filler], SamplingParams(max_tokens=1), use_tqdm=False)
    host = eng.blocks.host
    got, got_tokens, got_logprobs = _answer(small)
    assert got_tokens == tokens
    if not offload_gib:  # without the tier the prefix is computed again, in one pass
        assert host is None and got.num_cached_tokens == 0 and got.prefix_miss == "evicted"
        return
    assert got.num_cached_tokens == len(PREFIX) and host.restored == len(PREFIX) // 16
    assert host.offloaded >= len(PREFIX) // 16 and host.nbytes <= 0.001 * GiB
    assert got_logprobs == logprobs  # bit for bit: the same floats


def test_the_host_tier_is_counted_where_metrics_read_it(toy_llm):
    from tokenworks.engine.loop import gauges_of
    from tokenworks.serve.metrics import ServerMetrics

    small = LLM("toy", dtype="float32", loaded=toy_llm.engine.loaded, warmup=False,
                kv_cache_memory=8 * toy_llm.engine.block_bytes / GiB,
                kv_offload_gib=0.001)  # fmt: skip
    for i in range(4):
        small.generate([[100 + i] * 100], SamplingParams(max_tokens=1), use_tqdm=False)
    small.generate([[100] * 100], SamplingParams(max_tokens=1), use_tqdm=False)
    gauges = gauges_of(small.engine)
    assert gauges.offloaded_blocks > 0 and gauges.restored_blocks > 0
    assert gauges.offload_bytes == small.engine.blocks.host.nbytes > 0
    metrics = ServerMetrics("toy")
    metrics.on_step(0, gauges)
    text = metrics.render().decode()
    series = 'tokenworks:kv_restore_blocks_total{engine="0",model_name="toy"}'
    assert f"{series} {gauges.restored_blocks}.0" in text
    # a tier of two blocks: what its budget pushes out is counted too
    tight = LLM("toy", dtype="float32", loaded=toy_llm.engine.loaded, warmup=False,
                kv_cache_memory=8 * toy_llm.engine.block_bytes / GiB,
                kv_offload_gib=2 * toy_llm.engine.block_bytes / GiB)  # fmt: skip
    for i in range(4):
        tight.generate([[100 + i] * 100], SamplingParams(max_tokens=1), use_tqdm=False)
    gauges = gauges_of(tight.engine)
    assert gauges.offload_dropped_blocks == tight.engine.blocks.host.dropped > 0
    assert tight.engine.blocks.host.nbytes <= 2 * tight.engine.block_bytes
    metrics = ServerMetrics("toy")
    metrics.on_step(0, gauges)
    series = 'tokenworks:kv_offload_dropped_blocks_total{engine="0",model_name="toy"}'
    assert f"{series} {gauges.offload_dropped_blocks}.0" in metrics.render().decode()


def test_the_host_tier_needs_the_prefix_cache_and_one_process():
    from tokenworks.config import EngineConfig

    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(model="toy", kv_offload_gib=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="each rank holds part"):
        EngineConfig(model="toy", kv_offload_gib=1, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=">= 0"):
        EngineConfig(model="toy", kv_offload_gib=-1)
