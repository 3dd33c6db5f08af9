"""EngineFront: what the server, the benchmarks and the router ask of an engine, wherever
its core runs (front/core_client.py's CoreClient; front/replicas.py's ReplicaRouter
over several), and the Submission every front takes."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Protocol

from tokenworks.engine.messages import KVBlocks
from tokenworks.engine.request import SamplingParams
from tokenworks.front.streams import RequestStream


@dataclass(frozen=True)
class Submission:
    """One request as a front takes it: every field any front needs."""

    params: SamplingParams
    prompt_token_ids: list[int]
    request_id: str | None = None  # (None: the front names it)
    priority: int = 0  # lower first, under --scheduling-policy priority
    cache_salt: str | None = None  # prefix-cache blocks are shared only under the same salt
    deadline: float | None = None  # a time.monotonic() value
    # prefill / decode disaggregation (front/disaggregated.py): write the prompt's KV
    # blocks out when the request ends (its last update carries them), or read these in
    # before it starts
    kv_export: bool = False
    kv_import: KVBlocks | None = None
    lora: str | None = None  # the LoRA adapter to run it with (None: the base model)

    def named(self, request_id: str) -> Submission:
        return dataclasses.replace(self, request_id=request_id)


class EngineFront(Protocol):
    # what the API process holds of the model: its spec, tokenizer, max_model_len and
    # admission (the LLMEngine itself where the core runs in this process)
    engine: Any

    def start(self) -> None:
        """Start the core(s) and wait until they take requests."""

    def shutdown(self) -> None:
        """Stop the core(s); requests still in flight fail with EngineNotRunningError."""

    def configure(self, observer=None, max_backlog=None, max_stall_s=None) -> None:
        """The server's metrics observer (serve/metrics.py) and how far a stream's reader
        may fall behind (tokens, seconds) before its request is cancelled."""

    @property
    def is_running(self) -> bool: ...

    def in_flight(self) -> int:
        """Requests submitted and not yet ended."""

    def fail_all(self, why: str) -> None:
        """End every request in flight with EngineNotRunningError(why)."""

    async def submit(self, job: Submission) -> RequestStream:
        """Queue a request; once the engine has accepted it, return its stream of updates.

        Raises what LLMEngine.add_request raises (ValueError subclasses for bad input,
        QueueFullError when the queue is full). The stream raises DeadlineExceededError
        when `deadline` (a time.monotonic() value) passes first, and RequestFailedError when
        the engine fails while running the request. Leaving the stream early (break,
        cancellation, aclose) cancels the request. Raises ValueError for a field this front
        cannot honour (kv_export, kv_import: a core client's alone).
        """

    def abort(self, request_id: str) -> None:
        """Cancel a request; returns at once (applied before the core's next step)."""

    async def lora(self, action: str, name: str, path: str | None = None) -> None:
        """Load ("load", from path) or unload ("unload") a LoRA adapter in every engine
        behind this front, between two steps; raises what the engine refused it with."""
        raise ValueError(f"{type(self).__name__} serves no LoRA adapters")

    def new_request_id(self, prefix: str = "req") -> str:
        self._next_id = getattr(self, "_next_id", 0) + 1
        return f"{prefix}-{self._next_id}-{time.monotonic_ns() % 10**9}"

    async def generate(self, job: Submission):
        """submit() and stream in one: `async for update in front.generate(job)`."""
        stream = await self.submit(job)
        try:
            async for update in stream:
                yield update
        finally:
            await stream.aclose()
