"""Rotary position embeddings (rotate-half layout, as in Hugging Face Llama).

`spec` here is any object with head_dim, rope_theta, rope_scaling and extra (a
models.spec.ModelSpec): ops/ imports nothing above it."""

from __future__ import annotations

import math

import torch


def inv_frequencies(spec) -> torch.Tensor:
    """[rope_dim/2] float64 inverse frequencies, with Llama 3 scaling where the spec has it
    (rope_dim: the dimensions RoPE rotates, the whole head unless the spec says less)."""
    d = getattr(spec, "rope_dim", spec.head_dim)
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = spec.rope_scaling
    if rs is not None:
        low_wavelen = rs.original_max_position / rs.low_freq_factor
        high_wavelen = rs.original_max_position / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
    freqs = spec.extra.get("rope_freqs")  # GGUF Llama 3 files carry the factors as a tensor
    if freqs is not None:
        inv = inv / torch.as_tensor(freqs, dtype=torch.float64)
    return inv


def cos_sin_table(spec, n_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [n_positions, rope_dim] (each half repeated), float32."""
    # Match transformers: inv_freq is float32 and the product is taken in float32.
    inv = inv_frequencies(spec).float()
    t = torch.arange(n_positions, dtype=torch.float32)
    angles = torch.outer(t, inv)  # [P, D/2]
    emb = torch.cat([angles, angles], dim=-1)  # [P, D]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, n_heads, D]; cos, sin: [T, 1, D] -> [T, n_heads, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
