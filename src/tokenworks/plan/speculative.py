"""Speculative decoding: tokens per target pass and the speed-up, closed form and Monte Carlo.

A draft model proposes k tokens; the target checks them in one pass and keeps the longest
accepted prefix, plus one token of its own (the correction, or a bonus token when all k
pass). If each draft token is accepted independently with probability alpha, the expected
tokens per target pass is (1 - alpha^(k+1)) / (1 - alpha) (Leviathan et al., 2023). With a
draft pass costing c target passes, one round costs k c + 1 passes, so the speed-up over
plain decoding is that expectation divided by (k c + 1).
"""

from __future__ import annotations

import random


def _check(alpha: float, k: int, draft_cost: float = 0.0) -> None:
    if not 0 <= alpha <= 1:
        raise ValueError("alpha (acceptance rate) must be in [0, 1]")
    if k < 0:
        raise ValueError("k (draft tokens per round) must be >= 0")
    if draft_cost < 0:
        raise ValueError("draft_cost must be >= 0 (a fraction of a target pass)")


def expected_tokens(alpha: float, k: int) -> float:
    _check(alpha, k)
    if alpha == 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def speedup(alpha: float, k: int, draft_cost: float) -> float:
    _check(alpha, k, draft_cost)
    return expected_tokens(alpha, k) / (k * draft_cost + 1)


def best_k(alpha: float, draft_cost: float, k_max: int = 16) -> int:
    return max(range(k_max + 1), key=lambda k: speedup(alpha, k, draft_cost))


def monte_carlo(alpha: float, k: int, rounds: int = 100_000, seed: int = 0) -> float:
    """Mean tokens per target pass, by simulating rounds of accept/reject."""
    _check(alpha, k)
    rng = random.Random(seed)
    total = 0
    for _ in range(rounds):
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        total += accepted + 1  # the target's own token: a correction or the bonus
    return total / rounds
