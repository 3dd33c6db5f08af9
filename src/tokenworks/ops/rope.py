"""Rotary position embeddings (rotate-half layout, as in Hugging Face Llama).

`spec` here is any object with head_dim, rope_theta, rope_scaling and extra (a
models.spec.ModelSpec): ops/ imports nothing above it."""

from __future__ import annotations

import math

import torch

from tokenworks.ops.rope_scaling import attention_factor


def _yarn(spec, d: int) -> torch.Tensor:
    """YaRN's blend: interpolated (/factor) below the low-rotation dimensions, unchanged
    above the high-rotation ones, a linear ramp between (transformers' arithmetic, float32)."""
    rs, base = spec.rope_scaling, spec.rope_theta

    def dim_for(rotations: float) -> float:
        return (
            d
            * math.log(rs.original_max_position / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low, high = dim_for(rs.beta_fast), dim_for(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    keep = 1 - ramp  # 1: extrapolate (the frequency as trained), 0: interpolate
    return (1.0 / (rs.factor * pos) * (1 - keep) + 1.0 / pos * keep).double()


def inv_frequencies(spec) -> torch.Tensor:
    """[rope_dim/2] float64 inverse frequencies, scaled as the spec's rope_scaling says
    (rope_dim: the dimensions RoPE rotates, the whole head unless the spec says less)."""
    d = getattr(spec, "rope_dim", spec.head_dim)
    rs = spec.rope_scaling
    base = spec.rope_theta
    if rs is not None and rs.kind == "dynamic":  # NTK-aware: the base for factor x the context
        base = base * (rs.factor * rs.factor - (rs.factor - 1)) ** (d / (d - 2))
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if rs is not None and rs.kind == "linear":
        inv = inv / rs.factor
    elif rs is not None and rs.kind == "yarn":
        inv = _yarn(spec, d)
    elif rs is not None and rs.kind == "llama3":
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
    return cos_sin_rows(spec, 0, n_positions)


def cos_sin_rows(spec, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows start..stop of cos_sin_table (the same values, each row made from its position
    alone), for a table filled as positions are first reached."""
    # Match transformers: inv_freq is float32 and the product is taken in float32.
    inv = inv_frequencies(spec).float()
    t = torch.arange(start, stop, dtype=torch.float32)
    angles = torch.outer(t, inv)  # [P, D/2]
    emb = torch.cat([angles, angles], dim=-1)  # [P, D]
    scale = attention_factor(spec)
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, n_heads, D]; cos, sin: [T, 1, D] -> [T, n_heads, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
