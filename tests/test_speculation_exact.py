"""Speculation never changes the greedy text, in every configuration the engine accepts: an
engine with speculation computes on its batch-invariant path (the C kernels' whole step,
or torch's fixed tiles where those cannot run the model), so a verify row is computed as a
decode row; where no invariant path exists, the configuration is refused at start-up.

The reference is plain greedy on the same path (batch_invariant on, no speculation): each
sequence's own greedy tokens, whatever else shares its batch."""

from __future__ import annotations

import pytest
from test_architectures import _loaded, hf_model

from tokenworks import LLM, SamplingParams
from tokenworks.config import EngineConfig

CODE = (
    "def area(width, height):\n    return width * height\n\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\n\n"
    "Repeat the two functions above exactly, with a docstring added to each:\n"
)
STORY = "Once upon a time, there was a little"
GREEDY = SamplingParams(max_tokens=40, temperature=0)
SMOL = {  # the default model's configurations, by what they run on
    "default": {},
    "float32 on the file's blocks": {"dtype": "float32"},
    "float32 dequantised": {"dtype": "float32", "quantization": "none"},
}


def _ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "adaptive": False}


def _texts(llm, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name", sorted(SMOL))
def test_ngram_speculation_keeps_the_default_models_greedy_text(smol_loaded, name):
    kw = dict(loaded=smol_loaded, threads=2, max_num_seqs=4, warmup=False) | SMOL[name]
    plain = _texts(LLM("smollm2-135m", batch_invariant=True, **kw), [CODE, STORY])
    for k in (1, 4, 8):
        llm = LLM("smollm2-135m", speculative_config=_ngram(k), **kw)
        assert llm.engine.invariance in ("kernels", "torch")
        assert _texts(llm, [CODE, STORY]) == plain, (name, k)


def test_a_draft_model_keeps_the_greedy_text_in_float32_on_the_files_blocks(smol_loaded):
    kw = dict(loaded=smol_loaded, threads=2, max_num_seqs=4, warmup=False, dtype="float32")
    plain = _texts(LLM("smollm2-135m", batch_invariant=True, **kw), [CODE, STORY])
    draft = {"model": "smollm2-135m", "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM("smollm2-135m", speculative_config=draft, draft=smol_loaded, **kw)
    assert _texts(llm, [CODE, STORY]) == plain


@pytest.fixture(scope="module", params=["mixtral", "deepseek-v2-lite"])
def random_family(request, tmp_path_factory):
    """A random-weight MoE model (Mixtral) and one with latent attention and experts
    (DeepSeek-V2-Lite's shape), saved as Hugging Face saves them."""
    path = tmp_path_factory.mktemp(f"spec-{request.param}")
    hf_model(request.param).save_pretrained(path)
    return request.param, _loaded(path)


def test_ngram_speculation_keeps_the_greedy_text_of_moe_and_latent_attention(random_family):
    name, loaded = random_family
    prompts = [[3, 9, 27, 81, 243] * 4, [100 + i % 7 for i in range(23)]]
    kw = dict(loaded=loaded, dtype="float32", max_num_seqs=4, warmup=False)
    plain = _texts(LLM(str(loaded.model_id), batch_invariant=True, **kw), prompts)
    for k in (1, 4, 8):
        llm = LLM(str(loaded.model_id), speculative_config=_ngram(k), **kw)
        assert llm.engine.invariance == "torch"  # the C pass runs experts between its calls
        assert _texts(llm, prompts) == plain, (name, k)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"batch_invariant": False}, "--no-batch-invariant breaks that"),
        ({"tensor_parallel_size": 2}, "tensor and pipeline parallel ranks"),
        ({"enable_lora": True}, "LoRA adapters' products"),
    ],
)
def test_speculation_where_no_verify_row_is_a_decode_row_is_refused(kw, says):
    with pytest.raises(ValueError, match=says):
        EngineConfig(speculative_config=_ngram(4), **kw)
