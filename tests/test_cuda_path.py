"""The engine's torch path on a CUDA device: everything that is not a C kernel.

Run by benchmarks/gpu_check.sh on a machine with an NVIDIA GPU (no model file travels
there: these use the built-in toy model and random weights); without CUDA they skip.
"""

from __future__ import annotations

import json

import pytest
import torch

from tokenworks import LLM, SamplingParams
from tokenworks.engine.request import StructuredOutput
from tokenworks.models import load

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = ["hello world", "the cat sat on the", "abcabcabcabc", "1 2 3 4 5"]


@pytest.fixture(scope="module")
def toy():
    return load("toy")


def _llm(toy, **kw):
    return LLM("toy", loaded=toy, device="cuda", warmup=False, max_num_seqs=8, **kw)


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_float32_on_cuda_gives_the_cpu_tokens(toy):
    cpu = LLM("toy", loaded=toy, dtype="float32", warmup=False, max_num_seqs=8)
    assert _tokens(_llm(toy, dtype="float32"), PROMPTS) == _tokens(cpu, PROMPTS)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_paged_kv_on_the_device(toy, dtype):
    """The pool lives on the GPU in the model's dtype; solo and batched decoding agree and
    a repeated prompt hits the prefix cache."""
    llm = _llm(toy, dtype=dtype)
    engine = llm.engine
    assert engine.pool.k[0].device.type == "cuda" and engine.pool.k[0].dtype == getattr(
        torch, dtype
    )
    batched = _tokens(llm, PROMPTS)
    assert [_tokens(llm, [p])[0] for p in PROMPTS] == batched
    assert engine.blocks.prefix.hit_tokens > 0


def test_structured_output_on_the_device(toy):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(max_tokens=40, temperature=0, structured=StructuredOutput.json(schema))
    text = _llm(toy, dtype="bfloat16").generate(["json: "], params)[0].outputs[0].text
    assert isinstance(json.loads(text)["a"], int)


def test_speculation_on_the_device_keeps_the_greedy_tokens(toy):
    plain = _tokens(_llm(toy, dtype="float32"), PROMPTS)
    spec = _llm(toy, dtype="float32",
                speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    assert _tokens(spec, PROMPTS) == plain


def test_tiled_attention_and_compile_on_the_device(toy):
    plain = _tokens(_llm(toy, dtype="float32"), PROMPTS)
    assert _tokens(_llm(toy, dtype="float32", attention_tile=16), PROMPTS) == plain
    compiled = _llm(toy, dtype="float32", compile=True)
    assert _tokens(compiled, PROMPTS) == plain
    assert compiled.engine.compile_stats.graphs >= 2


def test_the_server_on_the_device(toy):
    import openai
    from conftest import start_server

    srv = start_server(toy, names=("toy",), device="cuda", dtype="bfloat16")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        out = client.completions.create(model="toy", prompt="hello", max_tokens=8, temperature=0)
        assert out.usage.completion_tokens == 8
    finally:
        srv.stop()
