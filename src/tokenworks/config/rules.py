"""The rules between options of different parts: each says which settings do not go
together and what to change. Every part checks its own options; EngineConfig checks these
after them (tests/test_config.py breaks each rule once)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Rule:
    name: str
    broken: Callable[[Any], bool]  # the config breaks the rule
    says: str  # the error, formatted with the config's fields
    example: dict  # options that break it (and nothing else)

    def check(self, config) -> None:
        if self.broken(config):
            raise ValueError(self.says.format(**{f.name: getattr(config, f.name)
                                                 for f in fields(config)}))  # fmt: skip


def _split(config) -> bool:
    return config.tensor_parallel_size * config.pipeline_parallel_size > 1


_RANKS_RUN_TORCH = (
    "tensor and pipeline parallelism run the torch modules with collectives between ranks; "
    "{what} does not go with them: drop one of the two"
)

RULES = (
    Rule(
        "the C kernels run on the CPU",
        lambda c: c.kernels == "c" and c.device != "cpu",
        "kernels='c' runs on the CPU",
        {"kernels": "c", "device": "cuda"},
    ),
    Rule(
        "split ranks run the torch modules",
        lambda c: _split(c) and c.kernels == "c",
        _RANKS_RUN_TORCH.replace("{what}", "kernels c"),
        {"kernels": "c", "tensor_parallel_size": 2},
    ),
    Rule(
        "split ranks run eager modules",
        lambda c: _split(c) and c.compile,
        _RANKS_RUN_TORCH.replace("{what}", "compile"),
        {"compile": True, "pipeline_parallel_size": 2},
    ),
    Rule(
        "split ranks are not batch-invariant",
        lambda c: _split(c) and c.batch_invariant is True,
        _RANKS_RUN_TORCH.replace("{what}", "batch_invariant"),
        {"batch_invariant": True, "tensor_parallel_size": 2},
    ),
    Rule(
        "a quantised KV cache is read by eager attention",
        lambda c: c.kv_cache_dtype != "auto" and c.compile,
        "kv_cache_dtype {kv_cache_dtype} is read by the C kernels and the eager torch "
        "attention, which dequantise it; compile does not go with it: drop one of the two",
        {"kv_cache_dtype": "int8", "compile": True},
    ),
    Rule(
        "LoRA adapters are not compiled",
        lambda c: c.enable_lora and c.compile,
        "LoRA adapters change their products as they load and unload (engine/lora.py), "
        "which a compiled graph does not follow: drop one of the two",
        {"enable_lora": True, "compile": True},
    ),
    Rule(
        "LoRA adapters run in one process",
        lambda c: c.enable_lora and _split(c),
        "LoRA adapters are held whole by one process; with tensor or pipeline parallelism "
        "each rank would need its shard of every adapter: drop one of the two",
        {"enable_lora": True, "tensor_parallel_size": 2},
    ),
    Rule(
        "speculation verifies on batch-invariant rows",
        lambda c: c.speculative_config is not None and c.batch_invariant is False,
        "speculative decoding keeps the target's greedy text only where a verify row is "
        "computed as a decode row (batch invariance); --no-batch-invariant breaks that: "
        "drop one of the two",
        {"speculative_config": '{"method": "ngram"}', "batch_invariant": False},
    ),
    Rule(
        "speculation does not go with split ranks",
        lambda c: c.speculative_config is not None and _split(c),
        "speculative decoding keeps the target's greedy text only where a verify row is "
        "computed as a decode row; tensor and pipeline parallel ranks sum their products "
        "otherwise for more rows: drop one of the two",
        {"speculative_config": '{"method": "ngram"}', "tensor_parallel_size": 2},
    ),
    Rule(
        "speculation does not go with LoRA adapters",
        lambda c: c.speculative_config is not None and c.enable_lora,
        "speculative decoding keeps the target's greedy text only where a verify row is "
        "computed as a decode row; LoRA adapters' products are not batch-invariant: drop "
        "one of the two",
        {"speculative_config": '{"method": "ngram"}', "enable_lora": True},
    ),
    Rule(
        "LoRA adapters' products are not batch-invariant",
        lambda c: c.enable_lora and c.batch_invariant is True,
        "batch_invariant: an adapter's products run on torch's own matmuls, whose sums "
        "depend on the batch; drop one of the two",
        {"enable_lora": True, "batch_invariant": True},
    ),
    Rule(
        "the host tier keeps one process's blocks",
        lambda c: c.kv_offload_gib > 0 and _split(c),
        "kv_offload_gib keeps one process's KV blocks; with tensor or pipeline parallelism "
        "each rank holds part of a block: drop one of the two",
        {"kv_offload_gib": 1.0, "tensor_parallel_size": 2},
    ),
)
