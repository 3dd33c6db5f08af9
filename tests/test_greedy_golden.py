"""Greedy tokens of the default model on a fixed prompt set, against a committed record.

The record (tests/data/greedy_golden.json) holds, per dtype and per product path, the
tokens each prompt gets alone and all of them batched together. bfloat16 results depend on
the order of the float32 sums, so each path has its own entry, named for the dot products
the batch-invariant whole step multiplies with: "avx512-bf16" (AVX-512 BF16, inputs
rounded to bfloat16), "avx2" (AVX2 FMAs on float32 inputs) or "plain" (C loops); a path
with no entry yet is skipped, and `python tests/test_greedy_golden.py` adds entries for the
path this CPU runs (it never replaces one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "data" / "greedy_golden.json"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4,",
    "Translate to French: good morning, my friend.",
    "A list of the planets of the solar system, in order from the Sun: Mercury, Venus,",
]
MAX_TOKENS = 24
THREADS = 2


def products_path() -> str:
    """Which dot products this CPU's kernels multiply bfloat16 with."""
    from tokenworks.bench.peer_engines import cpu_flags
    from tokenworks.kernels import products

    if products.packed_built():
        return "avx512-bf16"
    return "avx2" if {"avx2", "fma"} <= cpu_flags() else "plain"


def run(loaded, dtype: str) -> dict:
    """{"solo": tokens of each prompt alone, "batched": the same prompts all at once}."""
    from tokenworks import LLM, SamplingParams

    llm = LLM(
        "smollm2-135m", dtype=dtype, quantization="none", loaded=loaded, threads=THREADS,
        max_num_seqs=8, kv_cache_memory=0.25,
    )  # fmt: skip
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    solo = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return {"solo": [list(t) for t in solo], "batched": [list(t) for t in batched]}


def cases() -> list[tuple[str, str]]:
    """(dtype, path) pairs this CPU runs: float32 on torch's products, bfloat16 on the
    kernels' dot products."""
    return [("float32", "torch"), ("bfloat16", products_path())]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_match_the_record(smol_loaded, dtype):
    import torch

    golden = json.loads(GOLDEN.read_text())
    torch.set_num_threads(THREADS)
    key = f"{dtype}/{dict(cases())[dtype]}"
    if key not in golden:
        pytest.skip(f"no record of {key} yet (python tests/test_greedy_golden.py adds it)")
    got = run(smol_loaded, dtype)
    assert got == golden[key]
    if dtype == "bfloat16":  # batch-invariant by default: together as alone
        assert got["batched"] == got["solo"]


if __name__ == "__main__":
    import torch

    from tokenworks.models import load

    torch.set_num_threads(THREADS)
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    loaded = load("smollm2-135m")
    for dtype, path in cases():
        key = f"{dtype}/{path}"
        if key in golden:
            print(f"{key}: recorded already, left as it is")
            continue
        golden[key] = run(loaded, dtype)
        print(f"{key}: recorded")
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
