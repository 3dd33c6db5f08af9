"""The default model (SmolLM2-135M, Q4_1 GGUF) against transformers and the float64 oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenworks import SamplingParams
from tokenworks.models import reference
from tokenworks.ops.attention import AttentionMetadata

# Ordinary English text: random token ids make pathological activations, where float32
# itself (ours and transformers' alike) strays ~1e-3 from the float64 oracle.
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp "
    "and a notebook in which he wrote down the colour of the sea, the direction of the wind "
    "and the names of the ships that passed. In winter the storms came from the north, and "
    "the waves broke so high against the rocks that salt crusted the windows of the tower. "
    "His daughter, who had grown up on the island, knew every sound the building made: the "
    "groan of the iron railings, the hum of the great lens turning, the patter of rain on "
    "the copper roof. When she was twelve she began to keep her own notebook, recording "
    "the birds that rested on the gallery during their long migrations, and the number of "
    "days between the supply boat's visits. Years later, long after the light had been "
    "automated and the keepers sent ashore, those two notebooks were found together in a "
    "drawer of the museum on the mainland, and read side by side they told the story of "
    "an island, a family and a century of weather. "
)


def text_ids(llm, n):
    ids = llm.tokenizer.encode(TEXT * 2)
    assert len(ids) >= n
    return ids[:n]


def engine_logits(llm, ids):
    return llm.engine.runner.run_uncached(ids)


@pytest.mark.parametrize("n", [1, 7, 64, 256])
def test_float32_logits_match_transformers_on_the_same_gguf(smol_llm, hf_smol, n):
    ids = text_ids(smol_llm, n)
    ours = engine_logits(smol_llm, ids)
    with torch.no_grad():
        theirs = hf_smol(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-3


@pytest.mark.parametrize("n", [1, 24])
def test_float32_logits_match_the_float64_reference(smol_llm, smol_loaded, n):
    ids = text_ids(smol_llm, n)
    ours = engine_logits(smol_llm, ids).double().numpy()
    oracle = reference.forward(ids, smol_loaded.weights, smol_loaded.spec)
    assert np.abs(ours - oracle).max() < 1e-3


def hf_greedy(hf, ids, n):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


PROMPTS = [
    "Once upon a time, there was a little",
    "The three primary colours are",
    "def fibonacci(n):\n",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_64_tokens_equal_transformers(smol_llm, hf_smol, prompt):
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    ours = smol_llm.generate([prompt], params)[0].outputs[0].token_ids
    ids = smol_llm.tokenizer.encode(prompt)
    assert ours == hf_greedy(hf_smol, ids, 64)


def test_greedy_chat_templated_equals_transformers(smol_llm, hf_smol):
    messages = [{"role": "user", "content": "Name three fruits."}]
    prompt = smol_llm.render_chat(messages)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    ours = smol_llm.chat(messages, params)[0].outputs[0].token_ids
    assert ours == hf_greedy(hf_smol, smol_llm.tokenizer.encode(prompt), 64)


def test_the_documented_continuation(smol_llm):
    params = SamplingParams(max_tokens=20, temperature=0)
    text = smol_llm.generate("Once upon a time, there was a little", params)[0].outputs[0].text
    assert text.startswith(" girl named Emma who loved to play in the sun.")


def test_kv_cache_and_full_recompute_pick_the_same_tokens(smol_llm):
    ids = smol_llm.tokenizer.encode("The quick brown fox")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    cached = smol_llm.generate([ids], params)[0].outputs[0].token_ids
    seq = list(ids)
    for _ in range(24):
        seq.append(int(engine_logits(smol_llm, seq)[-1].argmax()))
    assert cached == seq[len(ids) :]


def test_a_batch_gives_the_same_tokens_as_one_by_one(smol_llm):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    batch = [o.outputs[0].token_ids for o in smol_llm.generate(PROMPTS, params)]
    single = [smol_llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    assert batch == single


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_bfloat16_int8_and_int4_stay_close_to_the_oracle(smol_llm, smol_loaded, quantization):
    from tokenworks.models import build_model

    model = build_model(smol_loaded.spec, smol_loaded.weights, torch.bfloat16, "cpu", quantization)
    ids = text_ids(smol_llm, 32)
    with torch.no_grad():
        lo = model(torch.tensor(ids), torch.arange(32), AttentionMetadata.single(32))
    oracle = reference.forward(ids, smol_loaded.weights, smol_loaded.spec)
    top_ours, top_ref = lo.argmax(-1).numpy(), oracle.argmax(-1)
    assert (top_ours == top_ref).mean() > 0.8


@pytest.mark.parametrize("keep_index", [True, False])  # from the kept index; the GGUF
def test_a_read_without_weights_gives_the_same_spec_and_tokenizer(smol_loaded, keep_index):
    from tokenworks.models import load

    bare = load("smollm2-135m", weights=False, keep_index=keep_index)
    assert bare.weights == {} and bare.spec == smol_loaded.spec
    assert bare.tokenizer_source == smol_loaded.tokenizer_source
    assert bare.chat_template == smol_loaded.chat_template
