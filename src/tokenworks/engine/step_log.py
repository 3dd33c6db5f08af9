"""What the engine's steps did: each step's StepStats (the recent ones kept), running
totals, and where an MoE model's routers sent its tokens. Metrics, benchmarks and the
engine core's gauges read them."""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from tokenworks.models.moe import routing_summary


@dataclass
class StepStats:
    """What one step did; the engine keeps recent ones for metrics and benchmarks."""

    step: int
    time: float  # wall-clock seconds when the step ended (time.time())
    duration_s: float
    batch_size: int  # sequences in the forward pass
    prefill_tokens: int
    decode_tokens: int
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks referenced by live sequences
    kv_bytes_in_use: int  # the bytes of those blocks
    prefix_hit_tokens: int  # prompt tokens admitted from the prefix cache this step
    preemptions: int
    cow_copies: int
    generated_tokens: int = 0  # tokens the step added to sequences
    spec_draft_tokens: int = 0  # proposed tokens the step verified (speculative decoding)
    spec_accepted_tokens: int = 0  # of those, the ones the target accepted
    # mixture of experts (0 for a dense model), each the mean over the MoE layers:
    moe_experts_touched: float = 0.0  # distinct experts the step's tokens were routed to
    moe_imbalance: float = 0.0  # the busiest expert's tokens / the mean expert's


@dataclass
class StepCounts:
    """Tokens one step emitted and verified, as it samples."""

    emitted: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


class StepLog:
    def __init__(self, model):
        self.model = model  # its `routing` (an MoE model's) is read after each step
        self.reset()

    def reset(self) -> None:
        """Step stats and totals from zero (at start, and again after the warm-up)."""
        self._steps = itertools.count()
        self.stats: deque[StepStats] = deque(maxlen=100_000)
        self.totals = {
            "prompt_tokens": 0,  # prompt tokens of admitted requests
            "prefill_tokens": 0,  # tokens actually computed in prefill (cache hits excluded)
            "generation_tokens": 0,
            "preemptions": 0,
            "steps": 0,
            "spec_draft_tokens": 0,  # speculative decoding: proposed tokens verified
            "spec_accepted_tokens": 0,  # and accepted
        }
        routing = getattr(self.model, "routing", None)
        if routing is not None:
            routing.take()  # forget what the warm-up routed
            routing.dropped = 0
            self.totals["moe_dropped"] = 0  # (token, expert) pairs over an expert's capacity
        # tokens each expert of each MoE layer took since the start: [MoE layers, experts]
        self.routing_totals: np.ndarray | None = None

    def record(self, out, counts: StepCounts, duration: float, scheduler, blocks,
               block_bytes: int) -> None:  # fmt: skip
        """A step's stats (`out`, the SchedulerOutput it ran), and the totals."""
        t = self.totals
        t["prefill_tokens"] += out.num_prefill_tokens
        t["generation_tokens"] += counts.emitted
        t["spec_draft_tokens"] += counts.draft_tokens
        t["spec_accepted_tokens"] += counts.accepted_tokens
        t["preemptions"] += len(out.preempted)
        t["steps"] += 1
        routing = self._routing()
        self.stats.append(
            StepStats(
                step=next(self._steps),
                time=time.time(),
                duration_s=duration,
                batch_size=len(out.scheduled),
                prefill_tokens=out.num_prefill_tokens,
                decode_tokens=out.num_decode_tokens,
                num_running=len(scheduler.running),
                num_waiting=len(scheduler.waiting),
                kv_usage=blocks.usage,
                kv_bytes_in_use=(blocks.num_blocks - blocks.num_free) * block_bytes,
                prefix_hit_tokens=out.prefix_hit_tokens,
                preemptions=len(out.preempted),
                cow_copies=blocks.cow_copies,
                generated_tokens=counts.emitted,
                spec_draft_tokens=counts.draft_tokens,
                spec_accepted_tokens=counts.accepted_tokens,
                moe_experts_touched=routing.get("experts_touched", 0.0),
                moe_imbalance=routing.get("imbalance", 0.0),
            )
        )

    def _routing(self) -> dict:
        """This step's routing summary (models/moe.routing_summary), added to the totals."""
        routing = getattr(self.model, "routing", None)
        counts = routing.take() if routing is not None else None
        if counts is None:
            return {}
        self.routing_totals = (
            counts if self.routing_totals is None else self.routing_totals + counts
        )
        self.totals["moe_dropped"] = routing.dropped
        return routing_summary(counts)
