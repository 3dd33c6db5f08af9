"""The engine's warm-up: one forward pass at the token budget before any request."""

from __future__ import annotations

from tokenworks.engine import core_messages as m
from tokenworks.engine.loop import EngineLoop
from tokenworks.engine.request import SamplingParams

WARMUP_PROMPT = 128  # tokens in each of the warm-up's prompts


def warm_up(engine) -> None:
    """One forward pass at the token budget, on prompts of filler tokens, before any
    request: the heap grows to a big step's peak and oneDNN builds its kernels for
    that shape; without it the first big step of the first requests pays for both.
    vLLM's profile run and llama.cpp's warm-up do the same. Leaves no
    trace: no requests, stats, totals, cached blocks or cache counters."""
    c = engine.config
    length = min(WARMUP_PROMPT, engine.max_model_len - 1, c.max_num_batched_tokens)
    if length < 1:  # a context of one token holds no prompt
        return
    blocks_each = engine.kv_layout.blocks_held(length + 1, c.block_size, length, length)
    n = min(
        c.max_num_batched_tokens // length,
        c.max_num_seqs,
        engine.blocks.num_blocks // blocks_each,
    )
    params = SamplingParams(max_tokens=1, temperature=0)
    if engine.blocks.prefix is not None:  # the same filler under salts of its own, on
        engine.blocks.prefix.warned = True  # purpose: no warning (reset_counts clears it)
    loop = EngineLoop(engine)
    for i in range(n):  # each under a salt of its own: computed, none a hit of another
        loop.add(m.AddRequest(f"warmup-{i}", [0] * length, params, cache_salt=f"warmup-{i}"))
    loop.run_while(engine.has_unfinished)
    engine.blocks.reset_prefix_cache()
    engine.blocks.reset_counts()
    engine.pool.discard()  # the filler's K/V: nobody reads it, and it held resident pages
    if engine.workers is not None:
        engine.workers.discard()
    engine.blocks.forget_touched()
    engine.step_log.reset()
