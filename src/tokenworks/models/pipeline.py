"""Pipeline parallelism: the layers cut into stages, one group of processes each, the hidden
states of a batch sent from stage to stage (torch.distributed send / recv).

Stage 0 embeds the tokens and runs its layers, then sends [tokens, hidden] on; each later
stage receives, runs its own layers and sends on; the last normalises and runs the head,
and sends the logits back to rank 0, which samples. Nothing is split inside a layer, so
the arithmetic is one process's, in the same order.

One batch through S stages keeps one stage busy at a time. Cut into micro-batches
(GPipe), stage 0 runs the second while stage 1 runs the first: with m micro-batches the
stages idle for (S - 1) / (m + S - 1) of the step instead of (S - 1) / S. The sends are
asynchronous (isend) so that a stage goes on to its next micro-batch at once.

Between steps the engine keeps several batches in flight (engine/engine.py): rank 0 starts
the next step's batch through stage 0 while the later stages finish the last one, and takes
each step's logits (`collect`) when it needs them. Every rank runs the steps in the order
they were sent, so a block one step writes is written on every rank before a later step
reads it, and a block freed by one step is done with before a later one reuses it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tokenworks.models.tensor_parallel import Comms


def stage_layers(n_layers: int, stages: int) -> list[range]:
    """Each stage's layers, as even as they go (the earlier stages take one more)."""
    if not 1 <= stages <= n_layers:
        raise ValueError(
            f"--pipeline-parallel-size {stages}: the model has {n_layers} layers to share out "
            f"(1 to {n_layers} stages)"
        )
    per, extra = divmod(n_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = per + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


@dataclass(frozen=True)
class Topology:
    """Where a rank sits: tensor-parallel rank t of pipeline stage s is global rank
    s x tp + t; the stage's tensor-parallel ranks share a process group."""

    rank: int
    tp: int = 1
    pp: int = 1
    tp_group: object = None  # the stage's torch.distributed group (None: tp == 1)

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def peer(self, stage: int) -> int:
        """The global rank of this tensor-parallel rank in another stage."""
        return stage * self.tp + self.tp_rank

    @property
    def last_stage(self) -> int:
        return self.pp - 1


class PipelineStage(nn.Module):
    """A stage's model between the stages before and after it: called like the whole
    model, it returns the logits only on rank 0 (after finish), None elsewhere."""

    def __init__(self, model: nn.Module, topology: Topology, vocab: int):
        nn.Module.__init__(self)
        self.model, self.topology, self.vocab = model, topology, vocab
        self.comms = Comms()
        self.flight = Flight()  # what the step being run has sent and awaits

    def forward(self, ids, positions, meta, cache=None, logits_rows=None, float_logits=True):
        t, m = self.topology, self.model
        if t.stage == 0:
            x = m.embed_input(ids)
        else:
            x = torch.empty(len(ids), m.spec.hidden_size, dtype=m.norm.dtype, device=m.norm.device)
            self._recv(x, t.peer(t.stage - 1))
        x = m.run_layers(x, positions, meta, cache)
        if t.stage < t.last_stage:
            self._send(x.contiguous(), t.peer(t.stage + 1))
            if t.rank == 0:
                self.flight.expected.append(len(ids) if logits_rows is None else len(logits_rows))
            return None
        logits = m.head(m.final_norm(x, logits_rows))
        if t.rank != 0 and t.tp_rank == 0:
            self._send(logits.contiguous(), 0)
        return logits.float() if float_logits else logits

    def _send(self, x: torch.Tensor, to: int) -> None:
        t0 = time.perf_counter()  # (the isend's call: its transfer overlaps what follows)
        self.flight.pending.append((dist.isend(x, dst=to), x))
        self.comms.add("send", x.numel() * x.element_size(), time.perf_counter() - t0)

    def _recv(self, x: torch.Tensor, src: int) -> None:
        t0 = time.perf_counter()
        dist.recv(x, src=src)
        self.comms.add("recv", x.numel() * x.element_size(), time.perf_counter() - t0)

    def launched(self) -> Flight:
        """The step whose micro-batches have just run through this stage: its sends and
        the logits rank 0 awaits, to collect() when they are wanted."""
        flight, self.flight = self.flight, Flight()
        return flight

    def collect(self, flight: Flight, dtype) -> torch.Tensor | None:
        """Wait for a launched step's sends, and on rank 0 (when it is not the last stage
        too) receive each of its micro-batches' logits, in order. Steps are collected in
        the order they were launched: the last stage sends their logits in that order."""
        out = None
        if flight.expected:
            parts = []
            for rows in flight.expected:
                part = torch.empty(rows, self.vocab, dtype=dtype, device=self.model.norm.device)
                self._recv(part, self.topology.last_stage * self.topology.tp)
                parts.append(part)
            out = torch.cat(parts)
        for work, _ in flight.pending:
            work.wait()
        return out


@dataclass
class Flight:
    """A step launched through a stage: its sends not yet known to be done (each with its
    tensor, kept alive until then), and on rank 0 the logits rows of each micro-batch."""

    pending: list = field(default_factory=list)
    expected: list[int] = field(default_factory=list)


@dataclass
class MicroBatch:
    """A run of whole chunks of a step: its token range and what belongs to it."""

    start: int
    end: int
    chunks: range  # indices into the step's query_lens
    head_rows: list[int] = field(default_factory=list)  # relative to start


def stage_weights(weights, layers: range) -> dict:
    """The weights a stage reads: its layers', and the rest (embedding, norm, head)."""
    out = {}
    for name, w in weights.items():
        head, _, rest = name.partition(".layers.")
        if not rest or int(rest.partition(".")[0]) in layers:
            out[name] = w
    return out


def micro_batches(query_lens: list[int], head_rows: list[int], parts: int) -> list[MicroBatch]:
    """Cut a step's chunks (whole, in order) into up to `parts` runs of about equal tokens."""
    total = sum(query_lens)
    out, start, first, at = [], 0, 0, 0
    for i, n in enumerate(query_lens):
        at += n
        if at * parts >= total * (len(out) + 1) or i == len(query_lens) - 1:
            out.append(MicroBatch(start, at, range(first, i + 1)))
            start, first = at, i + 1
    for mb in out:
        mb.head_rows = [r - mb.start for r in head_rows if mb.start <= r < mb.end]
    return out
