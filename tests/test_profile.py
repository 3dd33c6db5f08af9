"""`tokenworks profile`: its FLOPs are the planner's closed forms; its spans tile the step."""

from __future__ import annotations

import pytest
import torch

from tokenworks.bench.profile import ORDER, component, profile
from tokenworks.plan import roofline
from tokenworks.plan.hardware import Hardware
from tokenworks.plan.quant import SCHEMES


@pytest.fixture(scope="module")
def profiled(smol_loaded):
    from tokenworks import LLM

    llm = LLM("smollm2-135m", loaded=smol_loaded, dtype="float32", kernels="torch",
              enable_prefix_caching=False, warmup=False, max_num_seqs=8)  # fmt: skip
    return llm.engine, profile(llm.loop, prompt_tokens=64, batch=8, repeats=15, hw=_hw())


def test_profile_flops_equal_the_planners_closed_forms(profiled):
    """Decode: B x 2 x matmul params + attention at each context (roofline.decode);
    prefill: roofline.prefill less the LM head rows the engine does not compute (it asks
    logits of the last prompt row only)."""
    engine, result = profiled
    shape = engine.spec.shape
    prefill, decode = result["phases"]
    total = {
        p["phase"]: sum(c["flops"] for c in p["components"].values()) for p in (prefill, decode)
    }
    q = SCHEMES["fp32"]
    ctx = decode["contexts"][0]
    assert decode["contexts"] == [ctx, ctx]
    planned = roofline.decode(shape, _hw(), q, batch=8, context=ctx, compute_dtype="fp32").flops
    elementwise = sum(decode["components"][c]["flops"] for c in ("norms", "activation"))
    assert total["decode"] - elementwise == pytest.approx(planned, rel=1e-12)
    planned = roofline.prefill(shape, _hw(), q, prompt=64, compute_dtype="fp32").flops
    head_rows_skipped = 63 * 2 * shape.vocab * shape.hidden
    elementwise = sum(prefill["components"][c]["flops"] for c in ("norms", "activation"))
    assert total["prefill"] - elementwise == pytest.approx(planned - head_rows_skipped, rel=1e-12)


def test_an_moe_models_experts_are_the_planners_active_parameters(tmp_path):
    """Qwen3-MoE (random weights, 8 experts, 2 a token): the experts component carries the
    routed and shared MLP FLOPs, so the step's products again sum to roofline.decode."""
    import transformers

    from tokenworks import LLM
    from tokenworks.models.loader import load
    from tokenworks.models.toy import byte_tokenizer

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=256,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    loaded = load(str(tmp_path))
    loaded.tokenizer_source = {"kind": "object", "tokenizer": byte_tokenizer()}
    llm = LLM(str(tmp_path), loaded=loaded, dtype="float32", kernels="torch",
              enable_prefix_caching=False, warmup=False, max_num_seqs=4)  # fmt: skip
    _, decode = profile(llm.loop, prompt_tokens=16, batch=4, repeats=1, hw=_hw())["phases"]
    shape = llm.engine.spec.shape
    assert "experts" in decode["components"] and "gate_up_proj" not in decode["components"]
    ctx = decode["contexts"][0]
    planned = roofline.decode(shape, _hw(), SCHEMES["fp32"], batch=4, context=ctx,
                              compute_dtype="fp32").flops  # fmt: skip
    products = sum(c["flops"] for n, c in decode["components"].items() if n != "norms")
    assert products == pytest.approx(planned, rel=1e-12)
    # the bytes: the shared weights and the routed experts 4 tokens touch on average
    moved = decode["components"]["experts"]["bytes"]
    every = sum(p.numel() * 4 for layer in llm.engine.model.layers for p in layer.moe.parameters())
    assert 0 < moved < every


def _hw():
    return Hardware("test", 1e9, 1e10, {"fp32": 1e11}, kind="cpu")


def test_component_times_sum_to_the_measured_step(profiled):
    _, result = profiled
    for phase in result["phases"]:
        names = list(phase["components"])
        assert names == [c for c in ORDER if c in names]
        assert {"qkv_proj", "attention", "o_proj", "gate_up_proj", "down_proj", "lm_head",
                "norms", "sampling"} <= set(names)  # fmt: skip
        hooked = sum(c["seconds"] for c in phase["components"].values())
        assert hooked == pytest.approx(phase["hooked_seconds"], rel=1e-9)
        # in the records of docs/computation.md the hooked sum is within 6% of the plain
        # step; a shared machine moves one step's time by more than the hooks cost, so the
        # suite allows 25%
        assert hooked == pytest.approx(phase["step_seconds"], rel=0.25), phase["phase"]


def test_spans_go_to_the_component_their_stamps_bracket():
    assert component("qkv:start", "qkv:end") == "qkv_proj"
    assert component("qkv:end", "o_proj:start") == "attention"
    assert component("gate_up:end", "down:start") == "activation"
    assert component("model:end", "step:end") == "sampling"
    assert component("step:start", "model:start") == "scheduling"
    assert component("model:start", "embed:start") == "norms"
    assert component("embed:start", "embed:end") == "embedding"
