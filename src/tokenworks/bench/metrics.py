"""Serving metrics with vLLM's definitions (benchmarks/benchmark_serving.py), computed from
per-request timelines so any engine's run is scored the same way.

- TTFT: request sent -> first content chunk.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request; requests of one token have none.
- ITL: the gaps between consecutive content chunks, pooled over all requests.
- E2E: request sent -> last chunk.
- Throughput: completed requests, output tokens and (input + output) tokens per second of
  the run's wall time. Goodput: completed requests per second that met every SLO given.
Failed requests count in `failed` and in no latency or token figure.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One request's timeline (seconds, from one monotonic clock)."""

    start: float
    input_tokens: int = 0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    end: float | None = None
    ok: bool = True
    error: str | None = None
    text: str = ""  # what came back (multi-turn chats send it on)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.ok and self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.end - self.start if self.ok and self.end is not None else None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        if not self.ok:
            return []
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(values: list[float]) -> dict | None:
    """mean, median, std and percentiles of a list (None when empty)."""
    if not values:
        return None
    out = {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "std": statistics.pstdev(values),
        "n": len(values),
    }
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(values, p)
    return out


def compute(
    results: list[RequestResult], duration: float, slos: dict[str, float] | None = None
) -> dict:
    """The run's figures. slos: seconds for any of ttft, tpot, e2e (vLLM's goodput)."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.input_tokens for r in done)
    figures = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_s": summary([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": summary([r.tpot for r in done if r.tpot is not None]),
        "itl_s": summary([g for r in done for g in r.itls]),
        "e2e_s": summary([r.e2e for r in done if r.e2e is not None]),
    }
    if slos:
        good = [r for r in done if _meets(r, slos)]
        figures["slos_s"] = dict(slos)
        figures["goodput"] = len(good) / duration
    return figures


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    for name, limit in slos.items():
        value = getattr(r, name)
        if value is not None and value > limit:
            return False
    return True
