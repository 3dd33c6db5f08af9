"""Prefill / decode disaggregation (front/disaggregated.py, engine/kv_transfer.py) on the
default model: a prefill engine and a decode engine behind the router give a colocated
engine's tokens, the blocks the decode engine reads are bit for bit those the prefill
engine wrote, and both prefix caches stay correct when prompts share a prefix."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from tokenworks.config import EngineConfig
from tokenworks.engine.engine import LLMEngine
from tokenworks.engine.kv_transfer import _rows, export_prefix, import_prefix
from tokenworks.engine.prefix_cache import prefix_hashes
from tokenworks.engine.request import SamplingParams
from tokenworks.front.core_client import CoreClient
from tokenworks.front.disaggregated import DisaggregatedRouter
from tokenworks.front.interface import Submission

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _engine(loaded) -> LLMEngine:
    config = EngineConfig(model="smollm2-135m", threads=1, warmup=False, max_num_seqs=8,
                          kv_cache_memory=0.25)  # fmt: skip
    return LLMEngine(config, loaded)


def _prompts(tokenizer) -> list[list[int]]:
    """Long and short prompts; the last two share a 100-token system prompt with the first."""
    system = tokenizer.encode("You are a careful assistant who answers in full sentences. " * 8)
    return [
        system + tokenizer.encode("What is the capital of France?"),
        tokenizer.encode("def fibonacci(n):\n    "),
        tokenizer.encode("Once upon a time, " * 30),
        tokenizer.encode("Hi"),  # no full block to move: straight to the decode engine
        system + tokenizer.encode("Name three rivers in Africa."),
        system + tokenizer.encode("What is the capital of France?"),
    ]


async def _run(front, prompts, params=GREEDY) -> list[list[int]]:
    async def one(prompt):
        tokens = []
        async for update in front.generate(Submission(params, prompt)):
            tokens += update.deltas[0].token_ids
        return tokens

    return [await one(p) for p in prompts]  # in turn: the later ones find the earlier's blocks


@pytest.fixture(scope="module")
def engines(smol_loaded):
    """A prefill engine, a decode engine and a colocated one, each a core in a thread."""
    return {name: _engine(smol_loaded) for name in ("prefill", "decode", "colocated")}


def test_disaggregated_tokens_equal_colocated_and_the_blocks_arrive_bit_for_bit(engines):
    prefill, decode = engines["prefill"], engines["decode"]
    router = DisaggregatedRouter([CoreClient(engine=prefill)], [CoreClient(engine=decode)])
    colocated = CoreClient(engine=engines["colocated"])
    router.start()
    colocated.start()
    try:
        prompts = _prompts(prefill.tokenizer)
        want = asyncio.run(_run(colocated, prompts))
        got = asyncio.run(_run(router, prompts))
    finally:
        router.shutdown()
        colocated.shutdown()
    assert got == want
    # every prompt with a full block to move went through the prefill engine
    bs = prefill.blocks.block_size
    moved = [(len(p) - 1) // bs for p in prompts if len(p) > bs]
    assert router.routed == [len(moved), len(prompts)] and len(moved) == 4
    sent = list(router.transfers)
    assert [t.blocks for t in sent] == moved
    assert all(t.nbytes == t.blocks * sent[0].nbytes // sent[0].blocks for t in sent)
    # what the decode engine holds under each hash is what the prefill engine wrote
    for p in prompts:
        for h in prefix_hashes(p[: (len(p) - 1) // bs * bs], bs):
            ours, theirs = decode.blocks.cached(h, 0), prefill.blocks.cached(h, 0)
            assert ours is not None and theirs is not None
            for a, b in zip(_rows(decode.pool, ours), _rows(prefill.pool, theirs), strict=True):
                assert torch.equal(a, b)
    # both prefix caches found the shared system prompt: the prefill engine computed it
    # once, and the decode engine read it once and found the rest of the repeat cached
    assert prefill.blocks.prefix.hit_tokens >= 2 * (len(prompts[0]) // bs - 1) * bs
    assert decode.blocks.prefix.hit_tokens > prefill.blocks.prefix.hit_tokens


def test_a_file_of_another_layout_is_refused_and_a_block_cached_already_is_kept(engines):
    prefill, decode = engines["prefill"], engines["decode"]
    prompt = prefill.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    prefill.add_request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=1))
    while prefill.has_unfinished():
        prefill.step()
    kv = export_prefix(prefill, prompt, None)
    try:
        assert len(kv.hashes) == (len(prompt) - 1) // prefill.blocks.block_size
        assert os.path.getsize(kv.path) == kv.nbytes
        assert import_prefix(decode, kv) == len(kv.hashes)
        assert import_prefix(decode, kv) == 0  # cached already: nothing is overwritten
        kv.block_bytes += 2
        with pytest.raises(ValueError, match="same model, dtype and block size"):
            import_prefix(decode, kv)
    finally:
        os.unlink(kv.path)


def test_serve_disaggregated_answers_as_one_engine_and_stops_cleanly(engines):
    """`tokenworks serve --disaggregate prefill=1,decode=1`: the official OpenAI client gets
    a colocated engine's greedy completion of a long prompt; /metrics shows the request on
    the prefill engine (0) and the decode engine (1); SIGTERM stops all with exit 0."""
    import signal

    import httpx
    import openai
    from test_server_shutdown import Served

    colocated = engines["colocated"]
    prompt = colocated.tokenizer.encode("Once upon a time, in a land far away, " * 12)
    seq = colocated.add_request(prompt_token_ids=prompt, params=GREEDY)
    while colocated.has_unfinished():
        colocated.step()
    srv = Served("--disaggregate", "prefill=1,decode=1", model="smollm2-135m")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        out = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=12,
                                        temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert out.choices[0].text == colocated.tokenizer.decode(seq.output_ids)
        metrics = httpx.get(srv.url + "/metrics").text
        for engine in ("0", "1"):
            assert f'engine="{engine}",finished_reason="length"' in metrics
        srv.signal(signal.SIGTERM, group=False)
        assert srv.exit_code(timeout=30) == 0, "".join(srv.output)
    finally:
        srv.close()


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"disaggregate": "prefill=0,decode=1"}, "P and D at least 1"),
        ({"disaggregate": "1,1"}, "give prefill=P,decode=D"),
        ({"disaggregate": "prefill=1,decode=1", "data_parallel_size": 2}, "leave out --data"),
        ({"disaggregate": "prefill=1,decode=1", "engine_process": False}, "engine cores"),
    ],
)
def test_a_bad_split_says_what_to_give(kw, says):
    from tokenworks.serve.serve_config import ServeConfig

    with pytest.raises(ValueError, match=says):
        ServeConfig(**kw)
    assert ServeConfig(disaggregate="prefill=2, decode=3").disaggregation == (2, 3)
