"""GGUF files as llama.cpp's own converter writes them today: a random-weight transformers
model of each family, with a real vocabulary, converted by the pinned sources'
convert_hf_to_gguf.py in float32, loaded by tokenworks and held to transformers' greedy
tokens and logits; and again in Q8_0 as the converter quantises it, held to the f32 file's
values within the format's step. (Greedy tokens are no oracle for a quantised file of
random weights: their logits are close enough that a step's rounding reorders them.)

The configs are test_architectures' with what real checkpoints' config.json carry where
the converter reads it: DeepSeek V3's `scoring_func` (without it the file says softmax
routing, and llama.cpp and tokenworks run softmax where transformers runs sigmoid), a query
scale equal to the head size for Gemma (a GGUF has no query_pre_attn_scalar: llama.cpp
uses the head size), no window for Mistral (the converter writes none: llama.cpp runs a
Mistral file with full attention), and Gemma 3's windowed layers on a RoPE base of their
own, the `rope.freq_base_swa` every converted Gemma 3 file carries. Converted files are
kept under $TOKENWORKS_HOME, keyed by everything they are made from.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch
from test_architectures import CONFIGS, sharpen

from tokenworks import LLM, SamplingParams
from tokenworks.bench.llama_cpp_sources import VERSION
from tokenworks.models import build_model, load
from tokenworks.ops.attention import AttentionMetadata

transformers = pytest.importorskip("transformers")


_SMALL_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "max_position_embeddings")  # fmt: skip


def _small() -> dict:
    return {k: v for k, v in CONFIGS["llama-gqa"]().to_dict().items() if k in _SMALL_KEYS}


def _gemma3_own_swa_base():
    cfg = CONFIGS["gemma3"]()
    cfg.rope_parameters["sliding_attention"]["rope_theta"] = 5e4
    return cfg


# Granite's four multipliers, none of them 1 (nor the attention's head_dim**-0.5)
_GRANITE = dict(embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.2,
                logits_scaling=2.5)  # fmt: skip


def _granite_moe():
    return transformers.GraniteMoeSharedConfig(
        **_small() | {"intermediate_size": 48}, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=64, **_GRANITE)  # fmt: skip


def _ministral3():
    """YaRN eight times a trained context of 8 positions, so the queries' temperature grows
    within the test's tokens, and an mscale_all_dim of its own."""
    rope = dict(type="yarn", rope_theta=1e6, factor=8.0, original_max_position_embeddings=8,
                max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0, mscale_all_dim=0.5,
                mscale=1.0, llama_4_scaling_beta=0.3)  # fmt: skip
    return transformers.Ministral3Config(
        **_small() | {"max_position_embeddings": 64}, num_key_value_heads=2, head_dim=16,
        rope_parameters=rope)  # fmt: skip


def _llama4():
    """Four layers: the fourth without RoPE, the second and fourth MoE (one expert of four
    a token, and the shared one), Llama 3's RoPE scaling."""
    rope = dict(rope_type="llama3", rope_theta=5e5, factor=16.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=32)  # fmt: skip
    return transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=48, intermediate_size_mlp=112, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2, max_position_embeddings=64,
        rope_parameters=rope)  # fmt: skip


def _deepseek_v3_sigmoid():
    cfg = CONFIGS["deepseek-v3"]()
    cfg.scoring_func, cfg.topk_method = "sigmoid", "noaux_tc"
    return cfg


SENTENCEPIECE = "sentencepiece"  # a SentencePiece model trained here (Gemma 2's converter
# reads tokenizer.model only)
# family -> (its config, the llama.cpp vocabulary its tokenizer is read from; transformers
# picks Qwen2's splitting for any tokenizer beside a Qwen2 config, so those get Qwen2's)
FAMILIES = {
    "llama": (CONFIGS["llama-gqa"], "gpt-2"),
    "mistral": (lambda: transformers.MistralConfig(**_small(), num_key_value_heads=1), "gpt-2"),
    "qwen2": (CONFIGS["qwen2-bias"], "qwen2"),
    "qwen3": (CONFIGS["qwen3"], "gpt-2"),
    "gemma3": (_gemma3_own_swa_base, "gpt-2"),
    # the converter writes sliding_window 0 for a Phi-3 without one
    "phi3": (lambda: transformers.Phi3Config(**_small(), num_key_value_heads=2, pad_token_id=0),
             "gpt-2"),
    "phi3-window": (CONFIGS["phi3-window"], "gpt-2"),
    "olmo2": (CONFIGS["olmo2"], "gpt-2"),
    "gemma2": (CONFIGS["gemma2"], SENTENCEPIECE),
    "smollm3": (CONFIGS["smollm3"], "gpt-2"),
    "mixtral": (CONFIGS["mixtral"], "gpt-2"),
    "qwen3-moe": (CONFIGS["qwen3-moe"], "gpt-2"),
    "qwen2-moe": (CONFIGS["qwen2-moe"], "qwen2"),
    "gpt-oss": (CONFIGS["gpt-oss"], "gpt-2"),
    "deepseek-v2-lite": (CONFIGS["deepseek-v2-lite"], "gpt-2"),
    "deepseek-v3": (_deepseek_v3_sigmoid, "gpt-2"),
    "granite": (lambda: transformers.GraniteConfig(**_small(), num_key_value_heads=2, **_GRANITE),
                "gpt-2"),
    "granite-moe": (_granite_moe, "gpt-2"),
    "ministral3": (_ministral3, "gpt-2"),
    "llama4": (_llama4, "gpt-2"),
}  # fmt: skip
PROMPT = "Once upon a time, there was a little"


def _config(name: str, vocab_size: int):
    cfg = FAMILIES[name][0]()
    cfg.vocab_size = vocab_size
    if hasattr(cfg, "query_pre_attn_scalar"):
        cfg.query_pre_attn_scalar = cfg.head_dim
    cfg._attn_implementation = "eager"
    return cfg


def _sentencepiece(sources) -> str:
    """A 512-piece SentencePiece BPE model (with byte fallback, as Gemma's), trained in a
    moment on llama.cpp's tokenizer test texts; its bytes as hex."""
    import io

    import sentencepiece

    lines = [line for path in sorted((sources / "models").glob("ggml-vocab-*.gguf.inp"))
             for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
             and "__ggml_vocab_test__" not in line]  # fmt: skip
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=512, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, add_dummy_prefix=False,
        remove_extra_whitespaces=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], minloglevel=2,
    )  # fmt: skip
    return model.getvalue().hex()


@pytest.fixture(scope="module")
def converted(llama_cpp_sources, tmp_path_factory):
    """name -> (the transformers model, the GGUF llama.cpp's converter wrote of it)."""
    from tokenworks import paths

    tokenizers = {}
    made = {}

    def make(name):
        if name in made:
            return made[name]
        vocab = FAMILIES[name][1]
        if vocab not in tokenizers:
            tokenizers[vocab] = (
                _sentencepiece(llama_cpp_sources) if vocab == SENTENCEPIECE
                else transformers.AutoTokenizer.from_pretrained(
                    llama_cpp_sources / "models", gguf_file=f"ggml-vocab-{vocab}.gguf")
            )  # fmt: skip
        tok = tokenizers[vocab]
        size = 512 if vocab == SENTENCEPIECE else len(tok)
        cfg = _config(name, size)
        made_of = tok if vocab == SENTENCEPIECE else vocab
        key = hashlib.sha256(json.dumps(
            [name, str(made_of), cfg.to_json_string(), VERSION, transformers.__version__,
             "sharpened"]).encode()).hexdigest()[:16]  # fmt: skip
        home = paths.home() / "converted-families" / f"{name}-{key}"
        gguf_path = home / "model-f32.gguf"
        if not gguf_path.exists():
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
            sharpen(model)
            scratch = tmp_path_factory.mktemp(name)
            model.save_pretrained(scratch / "hf")
            if vocab == SENTENCEPIECE:
                (scratch / "hf" / "tokenizer.model").write_bytes(bytes.fromhex(tok))
            else:
                tok.save_pretrained(scratch / "hf")
            out = subprocess.run(
                [sys.executable, str(llama_cpp_sources / "convert_hf_to_gguf.py"),
                 str(scratch / "hf"), "--outtype", "f32", "--outfile", str(scratch / "m.gguf")],
                capture_output=True, text=True,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr[-2000:]
            home.mkdir(parents=True, exist_ok=True)
            (scratch / "hf").rename(home / "hf")
            (scratch / "m.gguf").rename(gguf_path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            home / "hf", dtype=torch.float32, attn_implementation="eager"
        ).eval()
        made[name] = (hf, gguf_path)
        return made[name]

    return make


@pytest.fixture(scope="module")
def quantised(converted, llama_cpp_sources, tmp_path_factory):
    """name -> the f32 file and the Q8_0 one llama.cpp's converter writes of the same model
    (`--outtype q8_0`, gguf-py's quantiser, the C one's equal)."""

    def make(name):
        f32 = converted(name)[1]
        q8 = f32.with_name("model-q8_0.gguf")
        if not q8.exists():
            scratch = tmp_path_factory.mktemp(f"{name}-q8") / "m.gguf"
            out = subprocess.run(
                [sys.executable, str(llama_cpp_sources / "convert_hf_to_gguf.py"),
                 str(f32.parent / "hf"), "--outtype", "q8_0", "--outfile", str(scratch)],
                capture_output=True, text=True,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr[-2000:]
            scratch.rename(q8)
        return f32, q8

    return make


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_converted_file_runs_as_transformers_runs_the_model(converted, name):
    hf, path = converted(name)
    loaded = load(str(path))
    llm = LLM(str(path), dtype="float32", quantization="none", loaded=loaded, warmup=False,
              block_size=4)  # fmt: skip
    prompt = llm.tokenizer.encode(PROMPT)
    want, ids = [], list(prompt)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0]
        for _ in range(12):
            want.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(want[-1])
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    assert (list(out.token_ids), out.finish_reason) == (want, "length"), name
    model = build_model(loaded.spec, loaded.weights, torch.float32, "cpu")
    n = len(prompt)
    with torch.no_grad():
        ours = model(torch.tensor(prompt), torch.arange(n), AttentionMetadata.single(n))
    assert (ours - logits).abs().max().item() < 1e-4, name


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_q8_0_file_from_the_converter_holds_its_blocks_values(quantised, name):
    """Each weight the Q8_0 file holds is the f32 file's within about half a quantisation
    step (a block's largest value / 127, the step itself stored in f16: 127 steps of its
    rounding more), norms and other vectors exactly (the converter keeps them in f32); and
    the file generates through the engine's own kernels."""
    f32, q8 = quantised(name)
    weights = {}
    for path in (f32, q8):
        loaded = load(str(path))
        model = build_model(loaded.spec, loaded.weights, torch.float32, "cpu")
        weights[path] = model.state_dict()
    exact, blocked = weights[f32], weights[q8]
    assert exact.keys() == blocked.keys(), name
    for key, w in exact.items():
        step = w.abs().max().item() / 127
        err = (blocked[key] - w).abs().max().item()
        assert err <= (0 if w.dim() == 1 else 0.6 * step), (name, key, err, step)
    llm = LLM(str(q8), warmup=False, block_size=4)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = llm.generate([llm.tokenizer.encode(PROMPT)], greedy, use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (4, "length"), name
