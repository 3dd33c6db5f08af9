"""Queues: how long requests wait when they arrive at random.

M/M/1 (Poisson arrivals at rate lambda, exponential service at rate mu, one server):
utilisation rho = lambda / mu, mean time in system W = 1 / (mu - lambda), mean wait in queue
Wq = rho / (mu - lambda). M/G/1 (any service-time distribution with mean E[S] and second
moment E[S^2]): the Pollaczek-Khinchine formula Wq = lambda E[S^2] / (2 (1 - rho)). Both
blow up as rho approaches 1: that is the TTFT climb of labs/queueing_overload.py. The
simulator below checks them, and handles what they do not (several servers, a finite queue).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable


def _check(lam: float, mean_service: float) -> float:
    if lam <= 0 or mean_service <= 0:
        raise ValueError("arrival rate and mean service time must be > 0")
    rho = lam * mean_service
    if rho >= 1:
        raise ValueError(
            f"utilisation {rho:.3g} >= 1: the queue grows without bound (arrivals outpace "
            "service); lower the rate or speed up service"
        )
    return rho


def mm1(lam: float, mu: float) -> dict:
    rho = _check(lam, 1 / mu)
    return {
        "utilization": rho,
        "mean_in_system": rho / (1 - rho),
        "mean_time_in_system_s": 1 / (mu - lam),
        "mean_wait_s": rho / (mu - lam),
    }


def mg1(lam: float, mean_service: float, service_cv2: float) -> dict:
    """service_cv2: squared coefficient of variation of service time (1: exponential,
    0: deterministic), so E[S^2] = (1 + cv2) E[S]^2."""
    rho = _check(lam, mean_service)
    if service_cv2 < 0:
        raise ValueError("service_cv2 must be >= 0")
    es2 = (1 + service_cv2) * mean_service**2
    wq = lam * es2 / (2 * (1 - rho))
    return {
        "utilization": rho,
        "mean_wait_s": wq,
        "mean_time_in_system_s": wq + mean_service,
    }


def simulate(
    lam: float,
    service: Callable[[random.Random], float],
    n: int = 200_000,
    servers: int = 1,
    seed: int = 0,
    warmup: int = 1000,
) -> dict:
    """A FIFO queue with Poisson arrivals: mean wait and time in system over n requests."""
    if lam <= 0 or n <= warmup or servers < 1:
        raise ValueError("need lam > 0, n > warmup and servers >= 1")
    rng = random.Random(seed)
    free = [0.0] * servers  # when each server frees up
    heapq.heapify(free)
    t = 0.0
    waits, totals = [], []
    for i in range(n):
        t += rng.expovariate(lam)
        start = max(t, heapq.heappop(free))
        s = service(rng)
        heapq.heappush(free, start + s)
        if i >= warmup:
            waits.append(start - t)
            totals.append(start + s - t)
    mean = sum(waits) / len(waits)
    var = sum((w - mean) ** 2 for w in waits) / (len(waits) - 1)
    return {
        "mean_wait_s": mean,
        "mean_time_in_system_s": sum(totals) / len(totals),
        # waits are autocorrelated: a naive standard error understates the error, so
        # callers compare with a generous tolerance or use batch means (below)
        "wait_stderr_naive": math.sqrt(var / len(waits)),
        "wait_batch_means_stderr": _batch_means_stderr(waits),
        "requests": len(waits),
    }


def _batch_means_stderr(xs: list[float], batches: int = 50) -> float:
    size = len(xs) // batches
    means = [sum(xs[i * size : (i + 1) * size]) / size for i in range(batches)]
    m = sum(means) / batches
    return math.sqrt(sum((x - m) ** 2 for x in means) / (batches - 1) / batches)
