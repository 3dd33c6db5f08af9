"""Static versus continuous batching, and contiguous versus paged KV memory, simulated.

Static batching runs B sequences until the longest finishes, so a batch's steps are the
max of B output lengths while its useful tokens are their sum: utilisation is
E[L] / E[max of B lengths]. Continuous batching refills a slot the step after it frees,
so (with enough waiting requests) every slot stays busy. Contiguous KV allocation
reserves max_len tokens per sequence; paged allocation holds ceil(len / block) blocks, so
the waste is under one block per sequence.
"""

from __future__ import annotations

import math
import random


def lengths(n: int, low: int, high: int, seed: int = 0) -> list[int]:
    if not 1 <= low <= high or n < 1:
        raise ValueError("need 1 <= low <= high and n >= 1")
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


def static_steps(outs: list[int], batch: int) -> int:
    """Decode steps to finish all requests in fixed batches (each runs to its longest)."""
    if batch < 1:
        raise ValueError("batch must be >= 1")
    return sum(max(outs[i : i + batch]) for i in range(0, len(outs), batch))


def continuous_steps(outs: list[int], batch: int) -> int:
    """Decode steps when a freed slot takes the next request at once."""
    if batch < 1:
        raise ValueError("batch must be >= 1")
    slots = [0] * min(batch, len(outs))  # step at which each slot frees
    for n in outs:
        i = min(range(len(slots)), key=slots.__getitem__)
        slots[i] += n
    return max(slots)


def compare_batching(outs: list[int], batch: int) -> dict:
    s, c = static_steps(outs, batch), continuous_steps(outs, batch)
    total = sum(outs)
    return {
        "requests": len(outs),
        "batch": batch,
        "tokens": total,
        "static_steps": s,
        "continuous_steps": c,
        "static_utilization": total / (s * batch),
        "continuous_utilization": total / (c * batch),
        "speedup": s / c,
    }


def expected_static_utilization(low: int, high: int, batch: int) -> float:
    """E[L] / E[max of B] for L uniform on low..high (closed form)."""
    n = high - low + 1
    mean = (low + high) / 2
    # E[max] = sum over m of P(max >= m) = low + sum_{j=1}^{n-1} (1 - (j / n)^B)
    e_max = low + sum(1 - (j / n) ** batch for j in range(1, n))
    return mean / e_max


def compare_paging(seq_lens: list[int], max_len: int, block: int, kv_per_token: float) -> dict:
    """KV bytes a contiguous allocator reserves against what a paged pool holds."""
    if block < 1 or max_len < max(seq_lens):
        raise ValueError("block must be >= 1 and max_len must cover every sequence")
    used = sum(seq_lens) * kv_per_token
    contiguous = len(seq_lens) * max_len * kv_per_token
    paged = sum(math.ceil(n / block) * block for n in seq_lens) * kv_per_token
    return {
        "sequences": len(seq_lens),
        "tokens": sum(seq_lens),
        "needed_bytes": used,
        "contiguous_bytes": contiguous,
        "paged_bytes": paged,
        "contiguous_waste": 1 - used / contiguous,
        "paged_waste": 1 - used / paged,
        "sequences_ratio": contiguous / paged,  # how many more sequences paging fits
    }
