"""The C++ paged decode-attention kernel (csrc/paged_decode.cpp), built on first use.

torch.utils.cpp_extension compiles it for this machine (g++ and ninja, about a minute,
cached under ~/.cache/torch_extensions). Where it cannot be built (no compiler, no ninja,
a GPU tensor) the pure-torch path in attention.py runs instead, with the same results.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@functools.cache
def load():
    """The compiled module, or None where it cannot be built (then say why, once)."""
    if os.environ.get("TOKENWORKS_NO_CPP_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load as build

        return build(
            name="tokenworks_paged_decode",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # a missing compiler or ninja: fall back, keep working
        log.warning("C++ paged attention unavailable (%s); using the torch path", e)
        return None


def paged_decode_attention(
    q, k_pool, v_pool, block_tables, context_lens, block_size, scale, window
) -> torch.Tensor | None:
    """q [B, H, D] -> [B, H, D], or None when the kernel is not available for these inputs."""
    if q.device.type != "cpu":
        return None
    mod = load()
    if mod is None:
        return None
    return mod.paged_decode_attention(
        q, k_pool, v_pool, block_tables, context_lens, block_size, scale, window or 0
    )
