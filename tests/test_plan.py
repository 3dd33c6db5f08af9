"""The planning toolkit: published figures, closed forms against brute-force counts and
simulations, and clear errors for nonsense input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tokenworks.plan import batching, cost, queueing, speculative
from tokenworks.plan.kv import kv_bytes, kv_bytes_per_token
from tokenworks.plan.machines import get_hardware
from tokenworks.plan.memory import fit
from tokenworks.plan.models import MODELS, from_hf_config, get_model
from tokenworks.plan.quant import parse_scheme, weight_bytes
from tokenworks.plan.roofline import decode, expected_experts, prefill, ridge_batch
from tokenworks.units import TB, GiB, KiB, fmt_bytes, fmt_rate

BF16 = parse_scheme("bf16")


# ------------------------------------------------------------------ units and catalogues


def test_capacity_is_binary_and_rates_are_decimal():
    h100 = get_hardware("h100")
    assert h100.memory_bytes == 80 * 2**30  # an "80 GB" card holds 80 GiB
    assert h100.bandwidth == 3.35e12 == 3.35 * TB
    assert fmt_bytes(131072) == "128 KiB" and fmt_bytes(2**30) == "1 GiB"
    assert fmt_rate(3.35e12) == "3.35 TB/s" and fmt_rate(989.4e12, "FLOP/s") == "989 TFLOP/s"


def test_every_catalogue_entry_names_its_source():
    from tokenworks.plan.hardware import HARDWARE

    for entry in [*HARDWARE.values(), *MODELS.values()]:
        assert entry.source, entry.name
    for name in ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "l4",
                 "l40s", "mi300x", "rtx-4090", "m2-ultra"):  # fmt: skip
        assert get_hardware(name).ridge("bf16") > 0


@pytest.mark.parametrize(
    "name,billions",
    [
        ("llama-2-7b", 6.74),
        ("llama-2-70b", 68.98),
        ("llama-3-8b", 8.03),
        ("llama-3.1-405b", 405.85),
        ("mistral-7b", 7.24),
        ("qwen2.5-7b", 7.62),
        ("gpt2", 0.1244),
        ("smollm2-135m", 0.1345),
    ],
)
def test_parameter_counts_match_the_published_ones(name, billions):
    assert get_model(name).params() / 1e9 == pytest.approx(billions, rel=0.003)


def test_moe_total_and_active_parameters():
    mixtral, ds = get_model("mixtral-8x7b"), get_model("deepseek-v3")
    assert mixtral.params() / 1e9 == pytest.approx(46.7, rel=0.01)
    assert mixtral.params(active=True) / 1e9 == pytest.approx(12.9, rel=0.01)
    assert ds.params() / 1e9 == pytest.approx(671, rel=0.01)
    assert ds.params(active=True) / 1e9 == pytest.approx(37, rel=0.03)


# ------------------------------------------------------------------ KV


def test_published_kv_sizes():
    assert kv_bytes_per_token(get_model("llama-3-8b")) == 128 * KiB
    assert kv_bytes(get_model("llama-3-8b"), 8192) == 1 * GiB
    assert kv_bytes_per_token(get_model("llama-2-7b")) == 512 * KiB
    assert kv_bytes_per_token(get_model("llama-3-8b"), "fp8") == 64 * KiB


def test_kv_for_mqa_latent_attention_and_sliding_windows():
    g1 = get_model("gemma-3-1b")  # MQA: one KV head of 256
    assert g1.attention == "mqa" and kv_bytes_per_token(g1) == 26 * 2 * 256 * 2
    ds = get_model("deepseek-v3")  # MLA caches the 512 latent + 64 RoPE key
    assert ds.attention == "mla" and kv_bytes_per_token(ds) == 61 * (512 + 64) * 2
    mistral = get_model("mistral-7b")  # every layer windowed at 4096
    assert kv_bytes(mistral, 32768) == kv_bytes(mistral, 4096)
    g27 = get_model("gemma-3-27b")  # 5 local (1024) : 1 global
    per_layer = 2 * 16 * 128 * 2
    local = sum(g27.is_local(i) for i in range(62))
    assert local == 52  # layers 6, 12, ..., 60 are global
    assert kv_bytes(g27, 32768) == (local * 1024 + (62 - local) * 32768) * per_layer


def test_kv_matches_a_real_cache_brute_force():
    """The bytes a transformers model's cache actually holds after a forward pass."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, vocab_size=100,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        out = model(torch.randint(0, 100, (1, 11)), use_cache=True)
    cache = out.past_key_values
    held = sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )
    assert held == kv_bytes(from_hf_config(cfg.to_dict()), 11, "bf16")


@pytest.mark.parametrize(
    "name", ["gpt2", "smollm2-135m", "qwen2.5-0.5b", "llama-3-8b", "mixtral-8x7b", "gemma-3-1b"]
)
def test_parameter_closed_form_equals_a_brute_force_count(name):
    """Instantiate the architecture (weights on the meta device: no memory) and count."""
    import transformers

    shape = get_model(name)
    config_cls, kw = {
        "gpt2": (transformers.GPT2Config, dict(n_layer=12, n_embd=768, n_head=12)),
        "smollm2-135m": (
            transformers.LlamaConfig,
            dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                 tie_word_embeddings=True),
        ),
        "qwen2.5-0.5b": (
            transformers.Qwen2Config,
            dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
        ),
        "llama-3-8b": (
            transformers.LlamaConfig,
            dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 tie_word_embeddings=False),
        ),
        "mixtral-8x7b": (
            transformers.MixtralConfig,
            dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                 num_local_experts=8, num_experts_per_tok=2),
        ),
        "gemma-3-1b": (
            transformers.Gemma3TextConfig,
            dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                 vocab_size=262144, sliding_window=512),
        ),
    }[name]  # fmt: skip
    config = config_cls(**kw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    counted = sum(p.numel() for p in model.parameters())
    closed = shape.params()  # Gemma 3's four norms a layer and per-head Q/K norms included
    assert counted == closed
    # and the same shape comes back from the config itself
    assert from_hf_config(config.to_dict()).params() == shape.params()


# ------------------------------------------------------------------ fit and roofline


def test_fit_splits_by_tensor_and_pipeline_parallelism():
    m, h100 = get_model("llama-3-70b"), get_hardware("h100")
    alone = fit(m, h100, scheme=BF16, context=8192)
    assert not alone.fits and "weights alone" in alone.verdict
    tp4 = fit(m, h100, tp=4, scheme=BF16, context=8192)
    assert tp4.fits and tp4.kv_per_token_per_device == 320 * KiB / 4
    assert tp4.max_sequences == int(tp4.kv_budget_per_device // (8192 * 80 * KiB))
    pp2 = fit(m, h100, tp=2, pp=2, scheme=BF16, context=8192)
    assert pp2.weights_per_device == pytest.approx(tp4.weights_per_device, rel=0.02)
    # KV heads replicate when tp exceeds them (8 KV heads, tp 16): one head per rank
    tp16 = fit(m, h100, tp=16, scheme=BF16, context=8192)
    assert tp16.kv_per_token_per_device == 80 * 2 * 128 * 2
    assert fit(m, h100, tp=2, scheme=parse_scheme("q4_1"), context=8192).fits


def test_fit_takes_lora_adapters_out_of_the_kv_budget():
    """An adapter of rank r on every product of Llama 3 8B: r x (in + out) of q, k, v, o,
    gate, up and down, per layer, in bf16 (a rank-64 one is 168M parameters)."""
    from tokenworks.plan.memory import lora_bytes

    m, h100 = get_model("llama-3-8b"), get_hardware("h100")
    per_layer = (4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 3 * (4096 + 14336)
    assert lora_bytes(m, 64) == 32 * 64 * per_layer * 2
    plain = fit(m, h100, scheme=BF16, context=8192)
    eight = fit(m, h100, scheme=BF16, context=8192, adapters=8, adapter_rank=64)
    assert eight.adapters_per_device == 8 * lora_bytes(m, 64)
    assert eight.kv_budget_per_device == plain.kv_budget_per_device - 8 * lora_bytes(m, 64)
    assert eight.max_sequences < plain.max_sequences
    halves = fit(m, h100, tp=2, scheme=BF16, context=8192, adapters=8, adapter_rank=64)
    assert halves.adapters_per_device == eight.adapters_per_device / 2


def test_a_memory_bound_decode_step_is_its_bytes_over_bandwidth():
    m, hw = get_model("llama-3-8b"), get_hardware("h100")
    c = decode(m, hw, BF16, batch=1, context=1024)
    assert c.bound == "memory"
    moved = c.weight_bytes + c.kv_bytes
    assert c.step_time_s == pytest.approx(moved / hw.bandwidth)
    # every matrix once (the input embedding is read by row), plus 1024 tokens of KV
    assert c.weight_bytes == pytest.approx((m.params() - (m.vocab - 1) * m.hidden) * 2)
    assert c.kv_bytes == 1024 * 128 * KiB
    assert prefill(m, hw, BF16, prompt=2048).bound == "compute"
    # a short context turns compute-bound at some batch; a long one never does
    short = ridge_batch(m, hw, BF16, context=128)
    assert short and decode(m, hw, BF16, batch=short, context=128).bound == "compute"
    assert decode(m, hw, BF16, batch=short - 1, context=128).bound == "memory"
    assert ridge_batch(m, hw, BF16, context=8192) is None


def test_moe_steps_read_only_the_experts_they_route_to():
    m = get_model("mixtral-8x7b")
    assert expected_experts(m, 1) == pytest.approx(2)
    assert expected_experts(m, 64) == pytest.approx(8, rel=1e-6)
    one = decode(m, get_hardware("h100"), BF16, batch=1, context=16)
    assert one.weight_bytes / 2 == pytest.approx(m.params(active=True) - (m.vocab - 1) * 4096)


def test_quantisation_formats_bits_per_weight():
    assert parse_scheme("q4_0").bits_per_weight == 4.5
    assert parse_scheme("q4_1").bits_per_weight == 5.0
    assert parse_scheme("q8_0").bits_per_weight == 8.5
    assert parse_scheme("4:g128:zero").bits_per_weight == 4.25
    m = get_model("llama-2-7b")
    assert weight_bytes(m, BF16) == m.params() * 2


# ------------------------------------------------------------------ simulators


def test_queue_simulation_agrees_with_mm1_and_pollaczek_khinchine():
    lam = 0.7
    theory = queueing.mm1(lam, 1.0)
    sim = queueing.simulate(lam, lambda r: r.expovariate(1.0), n=200_000, seed=1)
    tol = 4 * sim["wait_batch_means_stderr"]
    assert abs(sim["mean_wait_s"] - theory["mean_wait_s"]) < tol
    # deterministic service: half the M/M/1 wait (P-K with E[S^2] = E[S]^2)
    pk = queueing.mg1(lam, 1.0, 0.0)
    assert pk["mean_wait_s"] == pytest.approx(theory["mean_wait_s"] / 2)
    sim = queueing.simulate(lam, lambda r: 1.0, n=200_000, seed=2)
    assert abs(sim["mean_wait_s"] - pk["mean_wait_s"]) < 4 * sim["wait_batch_means_stderr"]
    # gamma service with CV^2 = 2
    pk = queueing.mg1(0.5, 1.0, 2.0)
    sim = queueing.simulate(0.5, lambda r: r.gammavariate(0.5, 2.0), n=200_000, seed=3)
    assert abs(sim["mean_wait_s"] - pk["mean_wait_s"]) < 4 * sim["wait_batch_means_stderr"]


def test_a_bounded_queue_turns_away_what_mm1k_says():
    def exponential(r):
        return r.expovariate(1.0)

    for rho in (0.5, 1.5):
        for k in (1, 4):  # at most k in the system: k - 1 waiting
            sim = queueing.admit(rho, [("all", 1.0, exponential)], "bounded_queue",
                                 deadline=1e9, n=100_000, queue=k - 1, seed=k)  # fmt: skip
            assert sim["turned_away"] == pytest.approx(queueing.mm1k_blocking(rho, 1.0, k),
                                                       abs=0.01)  # fmt: skip


def test_each_admission_policy_accounts_for_every_arrival():
    jobs = [("short", 0.8, 0.1), ("long", 0.2, 0.6)]
    lam = 1.5 / (0.8 * 0.1 + 0.2 * 0.6)  # 1.5 times what the server can do
    got = {p: queueing.admit(lam, jobs, p, deadline=1.0, n=5_000) for p in queueing.POLICIES}
    for r in got.values():
        assert r["goodput"] + r["turned_away"] + r["late"] == pytest.approx(1)
    assert got["admit_all"]["goodput"] < 0.05  # overloaded, every answer comes too late
    assert got["predicted_wait"]["late"] == 0  # exact estimates: nothing admitted is late
    assert got["predicted_wait"]["goodput"] > got["bounded_queue"]["goodput"]
    by = got["predicted_wait"]["by_class"]  # who is turned away: the long jobs first
    assert by["long"]["turned_away"] > 3 * by["short"]["turned_away"]
    stale = queueing.admit(lam, jobs, "predicted_wait", deadline=1.0, n=5_000, estimate=0.5)
    assert stale["late"] > 0.1  # hopeful estimates admit answers that come too late
    with pytest.raises(ValueError, match="admit_all, bounded_queue"):
        queueing.admit(lam, jobs, "lifo", deadline=1.0)


def test_speculative_closed_form_agrees_with_monte_carlo():
    for alpha in (0.5, 0.8, 0.95):
        for k in (1, 4, 8):
            exact = speculative.expected_tokens(alpha, k)
            mc = speculative.monte_carlo(alpha, k, rounds=100_000, seed=k)
            # tokens per round are at most k + 1: stderr <= (k + 1) / 2 / sqrt(rounds)
            assert abs(mc - exact) < 4 * (k + 1) / 2 / math.sqrt(100_000)
    assert speculative.expected_tokens(1.0, 4) == 5
    assert speculative.speedup(0.0, 4, 0.1) < 1  # drafting that never lands is a loss
    assert speculative.best_k(0.9, 0.05) > speculative.best_k(0.5, 0.05)


def test_static_batching_closed_form_agrees_with_the_simulator():
    outs = batching.lengths(40_000, 16, 512, seed=0)
    sim = batching.compare_batching(outs, 8)
    assert sim["static_utilization"] == pytest.approx(
        batching.expected_static_utilization(16, 512, 8), rel=0.01
    )
    assert sim["continuous_utilization"] > 0.99
    paging = batching.compare_paging([1, 16, 17], 64, 16, 1.0)
    assert paging["paged_bytes"] == 16 + 16 + 32 and paging["contiguous_bytes"] == 3 * 64


def test_cost_per_million_tokens():
    assert cost.cost_per_million(2.5, 2500) == pytest.approx(2.5 / 9e6 * 1e6)
    assert cost.cost_per_million(10, 1000, devices=8) == pytest.approx(80 / 3.6)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: get_hardware("tpu-v9"), "unknown hardware"),
        (lambda: get_model("llama-9-1t"), "unknown model"),
        (lambda: fit(get_model("llama-3-70b"), get_hardware("h100"), tp=3, scheme=BF16),
         "does not divide"),
        (lambda: fit(get_model("llama-3-8b"), get_hardware("h100"), context=-5, scheme=BF16),
         "must be >= 1"),
        (lambda: kv_bytes(get_model("llama-3-8b"), -1), "context"),
        (lambda: parse_scheme("seven-bit"), "unknown weight format"),
        (lambda: queueing.mm1(2.0, 1.0), "grows without bound"),
        (lambda: speculative.expected_tokens(1.5, 4), "alpha"),
        (lambda: cost.cost_per_million(1.0, 0), "tokens/s"),
        (lambda: kv_bytes_per_token(get_model("llama-3-8b"), "fp7"), "unknown dtype"),
    ],
)  # fmt: skip
def test_nonsense_input_gets_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_cli_answers_in_tables_and_json(capsys):
    from tokenworks.cli import main

    assert main(["plan", "kv", "--model", "llama-3-8b", "--context", "8192", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["per_token_bytes"] == 131072 and out["rows"][0]["bytes"] == 2**30
    argv = ["plan", "fit", "--model", "llama-3-70b", "--gpu", "h100", "--tp", "4",
            "--context", "8192", "--dtype", "bf16"]  # fmt: skip
    assert main(argv) == 0
    assert "fits: up to" in capsys.readouterr().out
    assert main(["plan", "fit", "--model", "llama-3-70b", "--gpu", "h100", "--tp", "3"]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_the_probe_measures_this_machine():
    from tokenworks.plan.probe import probe

    hw = probe(threads=1, matrix_mib=8, matmul_size=256, repeats=2)
    assert hw.name == "this-cpu" and hw.bandwidth > 1e8 and hw.peak("bf16") > 1e8
    assert hw.measured["copy_bandwidth"] > 0
