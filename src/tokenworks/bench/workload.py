"""Deterministic workloads: the same token ids for every engine in a run."""

from __future__ import annotations

import random


def latency_prompt(n_tokens: int, vocab_size: int = 49152, seed: int = 0) -> list[int]:
    """n_tokens ids from the ordinary vocabulary (skipping the low ids where special tokens
    usually sit), fixed by the seed: speed does not depend on which tokens they are."""
    vocab_low, vocab_high = min(200, vocab_size // 4), min(40000, vocab_size)
    rng = random.Random(seed)
    return [rng.randrange(vocab_low, vocab_high) for _ in range(n_tokens)]
