"""How much memory the KV pool gets: kv_cache_memory GiB where given; else what
max_num_seqs full contexts need, capped at kv_cache_fraction of the memory free now (RAM
on the CPU, device memory on CUDA)."""

from __future__ import annotations

import os

import torch

from tokenworks.config import EngineConfig
from tokenworks.engine.kv_groups import KVLayout

GiB = 1024**3


def available_memory_bytes() -> int:
    """Free memory the KV pool may take a fraction of (RAM on CPU, device memory on CUDA)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4 * GiB


def kv_budget_bytes(config: EngineConfig, layout: KVLayout, max_model_len: int,
                    block_bytes: int, reserved: int = 0) -> int:  # fmt: skip
    """The KV pool's bytes for this config (see the module's docstring); reserved: bytes
    taken from the free memory first (LoRA adapters that may be loaded)."""
    if config.kv_cache_memory is not None:
        return int(config.kv_cache_memory * GiB)
    held = layout.blocks_held(max_model_len, config.block_size)
    want = config.max_num_seqs * held * block_bytes
    if config.device.startswith("cuda"):
        free = torch.cuda.mem_get_info(torch.device(config.device))[0]
    else:
        free = available_memory_bytes()
    return int(min(want, config.kv_cache_fraction * max(free - reserved, 0)))
