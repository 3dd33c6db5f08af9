"""What a step does with its logits: each sampling row's next token (grammar masks first),
a verify chunk's accepted guesses, the siblings of a request of n > 1, and the request
alone failed where its own sampling raises. LLMEngine.step (engine/engine.py) calls
`sample_all` once a step."""

from __future__ import annotations

import logging

import torch

from tokenworks.engine.request import FinishReason
from tokenworks.engine.sampler import ForwardOutput, prepare_rows, sample_row
from tokenworks.engine.sequence import Sequence
from tokenworks.engine.step_log import StepCounts

log = logging.getLogger("tokenworks.engine")


def sample_all(engine, items: list, forward: ForwardOutput, counts: StepCounts) -> list[Sequence]:
    """Each sampling sequence's next token (its siblings' too, once its prompt is done),
    or the tokens a verify chunk accepts; a sequence whose grammar or sampling raises
    fails its own request alone."""
    rows, matchers = [], []  # each logits row's sequence and grammar state
    for item in items:
        rows += [item.seq] * (1 + len(item.draft))
        if item.draft:
            matchers += engine.speculator.row_matchers(item.seq, item.draft)
        else:
            matchers.append(item.seq.matcher)
    logits, argmax = prepare_rows(
        forward, rows, lambda x, guided: mask(engine, x, guided, rows), matchers
    )
    sampled: list[Sequence] = []
    end = 0
    for item in items:
        seq, r = item.seq, end
        end += 1 + len(item.draft)
        if seq.finished:  # its grammar failed above
            continue
        try:
            if item.draft:
                group = [seq]
                rows_logits = None if logits is None else logits[r:end]
                accept(engine, item, rows_logits, argmax[r:end], counts)
            else:
                group = fork(engine, seq)
                for s in group:
                    if s.params.max_tokens == 0:  # the prompt alone was asked for
                        s.finish(FinishReason.LENGTH)
                        continue
                    s.append(sample_row(logits, r, s, argmax[r]))
                    counts.emitted += 1
            for s in group:
                if s.finished:
                    engine.scheduler.remove(s)
                    if s.group_finished:
                        engine.requests.pop(s.request_id, None)
            sampled += group
        except Exception as e:
            fail_request(engine, seq, e)
    return [s for s in sampled if s.request_id not in engine.failures]


def accept(engine, item, logits, argmax: list[int], counts: StepCounts) -> None:
    """A verify chunk's verdict: the accepted guesses and the target's own token join
    the sequence; the K/V of its last real token and of the accepted guesses count as
    computed, and the blocks written only for rejected guesses go back."""
    seq = item.seq
    results = engine.speculator.verify(seq, item.draft, logits, argmax)
    counts.draft_tokens += len(item.draft)
    counts.accepted_tokens += len(results) - 1
    engine.blocks.computed(seq, len(results))
    engine.blocks.trim(seq)
    for result in results:
        seq.append(result)
        counts.emitted += 1
        if seq.finished:  # a stop inside the accepted run: the rest is dropped
            break
    engine.blocks.commit(seq, seq.n_cached)  # the accepted tokens' full blocks


def fork(engine, seq: Sequence) -> list[Sequence]:
    """seq, and where its prompt is done for a request of n > 1, its n - 1 siblings,
    sharing its blocks (parallel sampling: each then samples its own token)."""
    group = [seq]
    if seq.params.n > 1 and len(seq.group) == 1:
        for i in range(1, seq.params.n):
            child = seq.spawn(i)
            engine.blocks.fork(seq, child)
            engine.scheduler.add_running(child)
            group.append(child)
    return group


def mask(engine, logits: torch.Tensor, guided: list, sampling: list[Sequence]) -> None:
    """The grammar masks of the guided rows; a row whose matcher raises fails its own
    request (the others keep their masks)."""
    try:
        engine.grammars.mask_rows(logits, guided)
        return
    except Exception:
        pass
    for r, matcher in guided:  # again one at a time, to find the one that raised
        try:
            engine.grammars.mask_rows(logits, [(r, matcher)])
        except Exception as e:
            fail_request(engine, sampling[r], e)


def fail_request(engine, seq: Sequence, error: Exception) -> None:
    """Sampling for seq raised: its request alone ends, with finish reason "error" and
    the reason in `failures`; its blocks go back to the pool."""
    log.exception("request %s failed while sampling; the others carry on", seq.request_id)
    engine.failures[seq.request_id] = f"{type(error).__name__}: {error}"
    for s in seq.group:
        if not s.finished:
            s.finish(FinishReason.ERROR)
        engine.scheduler.remove(s)
    engine.requests.pop(seq.request_id, None)
