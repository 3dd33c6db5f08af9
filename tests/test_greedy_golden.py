"""Greedy tokens of the default model on a fixed prompt set, against a committed record.

The record (tests/data/greedy_golden.json) holds, per dtype and per product path, the
tokens each prompt gets alone and all of them batched together. bfloat16 results depend on
the order of the float32 sums, so each path has its own entry: "tiles" (AMX), "vector"
(the packed products as AVX-512 BF16 dot products on a CPU with tiles, whose prompt
attention still runs on tiles), "vector-only" (AVX-512 BF16 without AMX) and "none" (no
AVX-512 BF16: torch's products, as on an AVX2 CPU); a path with no entry yet is skipped, and
`python tests/test_greedy_golden.py` adds entries for the paths this CPU runs (it never
replaces one).
"""

from __future__ import annotations

import contextlib
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
    """Which packed products this CPU runs by default: tiles, vector-only or none."""
    from tokenworks.kernels import products

    if products.tiles_granted():
        return "tiles"
    return "vector-only" if products.packed_built() else "none"


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
    """(dtype, path) pairs this CPU can run: float32 on torch's products; bfloat16 on the
    default packed products, and on the vector ones too where the default is tiles."""
    out = [("float32", "torch"), ("bfloat16", products_path())]
    if out[1][1] == "tiles":
        out.append(("bfloat16", "vector"))
    return out


def products(path: str):
    from tokenworks.kernels import products

    return products.vector_products() if path == "vector" else contextlib.nullcontext()


@pytest.mark.parametrize("dtype,path", [("float32", "torch"), ("bfloat16", "default"),
                                        ("bfloat16", "vector")])  # fmt: skip
def test_greedy_tokens_match_the_record(smol_loaded, dtype, path):
    import torch

    golden = json.loads(GOLDEN.read_text())
    torch.set_num_threads(THREADS)
    if path == "default":
        path = products_path()
    elif path == "vector" and products_path() != "tiles":
        pytest.skip("the default path already is the vector products here, or none runs")
    key = f"{dtype}/{path}"
    if key not in golden:
        pytest.skip(f"no record of {key} yet (python tests/test_greedy_golden.py adds it)")
    with products(path):
        got = run(smol_loaded, dtype)
    assert got == golden[key]


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
        with products(path):
            golden[key] = run(loaded, dtype)
        print(f"{key}: recorded")
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
