"""--compile (models/compiled.py): the eager tokens, from a bounded number of graphs."""

from __future__ import annotations

import pytest

from tokenworks import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far"]


@pytest.fixture(scope="module")
def engines(smol_loaded):
    kw = dict(loaded=smol_loaded, dtype="float32", quantization="none", warmup=False,
              max_num_seqs=8, max_num_batched_tokens=64)  # fmt: skip
    return LLM("smollm2-135m", **kw), LLM("smollm2-135m", compile=True, **kw)


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_compiled_layers_give_the_eager_greedy_tokens_solo_and_batched(engines):
    eager, compiled = engines
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = _tokens(eager, PROMPTS, params)
    assert [_tokens(compiled, [p], params)[0] for p in PROMPTS] == want
    assert _tokens(compiled, PROMPTS, params) == want
    stats = compiled.engine.compile_stats
    assert stats.layers == compiled.engine.spec.n_layers
    assert stats.graphs >= 2 and stats.seconds > 0


def test_recompiles_stay_bounded_over_mixed_batch_sizes(engines):
    """Requests arriving while others decode make steps of 1 to 64 tokens (prompt chunks
    beside decodes, batches of 1 to 8): the layers' two halves compile one graph for a
    single token and one for any other count, whatever the mix."""
    _, compiled = engines
    engine = compiled.engine
    sizes = set()
    for i in range(9):
        n = 1 + (7 * i) % 40
        engine.add_request(prompt_token_ids=list(range(5, 5 + n)),
                           params=SamplingParams(max_tokens=3 + i % 5, temperature=0))  # fmt: skip
        for _ in range(i % 3):
            engine.step()
            sizes.add(_last_step_tokens(engine))
    while engine.has_unfinished():
        engine.step()
        sizes.add(_last_step_tokens(engine))
    assert len(sizes) >= 8 and 1 in sizes and max(sizes) > 8, sizes
    stats = compiled.engine.compile_stats
    assert stats.graphs <= 4, stats.to_dict()


def _last_step_tokens(engine) -> int:
    last = engine.stats[-1]
    return last.prefill_tokens + last.decode_tokens


def test_compile_refuses_weights_it_cannot_trace(smol_loaded):
    with pytest.raises(ValueError, match="add --quantization none"):
        LLM("smollm2-135m", loaded=smol_loaded, compile=True, warmup=False)
    with pytest.raises(ValueError, match="drop --kernels c"):
        LLM("smollm2-135m", loaded=smol_loaded, compile=True, kernels="c", warmup=False)
