"""EngineConfig: every option that changes numerics, kernels or capacity, named once.

It is the sum of its parts (config/model.py, kernels.py, cache.py, scheduler.py,
parallel.py, and speculative decoding's JSON value), each holding its fields and checking
them, with the rules between parts in config/rules.py. Its fields stay one flat set: each
is written into every evidence record, so two measurements can be compared knowing
exactly what differed, and the command-line flags of every command that builds an engine
are made from them (`add_engine_arguments`): a field's type, default and help are written
in its part only.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field

from tokenworks.config.cache import CacheConfig
from tokenworks.config.kernels import KernelConfig
from tokenworks.config.lora import LoRAConfig
from tokenworks.config.model import ModelConfig
from tokenworks.config.parallel import ParallelConfig
from tokenworks.config.rules import RULES
from tokenworks.config.scheduler import SchedulerConfig
from tokenworks.config.speculative import SpeculativeConfig, speculative_arg
from tokenworks.options import add_arguments, fields_of, option, to_argv

PARTS = (ModelConfig, KernelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig)


# (a dataclass lists its bases' fields from the last base to the first: the model's first)
@dataclass(frozen=True)
class EngineConfig(
    LoRAConfig, ParallelConfig, SchedulerConfig, CacheConfig, KernelConfig, ModelConfig
):
    speculative_config: SpeculativeConfig | None = field(
        default=None,
        metadata=option(
            'speculative decoding as JSON, e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 4}\' or \'{"method": "draft_model", "model": NAME}\' '
            "(keys: method, num_speculative_tokens, model, quantization, dtype, "
            "prompt_lookup_max, prompt_lookup_min, adaptive)",
            group="speculative decoding",
            type=speculative_arg,
            metavar="JSON",
        ),
    )

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            spec = SpeculativeConfig.parse(self.speculative_config)
            object.__setattr__(self, "speculative_config", spec)
        for part in PARTS:  # each part's own checks, then the rules between them
            part.__post_init__(self)
        for rule in RULES:
            rule.check(self)

    def to_dict(self) -> dict:
        return {**asdict(self), "dtype": self.resolved_dtype}


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The command-line flags of every command that builds an engine: one per field."""
    add_arguments(p, EngineConfig)


def engine_kwargs(args) -> dict:
    """EngineConfig fields (all but the model) from the flags add_engine_arguments made."""
    return {f.name: getattr(args, f.name) for f, _ in fields_of(EngineConfig) if f.name != "model"}


def engine_argv(args) -> list[str]:
    """The engine flags back as a command line (for a `tokenworks serve` child process):
    every flag whose value differs from its field's default."""
    return to_argv(EngineConfig, args)
