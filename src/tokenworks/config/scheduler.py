"""The scheduler's limits: sequences and tokens a step, chunked prompts, the waiting queue
and the order it is served in."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenworks.config.model import MEMORY
from tokenworks.options import option


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(
        default=64, metadata=option("sequences running at once", group=MEMORY)
    )
    max_num_batched_tokens: int = field(
        default=2048,
        metadata=option("tokens per forward pass (prompts beyond it are chunked)", group=MEMORY),
    )
    enable_chunked_prefill: bool = field(
        default=True,
        metadata=option(
            "split long prompts across steps beside decodes", "--chunked-prefill", MEMORY
        ),
    )
    max_waiting: int = field(
        default=4096,
        metadata=option(
            "requests that may wait for a running slot once all max-num-seqs are taken; more "
            "are refused (HTTP 429/529); 0 refuses whatever finds no free slot",
            group=MEMORY,
        ),
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata=option(
            "fcfs, or priority: lower SamplingParams.priority first",
            group=MEMORY,
            choices=["fcfs", "priority"],
        ),
    )

    def __post_init__(self) -> None:
        self.check_scheduler()

    def check_scheduler(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0 (0: refuse whatever finds no free slot)")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy {self.scheduling_policy!r}: expected fcfs or priority"
            )
