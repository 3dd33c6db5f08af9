"""EngineConfig owns every engine option: flags made from its fields, parts that check
themselves, and the rules between parts each broken once."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from tokenworks.config import (
    RULES,
    EngineConfig,
    add_engine_arguments,
    engine_argv,
    engine_kwargs,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(p)
    return p


def test_every_field_has_a_flag_with_its_default_and_help():
    p = _parser()
    actions = {a.dest: a for a in p._actions}
    for f in dataclasses.fields(EngineConfig):
        assert f.name in actions, f"{f.name} has no flag"
        assert actions[f.name].default == f.default
        assert actions[f.name].help, f"{f.name} has no help"
    assert engine_kwargs(p.parse_args([])) == {
        f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name != "model"
    }


def test_flags_parse_into_a_config_and_back_into_the_same_flags():
    argv = [
        "--kernels", "torch", "--no-packed-products", "--no-amx-tiles", "--dtype", "float32",
        "--max-num-seqs", "8", "--kv-cache-memory", "0.5", "--no-prefix-caching",
        "--batch-invariant", "--no-warmup", "--scheduling-policy", "priority", "-m", "toy",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
    ]  # fmt: skip
    args = _parser().parse_args(argv)
    config = EngineConfig(model=args.model, **engine_kwargs(args))
    assert (config.kernels, config.packed_products, config.amx_tiles) == ("torch", False, False)
    assert (config.max_num_seqs, config.kv_cache_memory, config.model) == (8, 0.5, "toy")
    assert not config.enable_prefix_caching and config.batch_invariant and not config.warmup
    assert config.speculative_config.num_speculative_tokens == 3
    again = _parser().parse_args(engine_argv(args))
    assert vars(again) == vars(args)
    assert "--model" in engine_argv(args) and "--no-prefix-caching" in engine_argv(args)


def test_every_field_lands_in_the_record():
    record = EngineConfig(kernels="torch", amx_tiles=False).to_dict()
    assert set(record) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert record["kernels"] == "torch" and record["amx_tiles"] is False
    assert record["dtype"] == "bfloat16"  # auto, resolved


def test_each_part_checks_its_own_options_alone():
    from tokenworks.config import CacheConfig, KernelConfig, ParallelConfig, SchedulerConfig

    for part, kw, says in [
        (CacheConfig, {"block_size": 0}, "block_size must be >= 1"),
        (KernelConfig, {"moe_strategy": "all"}, "expected auto, loop, grouped or dense"),
        (SchedulerConfig, {"max_waiting": -1}, "max_waiting must be >= 0"),
        (ParallelConfig, {"pipeline_batches": 0}, "pipeline_batches must be >= 1"),
    ]:
        assert part().__class__ is part
        with pytest.raises(ValueError, match=says):
            part(**kw)


def test_the_engine_config_is_its_parts_fields_and_nothing_else():
    from tokenworks.config import PARTS

    parts = {f.name for part in PARTS for f in dataclasses.fields(part)}
    own = {f.name for f in dataclasses.fields(EngineConfig)} - parts
    assert own == {"speculative_config"}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_each_rule_between_parts_is_kept(rule, monkeypatch):
    """Its example breaks it alone (each part accepts its own share), and the defaults
    do not."""
    from tokenworks.config import model

    monkeypatch.setattr(model, "cuda_available", lambda: True)  # a CUDA device, as said
    assert not rule.broken(EngineConfig())
    values = {f.name: f.default for f in dataclasses.fields(EngineConfig)} | rule.example
    with pytest.raises(ValueError, match=re.escape(rule.says.format(**values))):
        EngineConfig(**rule.example)


def test_a_config_travels_as_json_and_comes_back_equal():
    import msgspec

    config = EngineConfig(
        block_size=32, tensor_parallel_size=2, kv_events_config='{"enable_kv_cache_events": true}'
    )
    again = msgspec.json.decode(msgspec.json.encode(config), type=EngineConfig)
    assert again == config


def test_bad_kernel_choices_say_what_to_use():
    with pytest.raises(ValueError, match="auto, c, torch"):
        EngineConfig(kernels="cpp")


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"nnodes": 2, "node_rank": 2, "tensor_parallel_size": 2}, r"node rank from 0 to 1"),
        ({"nnodes": 2, "tensor_parallel_size": 3}, r"does not divide the 3 ranks"),
        ({"nnodes": 2, "tensor_parallel_size": 2, "distributed_executor_backend": "ray"},
         r"Ray places the ranks"),
        ({"distributed_executor_backend": "slurm"}, r"expected one of mp, ray"),
    ],
)  # fmt: skip
def test_bad_node_layouts_say_what_to_change(kw, says):
    with pytest.raises(ValueError, match=says):
        EngineConfig(**kw)


def test_an_engine_says_why_it_runs_torch(toy_llm):
    from tokenworks import LLM

    loaded = toy_llm.engine.loaded
    torch_llm = LLM("toy", dtype="float32", loaded=loaded, kernels="torch", warmup=False)
    assert torch_llm.engine.c_kernels is None
    assert "kernels='torch'" in torch_llm.engine.describe()
    auto = LLM("toy", dtype="float32", loaded=loaded, warmup=False)
    assert auto.engine.c_kernels is None and "float32" in auto.engine.kernels()


def test_kernels_c_refuses_a_model_it_cannot_run(tmp_path):
    """A GPT-2 (random weights, saved by transformers) is not a model the C forward pass
    takes: kernels="c" says so, "auto" runs torch and says why; a Llama-family one is."""
    import torch
    import transformers

    from tokenworks.engine.kv_pool import KVPool
    from tokenworks.kernels import CKernels, KernelsUnavailableError, build
    from tokenworks.models import build_model, load
    from tokenworks.models.toy import toy_spec, toy_weights

    if build.library() is None:
        pytest.skip("the C kernels cannot be built here")
    spec = toy_spec()
    llama = build_model(spec, toy_weights(spec, seed=1), torch.bfloat16)
    pool = KVPool(spec.n_layers, 8, 4, spec.n_kv_heads, spec.head_dim, torch.bfloat16)
    kernels, why = CKernels.open(llama, pool, 4, kernels="c")
    assert kernels is not None and why == ""
    cfg = transformers.GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    loaded = load(str(tmp_path))
    gpt2 = build_model(loaded.spec, loaded.weights, torch.bfloat16)
    pool2 = KVPool(2, 8, 4, 4, 16, torch.bfloat16)
    with pytest.raises(KernelsUnavailableError, match="no code for the gpt2 family"):
        CKernels.open(gpt2, pool2, 4, kernels="c")
    off, why = CKernels.open(gpt2, pool2, 4, kernels="auto")
    assert off is None and "declines this gpt2 model" in why


def test_env_says_which_kernel_paths_run_and_why_the_others_do_not(capsys):
    import json

    from tokenworks.cli import main
    from tokenworks.kernels import build, products

    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    paths = {p["path"].split(" (")[0]: p for p in info["kernels"]}
    assert paths["C kernels"]["active"] == (build.library() is not None)
    assert paths["AMX tiles"]["active"] == products.tiles_granted()
    assert all(p["why_not"] for p in info["kernels"] if not p["active"])
    assert info["versions"]["torch"] and info["cpu"]["cores"] >= 1
