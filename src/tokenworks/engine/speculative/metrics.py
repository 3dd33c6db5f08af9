"""The speculator's running totals and its controller's state: plain numbers the engine's
gauges carry to /metrics."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

GAUGES = ("proposing", "held_back", "losing", "mean_acceptance")


@dataclass
class SpeculativeMetrics:
    """Running totals (vLLM's spec_decode counters, and the time spent each side)."""

    num_drafts: int = 0  # sequences' proposals verified
    num_draft_tokens: int = 0  # proposed tokens verified
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens verify steps produced (accepted + the target's)
    num_rejections: int = 0  # proposals cut short by a rejected guess
    accepted_per_pos: list[int] = field(default_factory=list)  # passes of the j-th guess
    draft_seconds: float = 0.0  # proposing (the drafter's passes, or the n-gram lookups)
    verify_seconds: float = 0.0  # steps that verified proposals, less their proposing
    # the controller's state at the last step (gauges, not totals): decoding sequences that
    # proposed, those it held back (sitting out after guesses that did not pay, or every one
    # where guessing loses at this batch size), whether it loses, and the decoding
    # sequences' mean estimate of a guess's chance to pass
    proposing: int = 0
    held_back: int = 0
    losing: bool = False
    mean_acceptance: float | None = None

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per verified proposal (accepted guesses plus the target's own)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else None

    def since(self, earlier: SpeculativeMetrics) -> SpeculativeMetrics:
        """What was counted after `earlier` (a copy taken then)."""
        counts = {
            f.name: getattr(self, f.name) - getattr(earlier, f.name)
            for f in dataclasses.fields(self)
            if f.name != "accepted_per_pos" and f.name not in GAUGES
        }
        counts |= {name: getattr(self, name) for name in GAUGES}
        per_pos = [
            a - b for a, b in zip(self.accepted_per_pos, earlier.accepted_per_pos, strict=True)
        ]
        return SpeculativeMetrics(**counts, accepted_per_pos=per_pos)

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "num_rejections": self.num_rejections,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
        } | {name: getattr(self, name) for name in GAUGES}
