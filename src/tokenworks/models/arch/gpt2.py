"""GPT-2: learned positions, LayerNorm, a plain GELU MLP (models/gpt2.py runs it)."""

from __future__ import annotations

from tokenworks.models.arch.family import Family

FAMILY = Family(name="gpt2", hf_model_types=("gpt2",), module="gpt2")
