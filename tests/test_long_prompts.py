"""Prompts longer than a step's token budget through the real model, on every kernel path
this CPU has: the first chunks of such a prompt sample nothing, so a step may have no row
that needs logits. Alone (nothing else running) and beside running decodes."""

from __future__ import annotations

import pytest

from tokenworks import LLM, SamplingParams
from tokenworks.kernels import products

PATHS = ["default", "variant", "vector", "unpacked", "torch"]


@pytest.fixture(params=PATHS)
def long_llm(request, smol_loaded):
    """A bfloat16 engine on the real weights whose products run: as this CPU does by
    default (batch-invariant rows of the whole step), without batch invariance
    (--no-batch-invariant: the products by batch size and the prompt attention kernel), so
    too as AVX-512 BF16 dot products on a CPU with tiles, on torch's products with the
    packed ones off (--no-packed-products), or on the torch modules alone (--kernels
    torch)."""
    path = request.param
    if path == "vector" and not products.tiles_granted():
        pytest.skip("the default already ran the vector products, or none run here")
    if path == "unpacked" and not products.packed_built():
        pytest.skip("the default already ran without packed products")
    kw = dict(dtype="bfloat16", loaded=smol_loaded, threads=2, warmup=False)
    kw |= dict(kv_cache_memory=0.5, max_num_seqs=8, kernels="torch" if path == "torch" else "auto")
    kw |= dict(
        packed_products=path != "unpacked", batch_invariant=None if path == "default" else False
    )
    if path == "vector":
        with products.vector_products():
            yield LLM("smollm2-135m", **kw)
        return
    yield LLM("smollm2-135m", **kw)


def _prompt(llm, tokens: int) -> list[int]:
    words = llm.tokenizer.encode(" the river runs past the mill and on to the sea" * 900)
    return words[:tokens]


GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


LONGEST = 4100  # past two step budgets (2,048 tokens each)


@pytest.mark.parametrize("tokens", [2049, LONGEST])  # past one step budget, past two
def test_a_long_prompt_alone(long_llm, tokens):
    if tokens == LONGEST and long_llm.config.kernels == "torch":
        pytest.skip(f"{LONGEST:,} tokens on the torch modules: the 2,049 case covers that path")
    if tokens == LONGEST and long_llm.config.batch_invariant is None:
        pytest.skip(
            f"{LONGEST:,} tokens as invariant rows (each row attends alone, so the cost grows "
            "with the square of the prompt): the 2,049 case covers that path"
        )
    out = long_llm.generate([_prompt(long_llm, tokens)], GREEDY, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == tokens
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"
    long_llm.engine.blocks.check()
    assert long_llm.engine.blocks.usage == 0


def test_a_long_prompt_beside_running_decodes(long_llm):
    engine = long_llm.engine
    decoding = [
        engine.add_request(prompt=f"Count from {i}:", params=SamplingParams(
            max_tokens=40, temperature=0, ignore_eos=True))
        for i in range(3)
    ]  # fmt: skip
    for _ in range(3):
        engine.step()  # they are decoding when the long prompt arrives
    long = engine.add_request(prompt_token_ids=_prompt(long_llm, 2049), params=GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert len(long.output_ids) == 3
    assert all(len(s.output_ids) == 40 for s in decoding)
    engine.blocks.check()
