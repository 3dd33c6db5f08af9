"""RoPE scaling's arithmetic that needs no tensors (YaRN's magnitude scale): read with a
model's spec, before any weight is loaded."""

from __future__ import annotations

import math


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale for a context `factor` times the trained one."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(spec) -> float:
    """What YaRN multiplies cos and sin by (1.0 for every other kind)."""
    rs = spec.rope_scaling
    if rs is None or rs.kind != "yarn":
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor
    if rs.mscale and rs.mscale_all_dim:
        return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    return yarn_mscale(rs.factor)
