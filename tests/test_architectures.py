"""Random-weight models built with transformers (no download) against the engine and oracle.

Each config is saved as a Hugging Face directory (config.json + safetensors) and loaded by
the engine's own loader, so the directory path of the loader is tested too. The families
added with the architecture registry (Qwen3, Gemma 2 and 3, Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V2 and V3)
are built with sharper weights than transformers' initialisation: matrices x5, norms and
biases (DeepSeek's routing bias included) drawn at random, so attention is peaked and the
routers' choices are decisive rather than near ties.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from tokenworks.models import build_model, load, reference
from tokenworks.models.gguf_file import PERMUTED_QK
from tokenworks.ops.attention import AttentionMetadata

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
)


def _deepseek_v3(**extra):
    return transformers.DeepseekV3Config(
        **SMALL,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        routed_scaling_factor=2.5,
        **extra,
    )  # fmt: skip


def _deepseek_v2_lite(**extra):
    return transformers.DeepseekV2Config(
        **SMALL,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        n_shared_experts=2,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        routed_scaling_factor=1.5,
        **extra,
    )  # fmt: skip


def _yarn(mscale: float) -> dict:
    """A DeepSeek checkpoint's YaRN (factor 40), over 32 original positions."""
    return {
        "type": "yarn", "factor": 40.0, "original_max_position_embeddings": 32, "beta_fast": 32,
        "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale,
    }  # fmt: skip


CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=256
    ),
    "llama-gqa": lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=2, rope_theta=5e5),
    "llama3-rope-scaling": lambda: transformers.LlamaConfig(
        **SMALL,
        num_key_value_heads=2,
        rope_theta=5e5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2-bias": lambda: transformers.Qwen2Config(**SMALL, num_key_value_heads=2),
    # RoPE scaled for longer contexts: the prompts of 64 tokens run past the trained 32
    # (linear: the config's context is already the interpolated one, as in real configs)
    "rope-linear": lambda: transformers.LlamaConfig(
        **SMALL | {"max_position_embeddings": 128},
        num_key_value_heads=2,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    ),  # fmt: skip
    "rope-yarn": lambda: transformers.Qwen2Config(
        **SMALL,
        num_key_value_heads=2,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    ),  # fmt: skip
    "mistral-window": lambda: transformers.MistralConfig(
        **SMALL, num_key_value_heads=1, sliding_window=8
    ),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=16),
    "mixtral": lambda: transformers.MixtralConfig(
        **SMALL, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2
    ),
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(
        **SMALL,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),  # fmt: skip
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),  # fmt: skip
    "deepseek-v3": lambda: _deepseek_v3(),
    "deepseek-v2-lite": lambda: _deepseek_v2_lite(),
    # every real V2-Lite / V3 checkpoint scales RoPE with YaRN (and the softmax by mscale)
    "deepseek-v3-yarn": lambda: _deepseek_v3(rope_scaling=_yarn(1.0)),
    "deepseek-v2-lite-yarn": lambda: _deepseek_v2_lite(rope_scaling=_yarn(0.707)),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SMALL | {"num_hidden_layers": 6},
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=24,
    ),  # fmt: skip
    "gemma3-global-rope-linear": lambda: transformers.Gemma3TextConfig(
        **SMALL | {"num_hidden_layers": 6},
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),  # fmt: skip
    "gemma2": lambda: transformers.Gemma2Config(
        **SMALL | {"num_hidden_layers": 4},
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=24,
    ),  # fmt: skip
    # as the 2B and 9B models are (a GGUF carries no query scalar: llama.cpp's head_dim)
    "gemma2-head-dim-scale": lambda: transformers.Gemma2Config(
        **SMALL | {"num_hidden_layers": 4},
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=16,
    ),  # fmt: skip
    "phi3-window": lambda: transformers.Phi3Config(
        **SMALL, num_key_value_heads=2, sliding_window=8, pad_token_id=0
    ),
    # gpt-oss's YaRN (factor 8 here, over 32 trained positions; the ramp not rounded)
    "gpt-oss": lambda: transformers.GptOssConfig(
        **SMALL | {"num_hidden_layers": 4, "intermediate_size": 128},  # (whole MXFP4 blocks)
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 32,
            "rope_theta": 150000.0,
        },
    ),  # fmt: skip
    "olmo2": lambda: transformers.Olmo2Config(**SMALL, num_key_value_heads=2, pad_token_id=0),
    "smollm3": lambda: transformers.SmolLM3Config(
        **SMALL | {"num_hidden_layers": 4}, num_key_value_heads=2, pad_token_id=0
    ),
}
SHARPENED = {
    "qwen3", "mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v3", "deepseek-v2-lite", "gemma3",
    "gemma2", "rope-linear", "rope-yarn", "gemma3-global-rope-linear", "deepseek-v3-yarn",
    "deepseek-v2-lite-yarn", "gemma2-head-dim-scale", "phi3-window", "smollm3", "olmo2",
    "gpt-oss",
}  # fmt: skip
MOE = {
    "gpt-oss", "mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v3", "deepseek-v2-lite",
    "deepseek-v3-yarn", "deepseek-v2-lite-yarn",
}  # fmt: skip


def sharpen(model) -> None:
    """Matrices x5; norms ~ 1 + N(0, 0.3) and biases ~ N(0, 0.3), routing bias too."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in name or "bias" in name:
                noise = torch.randn(p.shape, generator=g) * 0.3
                p.copy_(noise + (1.0 if "norm" in name else 0.0))
            elif p.dim() >= 2:
                p.mul_(5.0)


def hf_model(name: str):
    torch.manual_seed(0)
    cfg = CONFIGS[name]()
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if name in SHARPENED:
        sharpen(model)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    model = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


@pytest.mark.parametrize("n", [1, 17, 64])
def test_logits_match_transformers_within_1e_4(saved, device, n):
    name, hf, path = saved
    loaded = load(str(path))
    ours = build_model(loaded.spec, loaded.weights, torch.float32, device)
    ids = torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = ours(ids.to(device), torch.arange(n, device=device), AttentionMetadata.single(n))
        b = hf(ids[None]).logits[0]
    assert (a.cpu() - b).abs().max().item() < 1e-4, name


def test_the_float64_reference_matches_transformers(saved):
    name, hf, path = saved
    loaded = load(str(path))
    ids = np.arange(3, 23)
    with torch.no_grad():
        b = hf(torch.tensor(ids)[None]).logits[0].double().numpy()
    assert np.abs(reference.forward(ids, loaded.weights, loaded.spec) - b).max() < 1e-4, name


@pytest.mark.parametrize("batch_decode", [True, False])
def test_decoding_through_paged_blocks_matches_one_full_pass(saved, batch_decode, device):
    """Prefill 10 tokens in chunks of 3, 7, then decode one at a time through a scattered
    block table: every step's logits equal the full pass (fast and reference paths)."""
    from tokenworks.engine.kv_pool import KVPool

    _, _, path = saved
    loaded = load(str(path))
    spec = loaded.spec
    model = build_model(spec, loaded.weights, torch.float32, device)
    ids = torch.arange(5, 25, device=device)
    table = [5, 0, 3, 6, 1]  # block size 4: 20 tokens in 5 blocks, out of order on purpose
    pool = KVPool.for_spec(spec, 8, 4, torch.float32, device)

    def run(start, n):
        meta = AttentionMetadata.paged([n], [start], [table], 4, device, batch_decode)
        positions = torch.arange(start, start + n, device=device)
        return model(ids[start : start + n], positions, meta, pool)

    with torch.no_grad():
        full = model(ids, torch.arange(20, device=device), AttentionMetadata.single(20))
        steps = [run(0, 3), run(3, 7)] + [run(i, 1) for i in range(10, 20)]
    assert (torch.cat(steps) - full).abs().max().item() < 1e-4


# --------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def new_family_dirs(tmp_path_factory):
    """The registry's families saved once for the engine tests: name -> (hf model, dir)."""
    out = {}
    for name in sorted(SHARPENED):
        model = hf_model(name)
        path = tmp_path_factory.mktemp(f"engine-{name}")
        model.save_pretrained(path)
        out[name] = (model, path)
    return out


def _loaded(path):
    """load(path) with a byte tokenizer: the random models come without one."""
    from tokenworks.models.toy import byte_tokenizer

    loaded = load(str(path))
    loaded.tokenizer_source = {"kind": "object", "tokenizer": byte_tokenizer()}
    return loaded


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


PROMPTS = [[7], [3, 9, 27, 81, 243], list(range(10, 50)), [100 + i % 7 for i in range(23)]]


@pytest.mark.parametrize("name", sorted(SHARPENED))
def test_greedy_generation_matches_transformers_solo_and_batched(new_family_dirs, name):
    from tokenworks import LLM, SamplingParams

    hf, path = new_family_dirs[name]
    expected = [_hf_greedy(hf, p, 8) for p in PROMPTS]
    llm = LLM(str(path), dtype="float32", loaded=_loaded(path), warmup=False, block_size=4)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    solo = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert solo == expected, name
    assert together == expected, name


def test_an_unknown_architecture_names_the_ones_there_are(tmp_path):
    import json

    from tokenworks.models import ModelLoadError

    cfg = transformers.LlamaConfig(**SMALL).to_dict() | {"model_type": "falcon_h9"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="falcon_h9.*supported: .*deepseek_v3.*mixtral"):
        load(str(tmp_path))


# --------------------------------------------------------------------------- MLA


def test_mla_cache_bytes_per_token_equal_the_planners(new_family_dirs, capsys):
    """The engine's pool for DeepSeek-V3 holds kv_lora_rank + qk_rope_head_dim numbers per
    token and layer: what `tokenworks plan kv` says for the same config.json."""
    import json

    from tokenworks.cli import main
    from tokenworks.config import EngineConfig
    from tokenworks.engine.engine import LLMEngine

    _, path = new_family_dirs["deepseek-v3"]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", warmup=False), _loaded(path))
    pool = engine.pool
    measured = pool.nbytes / (pool.num_blocks * pool.block_size)
    assert main(["plan", "kv", "--model", str(path / "config.json"), "--kv-dtype", "bf16",
                 "--json"]) == 0  # fmt: skip
    planned = json.loads(capsys.readouterr().out)["per_token_bytes"]
    assert measured == planned == 2 * 2 * (32 + 8)  # bf16, 2 layers, latent 32 + RoPE key 8
    assert engine.kv_bytes_per_token == planned


def test_mla_absorbed_decode_equals_the_expanded_form(new_family_dirs):
    from tokenworks.engine.kv_pool import KVPool

    _, path = new_family_dirs["deepseek-v3"]
    loaded = load(str(path))
    model = build_model(loaded.spec, loaded.weights, torch.float32)
    ids = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(4))
    tables = [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
    out = {}
    for absorb in (True, False):
        for layer in model.layers:
            layer.mla.absorb = absorb
        pool = KVPool.for_spec(loaded.spec, 16, 4, torch.float32)
        rows = []
        with torch.no_grad():
            meta = AttentionMetadata.paged([20, 13], [0, 0], tables, 4)
            model(torch.cat([ids[:20], ids[:13]]), torch.cat([torch.arange(20), torch.arange(13)]),
                  meta, pool)  # fmt: skip
            for i in range(8):  # two sequences decoding together, contexts 20+ and 13+
                meta = AttentionMetadata.paged([1, 1], [20 + i, 13 + i], tables, 4)
                tok = ids[20 + i : 21 + i].repeat(2)
                pos = torch.tensor([20 + i, 13 + i])
                rows.append(model(tok, pos, meta, pool))
        out[absorb] = torch.cat(rows)
    assert (out[True] - out[False]).abs().max().item() < 1e-5


# --------------------------------------------------------------------------- MoE


def _moe_model(new_family_dirs, name="mixtral", **kw):
    _, path = new_family_dirs[name]
    loaded = load(str(path))
    return build_model(loaded.spec, loaded.weights, torch.float32, **kw)


def _two_sequences(model, a, b):
    """Logits of sequences a and b run in one batch (no cache), split back apart."""
    with torch.no_grad():
        ids = torch.cat([a, b])
        pos = torch.cat([torch.arange(len(a)), torch.arange(len(b))])
        meta = AttentionMetadata([len(a), len(b)], [0, 0])
        both = model(ids, pos, meta)
        return both[: len(a)], both[len(a) :]


def _alone(model, a):
    with torch.no_grad():
        return model(a, torch.arange(len(a)), AttentionMetadata.single(len(a)))


@pytest.mark.parametrize("strategy", ["grouped", "grouped-padded", "dense"])
@pytest.mark.parametrize("name", sorted(MOE))
def test_every_moe_strategy_computes_the_same_layer(new_family_dirs, name, strategy, monkeypatch):
    if strategy == "grouped-padded":  # torch without _grouped_mm: padded groups instead
        monkeypatch.delattr(torch, "_grouped_mm")
        strategy = "grouped"
    ids = torch.randint(0, 320, (37,), generator=torch.Generator().manual_seed(5))
    base = _alone(_moe_model(new_family_dirs, name, moe_strategy="loop"), ids)
    other = _alone(_moe_model(new_family_dirs, name, moe_strategy=strategy), ids)
    assert (base - other).abs().max().item() < 1e-4


def test_with_a_capacity_limit_a_tokens_output_depends_on_its_neighbours(new_family_dirs):
    a = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(6))
    crowd = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(7))
    free = _moe_model(new_family_dirs)
    alone, (together, _) = _alone(free, a), _two_sequences(free, a, crowd)
    assert (alone - together).abs().max().item() < 1e-4  # off: neighbours change nothing
    capped = _moe_model(new_family_dirs, moe_capacity_factor=1.0)
    alone, (together, _) = _alone(capped, a), _two_sequences(capped, a, crowd)
    assert (alone - together).abs().max().item() > 1e-2  # on: the crowd takes the capacity
    assert capped.routing.dropped > 0


@pytest.mark.parametrize("name", ["mixtral", "deepseek-v3"])
def test_batch_invariant_mode_holds_for_moe(new_family_dirs, name):
    """16 mixed prompts together give the tokens each gives alone (as for Llama:
    test_batching), and the same log-probabilities to float32 rounding."""
    from tokenworks import LLM, SamplingParams

    _, path = new_family_dirs[name]
    llm = LLM(str(path), dtype="float32", loaded=_loaded(path), warmup=False,
              batch_invariant=True, block_size=4)  # fmt: skip
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 320, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 40, (16,), generator=g)]  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    together = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for x, y in zip(alone, together, strict=True):
        assert x.token_ids == y.token_ids
        for a, b in zip(x.logprobs, y.logprobs, strict=True):
            assert [t for t, _, _ in a.top] == [t for t, _, _ in b.top]
            assert max(abs(p - q) for (_, _, p), (_, _, q) in zip(a.top, b.top, strict=True)) < 1e-5


def test_routing_statistics_count_every_token_and_expert(new_family_dirs):
    from tokenworks.models.moe import routing_summary

    model = _moe_model(new_family_dirs, "qwen3-moe")
    _alone(model, torch.arange(30))
    counts = model.routing.take()
    assert counts.shape == (2, 8)  # 2 MoE layers x 8 experts
    assert (counts.sum(axis=1) == 30 * 2).all()  # every token to top_k = 2 experts
    summary = routing_summary(counts)
    assert 2 <= summary["experts_touched"] <= 8 and summary["imbalance"] >= 1
    assert model.routing.take() is None  # taken


def test_the_planner_counts_every_parameter_of_every_family(saved):
    """from_hf_config (what `tokenworks plan` reads) and the loaded spec's shape (what the
    engine sizes its cache with) count what transformers instantiates, buffers the
    router reads included."""
    import json

    from tokenworks.shapes import from_hf_config

    name, hf, path = saved
    count = sum(p.numel() for p in hf.parameters())
    count += sum(b.numel() for k, b in hf.named_buffers() if "e_score_correction_bias" in k)
    planned = from_hf_config(json.loads((path / "config.json").read_text()))
    assert planned.params() == load(str(path)).spec.shape.params() == count, name


def test_step_stats_carry_the_routing(new_family_dirs):
    from tokenworks import LLM, SamplingParams

    _, path = new_family_dirs["qwen3-moe"]
    llm = LLM(str(path), dtype="float32", loaded=_loaded(path), block_size=4)  # warm-up on
    llm.generate([[5] * 9, [6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    engine = llm.engine
    first = engine.stats[0]  # both prompts: 11 tokens to 2 of 8 experts each
    assert 2 <= first.moe_experts_touched <= 8 and first.moe_imbalance >= 1
    assert engine.routing_totals.shape == (2, 8)
    # every token the forward passes computed, counted once per layer and top-k slot
    computed = sum(s.prefill_tokens + s.decode_tokens for s in engine.stats)
    assert (engine.routing_totals.sum(axis=1) == 2 * computed).all()
    assert engine.totals["moe_dropped"] == 0


# --------------------------------------------------------------------------- GGUF


def _llama_cpp_permute(w, n_head: int):
    """The row order llama.cpp's converter writes a llama-arch Q or K projection in."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(hf, directory, path, q8_0: bool = False, keys=None, extra=None, mxfp4=False):
    """hf's weights (as saved in directory) as a float32 GGUF under llama.cpp's names, with
    the metadata it writes (Mixtral as a "llama" file with experts, Q/K rows permuted, RoPE
    scaling's type, factor and trained context); q8_0: matrices whose rows are whole blocks
    in Q8_0, as a quantised file holds them; keys: more metadata, {name: float or str};
    extra: more tensors, {GGUF name: float32 array}; mxfp4: the experts' matrices in MXFP4,
    as llama.cpp writes gpt-oss."""
    import gguf

    from tokenworks.models import arch

    cfg = hf.config
    family = arch.for_hf_model_type(cfg.model_type)
    if not family.gguf_archs:  # Mixtral
        family = arch.family("llama")
    garch = cfg.model_type if cfg.model_type in family.gguf_archs else family.gguf_archs[0]
    w = gguf.GGUFWriter(str(path), garch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for key, value in (keys or {}).items():
        key = key.format(arch=garch)
        w.add_string(key, value) if isinstance(value, str) else w.add_float32(key, value)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    n_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if n_experts:
        w.add_expert_count(n_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if cfg.model_type == "qwen3_moe":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if cfg.model_type == "gpt_oss":
        w.add_expert_feed_forward_length(cfg.intermediate_size)
    loaded = load(str(directory))
    spec = loaded.spec
    if spec.sliding_window:
        w.add_sliding_window(spec.sliding_window)
    if spec.attn_softcap:  # Gemma 2
        w.add_float32(f"{garch}.attn_logit_softcapping", spec.attn_softcap)
        w.add_float32(f"{garch}.final_logit_softcapping", spec.final_softcap)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    sd = {k: v.numpy() for k, v in loaded.weights.items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"],
               "output_norm.weight": sd["model.norm.weight"]}  # fmt: skip
    if "lm_head.weight" in sd:
        tensors["output.weight"] = sd["lm_head.weight"]
    # a weight that a stacked tensor holds (Phi-3's attn_qkv) is written there only
    stacked = {n for v in family.gguf_block.values() if not isinstance(v, str) for n in v}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for theirs, ours in family.gguf_block.items():
            names = (ours,) if isinstance(ours, str) else ours
            if isinstance(ours, str) and ours in stacked:
                continue
            if "{e}" in ours:
                key = [p + ours.format(e=e) for e in range(n_experts or 0)]
                if key and key[0] in sd:
                    tensors[f"blk.{i}.{theirs}"] = np.stack([sd[k] for k in key])
            elif all(p + n in sd for n in names):
                t = np.concatenate([sd[p + n] for n in names])
                if garch in PERMUTED_QK and ours.startswith("self_attn.q_proj."):
                    t = _llama_cpp_permute(t, cfg.num_attention_heads)
                elif garch in PERMUTED_QK and ours.startswith("self_attn.k_proj."):
                    t = _llama_cpp_permute(t, cfg.num_key_value_heads)
                tensors[f"blk.{i}.{theirs}"] = t
    for k, v in (tensors | (extra or {})).items():
        v = np.ascontiguousarray(v, dtype=np.float32)
        if mxfp4 and k.endswith("_exps.weight"):
            mx = gguf.GGMLQuantizationType.MXFP4
            w.add_tensor(k, gguf.quants.quantize(v, mx), raw_dtype=mx)
        elif q8_0 and v.ndim >= 2 and v.shape[-1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(k, gguf.quants.quantize(v, q8), raw_dtype=q8)
        else:
            w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GGUF_FAMILIES = [
    "qwen3", "qwen3-moe", "mixtral", "gemma2-head-dim-scale", "phi3-window", "smollm3", "olmo2",
    "gpt-oss",
]  # fmt: skip


@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_a_gguf_of_the_family_loads_as_its_hugging_face_directory_does(
    name, new_family_dirs, tmp_path, monkeypatch
):
    """llama.cpp's names (the registry's GGUF table, experts in one 3-D tensor each) give
    the same model; the converted copy kept for later loads gives it again."""
    monkeypatch.setenv("TOKENWORKS_HOME", str(tmp_path / "home"))
    hf, directory = new_family_dirs[name]
    path = tmp_path / f"{name}.gguf"
    _write_gguf(hf, directory, path)
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    for _ in range(2):  # read the GGUF, then its converted copy
        loaded = load(str(path))
        model = build_model(loaded.spec, loaded.weights, torch.float32)
        with torch.no_grad():
            got = model(ids, torch.arange(24), AttentionMetadata.single(24))
        assert (got - want).abs().max().item() < 1e-4
    assert (tmp_path / "home" / "converted").is_dir()


def _gguf_logits(path, ids) -> torch.Tensor:
    loaded = load(str(path))
    model = build_model(loaded.spec, loaded.weights, torch.float32)
    with torch.no_grad():
        return model(ids, torch.arange(len(ids)), AttentionMetadata.single(len(ids)))


@pytest.mark.parametrize("name", ["rope-linear", "rope-yarn"])
def test_a_gguf_s_rope_scaling_runs_as_transformers_runs_the_config(
    name, new_family_dirs, tmp_path, monkeypatch
):
    """`{arch}.rope.scaling.type / factor / original_context_length`, as llama.cpp's
    converter writes them from the config, give transformers' logits past the trained
    context (64 tokens over 32); the same file without them does not."""
    monkeypatch.setenv("TOKENWORKS_HOME", str(tmp_path / "home"))
    hf, directory = new_family_dirs[name]
    ids = torch.randint(0, 320, (64,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    path = tmp_path / f"{name}.gguf"
    _write_gguf(hf, directory, path)
    loaded = load(str(path))
    assert loaded.spec.rope_scaling == load(str(directory)).spec.rope_scaling
    assert (_gguf_logits(path, ids) - want).abs().max().item() < 1e-4
    plain = tmp_path / f"{name}-unscaled.gguf"
    _write_gguf(hf, directory, plain, keys={"{arch}.rope.scaling.type": "none"})
    assert (_gguf_logits(plain, ids) - want).abs().max().item() > 1e-2


def test_a_gguf_s_yarn_attn_factor_multiplies_yarn_s_own_scale(new_family_dirs, tmp_path):
    """llama.cpp scales YaRN's cos and sin by 0.1 ln(factor) + 1 times the file's
    rope.scaling.attn_factor: transformers' explicit attention_factor of that product."""
    import transformers

    from tokenworks.ops.rope_scaling import yarn_mscale

    hf, directory = new_family_dirs["rope-yarn"]
    cfg = hf.config.to_dict()
    cfg["rope_scaling"] = cfg["rope_parameters"] = dict(
        cfg["rope_parameters"], attention_factor=yarn_mscale(4.0) * 0.9
    )
    scaled = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg)).eval()
    scaled.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 320, (48,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = scaled(ids[None]).logits[0]
    path = tmp_path / "yarn-attn-factor.gguf"
    _write_gguf(hf, directory, path, keys={"{arch}.rope.scaling.attn_factor": 0.9})
    assert (_gguf_logits(path, ids) - want).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("{arch}.rope.scaling.type", "longrope", "rope.scaling.type = 'longrope' is not supported"),
        ("{arch}.rope.scaling.yarn_log_multiplier", 0.1, "rope.scaling.yarn_log_multiplier"),
        ("{arch}.rope.scaling.alpha", 1000.0, "rope.scaling.alpha = 1000.0: NTK-alpha"),
        ("{arch}.attn_logit_softcapping", 50.0, "attn_logit_softcapping = 50.0: a hyperparameter"),
    ],
)
def test_a_gguf_asking_for_what_is_not_built_is_refused_by_its_key(
    key, value, says, new_family_dirs, tmp_path
):
    from tokenworks.models.loaded import ModelLoadError

    hf, directory = new_family_dirs["qwen3"]
    path = tmp_path / "asks.gguf"
    _write_gguf(hf, directory, path, keys={key: value})
    with pytest.raises(ModelLoadError, match=re.escape(says)):
        load(str(path))


def _write_deepseek2_gguf(hf, directory, path, split_kv_b: bool, q8_0: bool = False):
    """hf (DeepSeek-V2 or V3) as llama.cpp writes it: a `deepseek2` file whose router is told
    by its gating function, its RoPE rows in the checkpoint's interleaved order, and kv_b
    split into per-head k_b (transposed) and v_b with K/V as one head over the latent
    (split_kv_b, newer llama.cpp) or kept whole (older)."""
    import gguf

    from tokenworks.models import arch

    cfg, spec = hf.config, load(str(directory)).spec
    m, moe, heads = spec.mla, spec.moe, cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), "deepseek2")
    a = "deepseek2."
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    ints = {
        "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": heads, "rope.dimension_count": m.qk_rope_head_dim,
        "attention.kv_lora_rank": m.kv_lora_rank,
        "leading_dense_block_count": len(moe.dense_layers),
        "expert_count": moe.n_experts, "expert_used_count": moe.top_k,
        "expert_feed_forward_length": moe.intermediate,
        "expert_shared_count": moe.shared_intermediate // moe.intermediate,
        "expert_gating_func": 2 if moe.scoring == "sigmoid" else 1,
    }  # fmt: skip
    latent = m.kv_lora_rank + m.qk_rope_head_dim  # K as one head over the latent
    if split_kv_b:
        ints |= {"attention.head_count_kv": 1, "attention.key_length": latent,
                 "attention.value_length": m.kv_lora_rank, "attention.key_length_mla": qk,
                 "attention.value_length_mla": m.v_head_dim}  # fmt: skip
    else:
        ints |= {"attention.head_count_kv": heads, "attention.key_length": qk,
                 "attention.value_length": m.v_head_dim}  # fmt: skip
    if m.q_lora_rank:
        ints["attention.q_lora_rank"] = m.q_lora_rank
    if moe.n_group > 1:
        ints |= {"expert_group_count": moe.n_group, "expert_group_used_count": moe.topk_group}
    for k, v in ints.items():
        w.add_uint32(a + k, v)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(a + "rope.freq_base", spec.rope_theta)
    w.add_float32(a + "expert_weights_scale", moe.routed_scaling_factor)
    w.add_bool(a + "expert_weights_norm", moe.norm_topk_prob)
    rs = spec.rope_scaling
    if rs is not None:
        w.add_string(a + "rope.scaling.type", "yarn")
        w.add_float32(a + "rope.scaling.factor", rs.factor)
        w.add_uint32(a + "rope.scaling.original_context_length", rs.original_max_position)
        w.add_float32(a + "rope.scaling.yarn_log_multiplier", 0.1 * rs.mscale_all_dim)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    sd = {k: v.numpy() for k, v in load(str(directory)).weights.items()}
    inverse = {v: k for k, v in arch.family("deepseek_v2").gguf_block.items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"],
               "output_norm.weight": sd["model.norm.weight"],
               "output.weight": sd["lm_head.weight"]}  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for ours, theirs in inverse.items():
            if "{e}" in ours and p + ours.format(e=0) in sd:
                tensors[f"blk.{i}.{theirs}"] = np.stack(
                    [sd[p + ours.format(e=e)] for e in range(moe.n_experts)]
                )
            elif p + ours in sd:
                t = sd[p + ours]
                if ours.endswith(("q_proj.weight", "q_b_proj.weight")):
                    t = _interleave_rope(t, m.qk_nope_head_dim, m.qk_rope_head_dim, qk)
                elif ours.endswith("kv_a_proj_with_mqa.weight"):
                    t = _interleave_rope(t, m.kv_lora_rank, m.qk_rope_head_dim, len(t))
                elif ours.endswith("kv_b_proj.weight") and split_kv_b:
                    kv = t.reshape(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
                    tensors[f"blk.{i}.attn_k_b.weight"] = kv[:, : m.qk_nope_head_dim].swapaxes(1, 2)
                    tensors[f"blk.{i}.attn_v_b.weight"] = kv[:, m.qk_nope_head_dim :]
                    continue
                tensors[f"blk.{i}.{theirs}"] = t
    for k, v in tensors.items():
        v = np.ascontiguousarray(v, dtype=np.float32)
        if q8_0 and v.ndim >= 2 and v.shape[-1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(k, gguf.quants.quantize(v, q8), raw_dtype=q8)
        else:
            w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _interleave_rope(w, start: int, n: int, period: int):
    """Undo the loader's deinterleave_rope: rows start..start+n of every `period` rows back
    from evens-then-odds to the checkpoint's interleaved pairs."""
    perm = np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)]) + start
    w = w.reshape(-1, period, *w.shape[1:]).copy()
    w[:, perm] = w[:, start : start + n].copy()
    return w.reshape(-1, *w.shape[2:])


@pytest.mark.parametrize("split_kv_b", [True, False], ids=["k_b-v_b", "kv_b"])
@pytest.mark.parametrize(
    "name", ["deepseek-v2-lite", "deepseek-v3", "deepseek-v2-lite-yarn", "deepseek-v3-yarn"]
)
def test_a_deepseek2_gguf_loads_as_its_hugging_face_directory_does(
    name, split_kv_b, new_family_dirs, tmp_path, monkeypatch
):
    """llama.cpp's `deepseek2` files (V2's softmax router or V3's sigmoid one with its score
    bias, latent attention with kv_b whole or split, YaRN's mscale as a log multiplier) give
    transformers' logits."""
    monkeypatch.setenv("TOKENWORKS_HOME", str(tmp_path / "home"))
    hf, directory = new_family_dirs[name]
    path = tmp_path / f"{name}.gguf"
    _write_deepseek2_gguf(hf, directory, path, split_kv_b)
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    assert load(str(path)).spec.moe == load(str(directory)).spec.moe
    assert (_gguf_logits(path, ids) - want).abs().max().item() < 1e-4


def test_a_quantised_deepseek2_gguf_serves_the_files_float_tokens(
    new_family_dirs, tmp_path, monkeypatch
):
    """A V3 file with Q8_0 matrices: the routed experts stay the file's blocks (the latent
    attention's weights are read as floats) and the greedy tokens are the same file's
    dequantised to float32, but for a near-tie or two that 8-bit activations flip."""
    from tokenworks import LLM, SamplingParams

    monkeypatch.setenv("TOKENWORKS_HOME", str(tmp_path / "home"))
    hf, directory = new_family_dirs["deepseek-v3"]
    path = tmp_path / "deepseek-v3-q8_0.gguf"
    _write_deepseek2_gguf(hf, directory, path, split_kv_b=True, q8_0=True)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = {}
    for quantization, dtype in (("gguf", "bfloat16"), ("none", "float32")):
        llm = LLM(str(path), dtype=dtype, loaded=_loaded(path), quantization=quantization,
                  warmup=False)  # fmt: skip
        if quantization == "gguf":
            assert llm.engine.model.moe_layers()[0].blocks is not None
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        tokens[quantization] = [o.outputs[0].token_ids for o in outs]
    pairs = zip(*tokens.values(), strict=True)
    differ = sum(a != b for x, y in pairs for a, b in zip(x, y, strict=True))
    assert differ <= 2, tokens


def test_a_gpt_oss_gguf_runs_its_mxfp4_experts_as_stored(new_family_dirs, tmp_path, monkeypatch):
    """gpt-oss as llama.cpp writes it, experts in MXFP4 and the rest in Q8_0: the experts
    stay the file's blocks (their biases beside them), and the greedy tokens are the same
    file's dequantised to float32 but where 8-bit activations flip a near-tie."""
    from tokenworks import LLM, SamplingParams

    monkeypatch.setenv("TOKENWORKS_HOME", str(tmp_path / "home"))
    hf, directory = new_family_dirs["gpt-oss"]
    path = tmp_path / "gpt-oss-mxfp4.gguf"
    _write_gguf(hf, directory, path, q8_0=True, mxfp4=True)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    outs = {}
    for quantization in ("gguf", "none"):
        llm = LLM(str(path), dtype="float32", loaded=_loaded(path), quantization=quantization,
                  warmup=False)  # fmt: skip
        if quantization == "gguf":
            moe = llm.engine.model.moe_layers()[0]
            assert moe.blocks is not None and moe.blocks[0][0].parts[0].ggml_type == 39
        outs[quantization] = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    _part_only_at_near_ties(outs["gguf"], outs["none"])


def test_a_phi3_gguf_with_longrope_factors_is_refused_by_the_tensor(new_family_dirs, tmp_path):
    """Phi-3's 128k files scale RoPE per dimension from two tensors: not built, so refused."""
    from tokenworks.models.loaded import ModelLoadError

    hf, directory = new_family_dirs["phi3-window"]
    path = tmp_path / "phi3-longrope.gguf"
    _write_gguf(hf, directory, path, extra={"rope_factors_long.weight": np.ones(8)})
    with pytest.raises(ModelLoadError, match="rope_factors_long.weight: LongRoPE"):
        load(str(path))


def test_gemma_ggufs_scale_queries_as_llama_cpp_does():
    """A GGUF has no query_pre_attn_scalar: head_dim**-0.5, but (hidden / heads)**-0.5 for
    the 27B models (Gemma 2: 46 layers, Gemma 3: 62), as their configs say."""
    from tokenworks.models import arch

    def fields(name, layers, hidden, heads, head_dim):
        keys = {"block_count": layers, "embedding_length": hidden, "attention.head_count": heads,
                "attention.key_length": head_dim}  # fmt: skip
        get = lambda key, default=None: keys.get(key.partition(".")[2], default)  # noqa: E731
        return arch.family(name).gguf_fields(get, name)

    assert fields("gemma2", 46, 4608, 32, 128)["attn_scale"] == 144**-0.5
    assert fields("gemma2", 42, 3584, 16, 256)["attn_scale"] == 256**-0.5
    assert fields("gemma3", 62, 5376, 32, 128)["attn_scale"] == 168**-0.5
    assert fields("gemma2", 26, 2304, 8, 256)["sliding_window"] == 4096  # no key: Gemma 2's


def test_a_quantised_moe_gguf_runs_its_experts_as_stored_on_the_c_forward(
    new_family_dirs, tmp_path, monkeypatch
):
    """A Qwen3-MoE file with Q8_0 matrices: by default the experts stay the file's blocks
    (no float copy), the C kernels run every batch, and the greedy tokens are the same
    file's dequantised to float32 (8-bit activations flip at most a near-tie or two)."""
    from tokenworks import LLM, SamplingParams

    monkeypatch.setenv("TOKENWORKS_HOME", str(tmp_path / "home"))
    hf, directory = new_family_dirs["qwen3-moe"]
    path = tmp_path / "qwen3-moe-q8_0.gguf"
    _write_gguf(hf, directory, path, q8_0=True)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = {}
    for quantization, dtype in (("gguf", "bfloat16"), ("none", "float32")):
        llm = LLM(str(path), dtype=dtype, loaded=_loaded(path), quantization=quantization)
        if quantization == "gguf":
            moe = llm.engine.model.moe_layers()[0]
            assert moe.blocks is not None and moe.gate_up is None
            assert llm.engine.c_kernels is not None
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        tokens[quantization] = [o.outputs[0].token_ids for o in outs]
    pairs = zip(*tokens.values(), strict=True)
    differ = sum(a != b for x, y in pairs for a, b in zip(x, y, strict=True))
    assert differ <= 2, tokens


@pytest.mark.parametrize("q8_0", [False, True], ids=["f32", "q8_0"])
@pytest.mark.parametrize(
    "name", ["gemma2-head-dim-scale", "phi3-window", "smollm3", "olmo2", "gpt-oss"]
)
def test_a_gguf_of_the_family_gives_the_modules_tokens_on_the_c_kernels(
    name, q8_0, new_family_dirs, tmp_path, monkeypatch
):
    """A file of each family llama.cpp writes beside Llama's (Gemma 2's soft-caps and
    alternating windows, Phi-3's stacked QKV and gate/up read as views of one tensor,
    SmolLM3's layers without RoPE): the C forward gives the torch modules' greedy tokens,
    prompts past the window included; float32 weights exactly. On Q8_0 blocks the
    activations round to 8 bits, where a last-bit difference between the two can flip a
    rounding: there a sequence may part only at a near-tie (torch scores C's token within
    0.5 of its own)."""
    monkeypatch.setenv("TOKENWORKS_HOME", str(tmp_path / "home"))
    hf, directory = new_family_dirs[name]
    path = tmp_path / f"{name}.gguf"
    _write_gguf(hf, directory, path, q8_0=q8_0)
    _c_kernels_give_the_modules_tokens(path, exact=not q8_0)


@pytest.mark.parametrize("q8_0", [False, True], ids=["f32", "q8_0"])
@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3"])
def test_a_deepseek2_gguf_gives_the_modules_tokens_on_the_c_kernels(
    name, q8_0, new_family_dirs, tmp_path, monkeypatch
):
    """Latent attention on the C forward: decode rows absorbed in C over the cached rows,
    prompt chunks expanded, the routed experts between the C calls (V2's softmax router
    with a dense first layer, V3's sigmoid one with a compressed query)."""
    monkeypatch.setenv("TOKENWORKS_HOME", str(tmp_path / "home"))
    hf, directory = new_family_dirs[name]
    path = tmp_path / f"{name}.gguf"
    _write_deepseek2_gguf(hf, directory, path, split_kv_b=True, q8_0=q8_0)
    _c_kernels_give_the_modules_tokens(path, exact=not q8_0)


def _c_kernels_give_the_modules_tokens(path, exact: bool) -> None:
    """The file's greedy tokens from the C forward equal the torch modules' (exact: float32
    weights) or part from them only at a near-tie (_part_only_at_near_ties)."""
    from tokenworks import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    outs = {}
    for kernels in ("c", "torch"):
        llm = LLM(str(path), dtype="float32", loaded=_loaded(path), quantization="gguf",
                  kernels=kernels, warmup=False, block_size=4)  # fmt: skip
        assert (llm.engine.c_kernels is not None) == (kernels == "c")
        outs[kernels] = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    if exact:
        assert [c.token_ids for c in outs["c"]] == [r.token_ids for r in outs["torch"]]
    _part_only_at_near_ties(outs["c"], outs["torch"])


def _part_only_at_near_ties(outs, refs) -> None:
    """Each greedy sequence of outs equals refs' or parts from it where refs (run with
    logprobs=5) scored outs' token within 0.5 of its own: a near-tie that a last-bit
    difference in the activations' rounding may flip."""
    for out, ref in zip(outs, refs, strict=True):
        if out.token_ids == ref.token_ids:
            continue
        pairs = zip(out.token_ids, ref.token_ids, strict=True)
        at = next(i for i, (a, b) in enumerate(pairs) if a != b)
        scores = {t: lp for t, _, lp in ref.logprobs[at].top}
        near = scores[ref.token_ids[at]] - scores.get(out.token_ids[at], -1e9) < 0.5
        assert near, (at, out.token_ids, ref.token_ids, ref.logprobs[at].top)


@pytest.mark.parametrize(("name", "quantization"), [("deepseek-v3", "int8"), ("qwen3-moe", "int4")])
def test_moe_and_mla_models_run_quantized(new_family_dirs, name, quantization):
    """Attention and shared experts quantise; routed experts, routers and MLA's W_UK/W_UV
    stay in the model dtype. Prefill and absorbed decode both run."""
    from tokenworks import LLM, SamplingParams

    _, path = new_family_dirs[name]
    llm = LLM(str(path), dtype="bfloat16", loaded=_loaded(path), warmup=False,
              quantization=quantization)  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], list(range(30))], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_dynamic_ntk_rope_matches_transformers_at_the_length_it_is_fixed_for(tmp_path):
    """Dynamic NTK scaling here is fixed for the longest context it allows, factor x the
    trained length (as vLLM computes it, so cached keys keep their rotation);
    transformers recomputes the base for each length and agrees at that one."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        **SMALL | {"max_position_embeddings": 32}, num_key_value_heads=2,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    sharpen(hf)
    hf.save_pretrained(tmp_path)
    loaded = load(str(tmp_path))
    assert loaded.spec.rope_scaling.kind == "dynamic" and loaded.spec.max_position == 64
    ours = build_model(loaded.spec, loaded.weights, torch.float32)
    ids = torch.randint(0, 320, (64,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = ours(ids, torch.arange(64), AttentionMetadata.single(64))
        b = hf(ids[None]).logits[0]
    assert (a - b).abs().max().item() < 1e-4
    r = reference.forward(ids.numpy(), loaded.weights, loaded.spec)
    assert np.abs(r - b.double().numpy()).max() < 1e-4


def test_an_unknown_rope_scaling_is_refused_by_name(tmp_path):
    import json

    from tokenworks.models import ModelLoadError

    cfg = transformers.LlamaConfig(**SMALL).to_dict()
    cfg["rope_scaling"] = {"rope_type": "longrope", "factor": 2.0}
    cfg.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="longrope.*llama3, linear, dynamic and yarn"):
        load(str(tmp_path))


# --------------------------------------------------------------------------- windows


def _run_checked(engine, requests) -> dict:
    """Run requests [(prompt ids, SamplingParams)] to the end, checking the block manager
    between steps (references, and no window holding more than its blocks + 1): each
    request's outputs, and the most blocks any sequence held in a windowed group."""
    peak = 0
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(prompt_token_ids=prompt, params=params, request_id=f"r{i}")
    out = {}
    while engine.has_unfinished():
        for seq in engine.step():
            out[seq.request_id] = [s.output_ids for s in seq.group]
        live = engine.scheduler.running + engine.scheduler.waiting
        live += [s for head in live for s in head.group if s not in live]
        engine.blocks.check([s for s in live if not s.finished])
        windowed = [g for g, w in enumerate(engine.blocks.windows) if w is not None]
        for s in live:
            held = engine.blocks.held(s)
            peak = max([peak] + [held[g] for g in windowed])
    return out, peak


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "mistral-window"])
def test_windows_that_free_blocks_give_the_mask_only_outputs(new_family_dirs, tmp_path, name):
    """Random requests (shared prefixes, n=2, sampling and greedy, chunked prompts) give
    the same tokens whether windowed layers free their blocks or only mask; a windowed
    group never holds more than window / block size + 1 blocks a sequence after a pass,
    and the pool is whole again at the end."""
    from tokenworks.config import EngineConfig
    from tokenworks.engine.engine import LLMEngine
    from tokenworks.engine.request import SamplingParams

    if name in new_family_dirs:
        path = new_family_dirs[name][1]
    else:
        path = tmp_path / name
        hf_model(name).save_pretrained(path)
    rng = np.random.default_rng(7)
    shared = rng.integers(0, 320, 30).tolist()
    requests = []
    for i in range(10):
        head = shared[: rng.integers(0, 31)] if i % 2 else []
        prompt = head + rng.integers(0, 320, rng.integers(1, 40)).tolist()
        params = SamplingParams(
            max_tokens=int(rng.integers(1, 30)),
            temperature=0 if i % 3 else 0.8,
            seed=i,
            n=2 if i % 4 == 1 else 1,
            ignore_eos=True,
        )
        requests.append((prompt, params))
    results = {}
    for kv in ("mask", "free"):
        config = EngineConfig(
            model=str(path), dtype="float32", warmup=False, block_size=4,
            max_num_batched_tokens=16, max_num_seqs=4, kv_cache_memory=0.002,
            sliding_window_kv=kv,
        )  # fmt: skip
        engine = LLMEngine(config, _loaded(path))
        assert engine.kv_layout.frees == (kv == "free")
        results[kv] = _run_checked(engine, requests)
        again, _ = _run_checked(engine, requests[:4])  # now from the prefix cache
        assert again == {f"r{i}": results[kv][0][f"r{i}"] for i in range(4)}
        assert engine.blocks.prefix.hit_tokens > 0
        assert engine.blocks.num_free == engine.blocks.num_blocks
        engine.blocks.check([])
    assert results["free"][0] == results["mask"][0]
    assert 0 < results["free"][1] <= 8 // 4 + 1
    assert results["mask"][1] == 0  # one group that keeps everything


@pytest.mark.parametrize("name", ["gemma3", "gemma2"])
def test_a_sequences_kv_bytes_equal_the_planners_paged_count(new_family_dirs, name):
    """Pool bytes one sequence holds, windows freeing, equal `plan kv --block-size` at the
    same context (whole blocks; a windowed layer the blocks its next token reads); with
    windows only masking, they equal every block of every layer."""
    from tokenworks.config import EngineConfig
    from tokenworks.engine.engine import LLMEngine
    from tokenworks.engine.request import SamplingParams
    from tokenworks.shapes import from_hf_config, kv_bytes

    hf, path = new_family_dirs[name]
    shape = from_hf_config(hf.config.to_dict())
    unwindowed = dataclasses.replace(shape, sliding_window=None)
    for kv in ("free", "mask"):
        engine = LLMEngine(
            EngineConfig(model=str(path), dtype="float32", warmup=False, block_size=4,
                         sliding_window_kv=kv),
            _loaded(path),
        )  # fmt: skip
        seq = engine.add_request(
            prompt_token_ids=list(range(1, 40)),
            params=SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        )
        while seq.num_tokens < 45:
            engine.step()
            if kv == "free":
                planned = kv_bytes(shape, seq.n_cached, "fp32", block_size=4)
            else:  # every layer keeps every block
                planned = kv_bytes(unwindowed, seq.n_cached, "fp32", block_size=4)
            assert engine.kv_bytes_held(seq) == planned, (kv, seq.n_cached)


def test_the_c_kernels_decode_past_blocks_a_window_gave_back(tmp_path):
    """A model whose every layer is windowed keeps one block table, and the C forward
    reads it: decoding past given-back blocks gives the tokens of the mask-only run."""
    from tokenworks.config import EngineConfig
    from tokenworks.engine.engine import LLMEngine
    from tokenworks.engine.request import SamplingParams
    from tokenworks.kernels.build import library

    if library() is None:
        pytest.skip("no C compiler here")
    path = tmp_path / "mistral-window"
    hf_model("mistral-window").save_pretrained(path)
    prompts = [list(range(1, 41)), list(range(50, 63)), [9] * 30]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = {}
    for kv in ("free", "mask"):
        config = EngineConfig(
            model=str(path), dtype="bfloat16", warmup=False, block_size=4, kernels="c",
            sliding_window_kv=kv,
        )  # fmt: skip
        engine = LLMEngine(config, _loaded(path))
        assert engine.c_kernels is not None and len(engine.kv_layout.groups) == 1
        seqs = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        outs[kv] = [s.output_ids for s in seqs]
        assert engine.blocks.released > 0 if kv == "free" else engine.blocks.released == 0
    assert outs["free"] == outs["mask"]


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "qwen3"])
def test_tiled_attention_gives_the_sdpa_tokens_through_the_paged_pool(new_family_dirs, name):
    """--attention-tile: the engine's prompt chunks (after cached prefixes) and batched
    decodes through tiled online-softmax attention give SDPA's greedy tokens (float32;
    windows freeing blocks, soft-capped scores)."""
    from tokenworks.config import EngineConfig
    from tokenworks.engine.engine import LLMEngine
    from tokenworks.engine.request import SamplingParams

    rng = np.random.default_rng(11)
    shared = rng.integers(0, 320, 30).tolist()
    requests = [
        (shared[: rng.integers(0, 31)] + rng.integers(0, 320, rng.integers(1, 40)).tolist(),
         SamplingParams(max_tokens=int(rng.integers(1, 30)), temperature=0, ignore_eos=True))
        for _ in range(8)
    ]  # fmt: skip
    path = new_family_dirs[name][1]
    results = {}
    for tile in (None, 16):
        config = EngineConfig(
            model=str(path), dtype="float32", warmup=False, block_size=4,
            max_num_batched_tokens=16, max_num_seqs=4, attention_tile=tile,
        )  # fmt: skip
        engine = LLMEngine(config, _loaded(path))
        results[tile] = _run_checked(engine, requests)[0]
        assert engine.model.layers[0].attention_tile == tile
    assert results[16] == results[None]
