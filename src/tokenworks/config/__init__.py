"""Engine configuration, in parts (config/engine.py says how they make one EngineConfig)."""

from tokenworks.config.cache import KV_DTYPES, CacheConfig
from tokenworks.config.engine import (
    PARTS,
    EngineConfig,
    add_engine_arguments,
    engine_argv,
    engine_kwargs,
)
from tokenworks.config.kernels import KernelConfig
from tokenworks.config.model import DEFAULT_DTYPE, DTYPES, ModelConfig
from tokenworks.config.parallel import ParallelConfig
from tokenworks.config.rules import RULES
from tokenworks.config.scheduler import SchedulerConfig
from tokenworks.config.speculative import SpeculativeConfig

__all__ = [
    "DEFAULT_DTYPE",
    "DTYPES",
    "KV_DTYPES",
    "PARTS",
    "RULES",
    "CacheConfig",
    "EngineConfig",
    "KernelConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "add_engine_arguments",
    "engine_argv",
    "engine_kwargs",
]
