"""What an engine core hands its client: each step's updates, finished requests' timings,
the engine's gauges, and the errors a request's stream may end with.

Plain dataclasses with no engine behind them: the API process reads them without
importing the engine (engine/core.py builds them, front/core_client.py delivers them,
engine/core_messages.py carries them between processes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenworks.engine.request import TokenLogprob
from tokenworks.engine.speculative.metrics import SpeculativeMetrics


class LoRANotFoundError(ValueError):
    """A request or command named a LoRA adapter the engine does not serve."""


class QueueFullError(RuntimeError):
    """The waiting queue is full; the caller should retry later (HTTP 429 / 529)."""


class RayNotInstalledError(RuntimeError):
    """--distributed-executor-backend ray without Ray installed."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request (the engine itself carries on)."""


class EngineNotRunningError(RuntimeError):
    """The engine is not running (not started, shutting down, or its core died)."""


class DeadlineExceededError(TimeoutError):
    """The request did not finish before its deadline; it was cancelled."""


class ReaderTooSlowError(RuntimeError):
    """The stream's reader fell too far behind (max_backlog tokens undelivered, or none
    taken for max_stall_s while some waited): the request was cancelled and its blocks
    freed, so one slow client never grows the server's memory without end."""


class EngineCoreDiedError(RuntimeError):
    """The engine core exited (or never became ready)."""


@dataclass
class CompletionDelta:
    """What one step added to one completion of a request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: str | int | None
    reasoning_tokens: int = 0  # of the completion's tokens so far, those of its thinking


@dataclass
class KVBlocks:
    """A prompt's full KV blocks, written by the engine that prefilled it to a file in
    shared memory for the engine that decodes it (engine/kv_transfer.py): block j holds
    layer group groups[j]'s K/V of the block whose chained prefix hash is hashes[j]."""

    path: str
    hashes: list[bytes]
    groups: list[int]
    block_bytes: int
    seconds: float  # writing them

    @property
    def nbytes(self) -> int:
        return len(self.hashes) * self.block_bytes


@dataclass
class RequestUpdate:
    request_id: str
    deltas: list[CompletionDelta]
    finished: bool
    prompt_tokens: int
    cached_tokens: int
    # in a request's first update, where it asked for them: one per prompt token, the
    # first None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # in a pooling request's last update
    kv_blocks: KVBlocks | None = None  # in a prefill-only request's last update, where asked


@dataclass
class RequestMetrics:
    """Timings of one finished request, in seconds, for the serving metrics."""

    request_id: str
    finish_reasons: list[str]
    prompt_tokens: int
    generation_tokens: int
    queue_time: float | None  # arrival -> first scheduled
    ttft: float | None  # arrival -> first token out
    e2e: float  # arrival -> finished
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    prefix_miss: str | None = None  # why the first block it did not serve missed

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.generation_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.generation_tokens - 1)


@dataclass
class EngineGauges:
    """The engine as /metrics shows it, taken where the engine runs and sent with every
    step (engine/core.py's gauges_of)."""

    running: int
    waiting: int
    kv_usage: float
    prefix_queried: int | None = None  # the prefix cache's running counts (None: no cache)
    prefix_hits: int | None = None
    speculation: SpeculativeMetrics | None = None  # the speculator's running totals
    generation_tokens: int = 0  # tokens sampled since the engine started
    # the prefix cache's host tier (engine/kv_offload.py; None: none): blocks stored, copied
    # back and pushed out by its budget since start, and the bytes it holds now
    offloaded_blocks: int | None = None
    restored_blocks: int | None = None
    offload_bytes: int | None = None
    offload_dropped_blocks: int | None = None
    # LoRA adapters (engine/lora.py; max_loras None: none served): how many may be loaded,
    # and the adapters of the requests running and waiting
    max_loras: int | None = None
    running_loras: list[str] = field(default_factory=list)
    waiting_loras: list[str] = field(default_factory=list)
    # the block pool: blocks in all, blocks that can be handed out now, and where layers
    # keep windows (engine/kv_groups.py) each group's window and the blocks it holds
    kv_blocks: int = 0
    kv_free_blocks: int = 0
    kv_group_windows: list[int | None] = field(default_factory=list)
    kv_group_blocks: list[int] = field(default_factory=list)

    @property
    def idle(self) -> bool:
        """Nothing running or waiting, and no KV block held."""
        return self.running == 0 and self.waiting == 0 and self.kv_usage == 0
