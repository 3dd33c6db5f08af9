"""Queues: how long requests wait when they arrive at random.

M/M/1 (Poisson arrivals at rate lambda, exponential service at rate mu, one server):
utilisation rho = lambda / mu, mean time in system W = 1 / (mu - lambda), mean wait in queue
Wq = rho / (mu - lambda). M/G/1 (any service-time distribution with mean E[S] and second
moment E[S^2]): the Pollaczek-Khinchine formula Wq = lambda E[S^2] / (2 (1 - rho)). Both
blow up as rho approaches 1: that is the TTFT climb of labs/queueing_overload.py. The
simulator below checks them, and handles what they do not (several servers, a finite queue).

M/M/1/K (at most K in the system, arrivals beyond that turned away): an arrival is turned
away with probability (1 - rho) rho^K / (1 - rho^(K+1)). `admit` simulates one server in
front of which an admission policy decides, with a deadline after which an answer is
worth nothing (labs/admission_policies.py).
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


def mm1k_blocking(lam: float, mu: float, k: int) -> float:
    """The share of arrivals an M/M/1/K queue turns away (k: most in the system)."""
    if lam <= 0 or mu <= 0 or k < 1:
        raise ValueError("need lam > 0, mu > 0 and k >= 1")
    rho = lam / mu
    if rho == 1:
        return 1 / (k + 1)
    return (1 - rho) * rho**k / (1 - rho ** (k + 1))


POLICIES = ("admit_all", "bounded_queue", "stop_at_deadline", "predicted_wait")


def admit(
    lam: float,
    jobs: list[tuple[str, float, float | Callable[[random.Random], float]]],
    policy: str,
    deadline: float,
    n: int = 20_000,
    queue: int = 4,
    estimate: float = 1.0,
    seed: int = 0,
) -> dict:
    """One server, FIFO, Poisson arrivals at lam; each job a (class, share, service) drawn
    by share, its service seconds a number or drawn from rng. An answer counts (goodput)
    when it ends within `deadline` of its arrival. The policies:

    - admit_all: every arrival waits its turn and runs to its end;
    - bounded_queue: an arrival that finds the server busy and `queue` jobs waiting is
      turned away;
    - stop_at_deadline: every arrival is admitted, and a job is stopped when its deadline
      passes (what a request's deadline does in the server). Under FIFO a job never waits
      past its own deadline (the one ahead of it was stopped by an earlier one), so the
      stopping always falls on a running job, after work was spent on it;
    - predicted_wait: an arrival whose predicted end (the work ahead and its own, each
      taken as `estimate` x the true service: below 1 the estimates are stale and
      hopeful, above 1 cautious) is past its deadline is turned away."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: expected one of {', '.join(POLICIES)}")
    if lam <= 0 or deadline <= 0 or n < 1 or queue < 0 or estimate <= 0:
        raise ValueError("need lam, deadline and estimate > 0, n >= 1 and queue >= 0")
    rng = random.Random(seed)
    names, shares = [j[0] for j in jobs], [j[1] for j in jobs]
    draw = {c: (f if callable(f) else (lambda _r, f=f: f)) for c, _, f in jobs}
    t = busy_until = work = wasted = 0.0
    waiting: list[tuple[float, str, float]] = []  # (arrival, class, service), FIFO
    keys = ("arrived", "turned_away", "late", "on_time")
    counts = {c: dict.fromkeys(keys, 0) for c in names}

    def serve_until(now: float) -> None:
        """Start the waiting jobs the server reaches before `now`."""
        nonlocal busy_until, work, wasted
        while waiting and busy_until <= now:
            arrived, c, s = waiting.pop(0)
            start = max(busy_until, arrived)
            end = start + s
            if policy == "stop_at_deadline":
                end = min(end, arrived + deadline)
            busy_until, work = end, work + end - start
            on_time = start + s - arrived <= deadline
            counts[c]["on_time" if on_time else "late"] += 1
            wasted += 0.0 if on_time else end - start

    for _ in range(n):
        t += rng.expovariate(lam)
        serve_until(t)
        c = rng.choices(names, shares)[0]
        s = draw[c](rng)
        counts[c]["arrived"] += 1
        if policy == "bounded_queue" and busy_until > t and len(waiting) >= queue:
            counts[c]["turned_away"] += 1
            continue
        if policy == "predicted_wait":
            ahead = max(busy_until - t, 0.0) + sum(w[2] for w in waiting)
            if (ahead + s) * estimate > deadline:
                counts[c]["turned_away"] += 1
                continue
        waiting.append((t, c, s))
    serve_until(float("inf"))
    total = {k: sum(c[k] for c in counts.values()) for k in keys}
    arrived = total["arrived"]
    return {
        "policy": policy,
        "goodput": total["on_time"] / arrived,  # of the arrivals, answered in time
        "turned_away": total["turned_away"] / arrived,
        "late": total["late"] / arrived,
        "utilization": work / max(busy_until, t),
        "wasted_work": wasted / max(work, 1e-12),  # of the work done, on answers too late
        "by_class": {
            c: {k: v / max(counts[c]["arrived"], 1) for k, v in counts[c].items() if k != "arrived"}
            for c in names
        },  # fmt: skip
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
