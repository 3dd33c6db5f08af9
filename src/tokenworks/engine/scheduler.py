"""The scheduler: which sequences run in the next forward pass, and how many tokens each.

Continuous batching under two limits, the way vLLM's scheduler works:
- a token budget per step (`max_num_batched_tokens`): decodes cost one token each, a
  prompt costs its length, and a prompt longer than what is left of the budget is split
  into chunks (chunked prefill) that share steps with the running decodes;
- a cap on running sequences (`max_num_seqs`).

Running sequences go first, oldest first (or by priority), so decodes are never starved
by new prompts. Then waiting requests are admitted in order while the budget, the cap and
the KV pool allow. When the pool cannot give a running sequence the block it needs, the
newest (lowest-priority) running sequence is preempted: its blocks are freed and it goes
back to the front of the waiting queue to be recomputed later (its cached prefix blocks
often survive in the prefix cache). Because a preempted sequence keeps its arrival order,
it is admitted again before anything that came after it: no starvation.

Admission control: requests waiting for a running slot are bounded (`max_waiting`,
`QueueFullError`; arrivals that a free slot will take next step do not count). Whether a
request could ever run (context, KV pool) is decided before it gets here
(engine/admission.py).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from tokenworks.config import EngineConfig
from tokenworks.engine.kv_cache import BlockManager
from tokenworks.engine.messages import QueueFullError
from tokenworks.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    n_tokens: int  # tokens fed this step (a prefill chunk, 1 for a decode, 1 + k to verify)
    sample: bool  # the chunk reaches the sequence's last token, so a new token is sampled
    prefill: bool  # a prompt chunk (or a recompute after preemption), not a decode step
    # proposed tokens fed after the sequence's last one (speculative decoding): the target
    # scores each, and only those it accepts become the sequence's
    draft: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies
    preempted: list[Sequence] = field(default_factory=list)
    prefix_hit_tokens: int = 0  # prompt tokens newly admitted from the prefix cache

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.n_tokens for s in self.scheduled if s.prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.n_tokens for s in self.scheduled if not s.prefill)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, fixed_chunks: bool = False):
        self.config, self.blocks = config, blocks
        # prompt chunks cut at fixed multiples of the step budget (torch's batch-invariant
        # tiles need it; the C kernels' rows do not)
        self.fixed_chunks = fixed_chunks
        self.waiting: list[Sequence] = []  # sorted by _key
        self.running: list[Sequence] = []  # sorted by _key

    def _key(self, seq: Sequence) -> tuple[int, int, int]:
        prio = seq.priority if self.config.scheduling_policy == "priority" else 0
        return (prio, seq.arrival, seq.index)

    # ------------------------------------------------------------------ queue

    def add(self, seq: Sequence) -> None:
        """Queue an admitted request (engine/admission.py), unless the queue is full."""
        if self.queued_beyond_slots(arriving=1) > self.config.max_waiting:
            raise QueueFullError(
                f"the waiting queue is full: all {self.config.max_num_seqs} running slots are "
                f"spoken for and {self.config.max_waiting} requests may wait; retry later"
            )
        bisect.insort(self.waiting, seq, key=self._key)

    def queued_beyond_slots(self, arriving: int = 0) -> int:
        """Waiting requests (with `arriving` more) that the next step could not admit even
        with every free running slot taken: what max_waiting bounds. Arrivals that free
        slots will take at once are not waiting for one (so a burst into an idle engine is
        never refused, and the warm-up's requests never count)."""
        free = max(0, self.config.max_num_seqs - len(self.running))
        return max(0, len(self.waiting) + arriving - free)

    def add_running(self, seq: Sequence) -> None:
        """A forked sibling joins the running set directly (its blocks are shared)."""
        bisect.insort(self.running, seq, key=self._key)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.free_seq(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of seq to feed now given the budget left (0: none this step)."""
        remaining = seq.num_tokens - seq.n_cached
        if self.fixed_chunks:
            # Chunk boundaries at fixed multiples of the budget from the sequence's start,
            # so a sequence is cut the same way whatever else shares its steps.
            size = self.config.max_num_batched_tokens
            n = min(remaining, size - seq.n_cached % size)
            return n if n <= budget else 0
        n = min(remaining, budget)
        if n > 1:  # a prompt chunk: shrink it to the blocks there are rather than wait
            n = max(1, min(n, self.blocks.room(seq)))
        if n < remaining and not self.config.enable_chunked_prefill:
            return 0
        return n

    def _take(self, seq: Sequence, n: int, out: SchedulerOutput, draft=()) -> None:
        """Put n tokens of seq in this step (the last len(draft) of them proposed): room in
        the pool, prefix hashes of its real tokens only, the entry."""
        out.copies += self.blocks.append(seq, n)
        real = n - len(draft)
        self.blocks.commit(seq, seq.n_cached + real)
        decode = real == 1 and seq.num_tokens - seq.n_cached == 1 and bool(seq.output_ids)
        sample = seq.n_cached + real == seq.num_tokens
        out.scheduled.append(ScheduledSeq(seq, n, sample, not decode, list(draft)))

    def _with_draft(self, seq: Sequence, draft: list[int], budget: int) -> list[int]:
        """The proposals of a decoding seq that fit the step's budget and the pool."""
        draft = draft[: max(0, budget - 1)]
        while draft and not self.blocks.can_append(seq, 1 + len(draft)):
            draft = draft[:-1]
        return draft

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.blocks.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        out.preempted.append(seq)
        bisect.insort(self.waiting, seq, key=self._key)

    def schedule(
        self, drafts: dict | None = None, busy: frozenset = frozenset(), share: int = 1
    ) -> SchedulerOutput:
        """drafts: {seq: proposed tokens} for running sequences that decode this step.
        busy: running sequences in a batch still in flight (a pipeline's), left out and
        never preempted. share: the batches in flight share the sequences, this one taking
        at most its 1/share of those the running slots hold (so each has some)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # the sequences that could run now: the running ones (forked siblings may take
        # them past max_num_seqs) and the waiting ones the free slots take
        free = max(0, self.config.max_num_seqs - len(self.running))
        most = -(-(len(self.running) + min(len(self.waiting), free)) // share)  # this batch's
        run = [s for s in self.running if s not in busy]
        i = 0
        while i < len(run) and budget > 0 and len(out.scheduled) < most:
            seq = run[i]
            n = self._chunk(seq, budget)
            if n == 0:
                i += 1
                continue
            draft = self._with_draft(seq, drafts[seq], budget) if drafts and seq in drafts else []
            n += len(draft)
            while not self.blocks.can_append(seq, n):
                victim = run.pop()  # the newest, or lowest priority
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self._take(seq, n, out, draft)
                budget -= n
                i += 1
        if busy:  # the batches in flight keep theirs, in order among the rest
            run = sorted([s for s in self.running if s in busy] + run, key=self._key)
        self.running = run
        if out.preempted:
            return out  # memory is short: admit nothing new this step
        while (self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0
               and len(out.scheduled) < most):  # fmt: skip
            seq = self.waiting[0]
            hit = self.blocks.match_prefix(seq)
            n = self._chunk(seq, budget)
            if n == 0 or not self.blocks.can_append(seq, n):
                self.blocks.free_seq(seq)  # undo the prefix match; its blocks stay cached
                break
            self.waiting.pop(0)
            prefix = self.blocks.prefix
            if prefix is not None:
                prefix.record_query(seq.num_tokens, hit)
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = hit
                if prefix is not None:
                    prefix.record_miss(seq.prefix_miss)
            out.prefix_hit_tokens += hit
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_time is None:
                seq.scheduled_time = time.monotonic()
            self._take(seq, n, out)
            bisect.insort(self.running, seq, key=self._key)
            budget -= n
        return out
