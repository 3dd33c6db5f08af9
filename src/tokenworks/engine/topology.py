"""The arithmetic of a distributed engine: how many ranks, which device and threads each
takes, which layers each holds, and whether the model splits as configured. Pure
functions of the config and the model's spec: no process, socket or collective here
(those are engine/workers.py, rank 0's side, and engine/rank.py, a worker's).
"""

from __future__ import annotations

import os

from tokenworks.engine.kv_groups import KVLayout
from tokenworks.models import tensor_parallel as tp
from tokenworks.models.pipeline import stage_layers


def rank_device(config, rank: int) -> str:
    """Rank r's device: the config's on the CPU; on CUDA one GPU a rank, numbered within
    its node (a Ray actor sees only the GPU Ray gave it)."""
    if config.device == "cpu":
        return config.device
    if config.distributed_executor_backend == "ray" and rank > 0:
        return "cuda:0"
    return f"cuda:{rank % ranks_per_node(config)}"


def world_size(config) -> int:
    return config.tensor_parallel_size * config.pipeline_parallel_size


def ranks_per_node(config) -> int:
    return world_size(config) // config.nnodes


def rank_threads(config) -> int | None:
    """CPU threads each rank takes: the config's, or the cores shared out between ranks."""
    if config.threads is not None or world_size(config) == 1:
        return config.threads
    return max(1, (os.cpu_count() or 1) // world_size(config))


def own_layers(spec, config, rank: int) -> range | None:
    """The layers rank `rank` holds, and keeps KV for: its pipeline stage's (None: all)."""
    pp = config.pipeline_parallel_size
    return stage_layers(spec.n_layers, pp)[rank // config.tensor_parallel_size] if pp > 1 else None


def block_bytes_of(spec, config, layout: KVLayout, kv_bytes_per_token: int) -> int:
    """Bytes of one block on the rank that holds the most of them: every rank's pool has
    the same blocks, over its own stage's layers."""
    stages = range(0, world_size(config), config.tensor_parallel_size)
    return max(layout.bytes_per_block(kv_bytes_per_token, config.block_size,
                                      own_layers(spec, config, r)) for r in stages)  # fmt: skip


def check_split(spec, config) -> None:
    """Raise, saying what to change, where the model cannot be split as configured (before
    any worker is started)."""
    if config.tensor_parallel_size > 1:
        tp.check_divisible(spec, config.tensor_parallel_size)
    if config.pipeline_parallel_size > 1:
        if spec.arch == "gpt2" or spec.mla is not None:
            raise ValueError(
                f"pipeline parallelism runs Llama-shaped models; {spec.arch} is not one"
            )
        stage_layers(spec.n_layers, config.pipeline_parallel_size)
