"""The one loop that steps an engine: take the commands waiting (add, abort, stop, shut
down), run one step, send every request's update of that step in one message.

Everything that steps an LLMEngine goes through it: the engine core behind a server
(engine/core.py, commands and outputs on ZeroMQ sockets), the offline LLM (llm.py, in the
caller's thread), the warm-up (engine/warmup.py) and the benchmarks that time steps. Where
the commands come from and where the outputs go is the caller's: an Inbox and a `send`.

Whatever raises in a step fails the requests it touched, once, and the loop goes on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from tokenworks.engine import core_messages as m
from tokenworks.engine.kv_transfer import export_prefix, import_prefix
from tokenworks.engine.messages import CompletionDelta, EngineGauges, RequestMetrics, RequestUpdate
from tokenworks.engine.request import FinishReason
from tokenworks.engine.sequence import Sequence

log = logging.getLogger("tokenworks.engine")

IDLE_POLL_MS = 500  # how often an idle loop looks whether it should still run


def gauges_of(engine) -> EngineGauges:
    """The engine's gauges as /metrics shows them."""
    prefix, spec, host = engine.blocks.prefix, engine.speculator, engine.blocks.host
    scheduler, loras, blocks = engine.scheduler, engine.lora, engine.blocks
    windows = blocks.windows if len(blocks.windows) > 1 else []
    return EngineGauges(
        running=len(engine.scheduler.running),
        waiting=len(engine.scheduler.waiting),
        kv_usage=engine.blocks.usage,
        prefix_queried=prefix.queried_tokens if prefix is not None else None,
        prefix_hits=prefix.hit_tokens if prefix is not None else None,
        speculation=spec.metrics if spec is not None else None,
        generation_tokens=engine.totals["generation_tokens"],
        offloaded_blocks=host.offloaded if host is not None else None,
        restored_blocks=host.restored if host is not None else None,
        offload_bytes=host.nbytes if host is not None else None,
        offload_dropped_blocks=host.dropped if host is not None else None,
        max_loras=loras.max_loras if loras is not None else None,
        running_loras=sorted({s.lora for s in scheduler.running if s.lora}) if loras else [],
        waiting_loras=sorted({s.lora for s in scheduler.waiting if s.lora}) if loras else [],
        kv_blocks=blocks.num_blocks,
        kv_free_blocks=blocks.num_free,
        kv_group_windows=list(windows),
        kv_group_blocks=blocks.held_by_group(scheduler.running) if windows else [],
    )


def request_metrics(head: Sequence, t_first: float | None, now: float) -> RequestMetrics:
    """A finished request's timings, from its first sequence."""
    t_submit = head.arrival_time
    return RequestMetrics(
        request_id=head.request_id,
        finish_reasons=[str(s.finish_reason) for s in head.group],
        prompt_tokens=len(head.prompt_ids),
        generation_tokens=sum(len(s.output_ids) for s in head.group),
        queue_time=head.scheduled_time - t_submit if head.scheduled_time is not None else None,
        ttft=t_first - t_submit if t_first is not None else None,
        e2e=now - t_submit,
        cached_tokens=head.num_cached_prompt_tokens,
        prefix_miss=head.prefix_miss,
    )


def by_request(sampled: list[Sequence]) -> dict[str, list[Sequence]]:
    """A step's sampled sequences, grouped by request (n > 1 gives several)."""
    out: dict[str, list[Sequence]] = {}
    for seq in sampled:
        out.setdefault(seq.request_id, []).append(seq)
    return out


def request_update(head: Sequence, seqs: list[Sequence], emitted: dict[int, int]) -> RequestUpdate:
    """What a step gave one request (head: its first sequence; seqs: those of its
    completions the step sampled), past the tokens `emitted` says each completion already
    handed out (updated here). Token ids alone: the client holds the text."""
    first = not emitted
    deltas = []
    for s in seqs:
        k = emitted.get(s.index, 0)
        emitted[s.index] = len(s.output_ids)
        logprobs = s.logprobs[k:] if s.logprobs is not None else None
        deltas.append(
            CompletionDelta(
                index=s.index,
                text="",
                token_ids=s.output_ids[k:],
                logprobs=logprobs,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                reasoning_tokens=s.reasoning_tokens,
            )  # fmt: skip
        )
    return RequestUpdate(
        request_id=head.request_id,
        deltas=deltas,
        finished=head.group_finished,
        prompt_tokens=len(head.prompt_ids),
        cached_tokens=head.num_cached_prompt_tokens,
        prompt_logprobs=head.prompt_logprobs if first else None,
        embedding=head.embedding if head.group_finished else None,
    )


@dataclass
class Unreadable:
    """A command that could not be decoded: refused by its request id where it has one."""

    request_id: str | None
    error: str


class Inbox(Protocol):
    """Where the loop's commands come from."""

    def poll(self, timeout_ms: int) -> bool:
        """Whether a command waits, waiting up to timeout_ms for one."""

    def take(self) -> Iterator[m.AddRequest | m.Abort | m.StopSequence | m.Shutdown | Unreadable]:
        """Every command waiting, in order."""


class LocalInbox:
    """Commands handed over in the loop's own thread: nothing can arrive while it waits,
    so it never waits."""

    def __init__(self):
        self.commands: deque = deque()

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.commands)

    def take(self):
        while self.commands:
            yield self.commands.popleft()


@dataclass
class _Sent:
    """What the loop has sent of one request in flight."""

    head: Sequence  # its first sequence
    emitted: dict[int, int] = field(default_factory=dict)  # tokens, per completion index
    export: bool = False  # write the prompt's KV blocks out when it ends (kv_transfer.py)
    first: float | None = None  # when its first and latest updates went out
    last: float | None = None


class EngineLoop:
    def __init__(self, engine, send: Callable[[object], None] | None = None):
        """engine: an LLMEngine. send: takes each message the loop sends (core_messages'
        Outputs, Accepted, Refused, Failed); None drops them."""
        self.engine = engine
        self.send = send if send is not None else (lambda message: None)
        self.sent: dict[str, _Sent] = {}  # the requests in flight
        self.preemptions = engine.totals["preemptions"]  # when the last outputs went out

    def turns(self, inbox: Inbox, keep_running: Callable[[], bool]) -> Iterator[None]:
        """The loop: yields after each turn, and ends on a Shutdown command, once
        keep_running says False, or when the engine can run no more."""
        engine = self.engine
        while True:
            busy = engine.has_unfinished()
            if inbox.poll(0 if busy else IDLE_POLL_MS):
                if not self.apply_all(inbox.take()):
                    return
                if not engine.has_unfinished():  # e.g. an abort freed blocks while idle
                    self.send(m.Outputs([], gauges_of(engine)))
            if not keep_running():
                return
            if engine.has_unfinished():
                self.step()
            if engine.kv_events is not None:
                engine.kv_events.flush()
            if engine.broken:  # no step can run again: end what is in flight, and stop
                log.error("the engine cannot run: %s", engine.broken)
                self.fail(list(self.sent), f"the engine stopped: {engine.broken}")
                return
            yield

    def run_while(self, going: Callable[[], bool]) -> None:
        """Turn in the caller's thread, with no commands but its own, while `going` says
        True (engine.has_unfinished: until every request is done)."""
        for _ in self.turns(LocalInbox(), going):
            pass

    def apply_all(self, commands) -> bool:
        """Apply these commands in order; False on Shutdown (the rest are left)."""
        for command in commands:
            if not self.apply(command):
                return False
        return True

    def apply(self, command) -> bool:
        """One command; False for Shutdown. A request that cannot be added is Refused."""
        if isinstance(command, m.Shutdown):
            return False
        if isinstance(command, Unreadable):
            log.error("a command the core cannot read was dropped (%s): %s",
                      command.request_id, command.error)  # fmt: skip
            if command.request_id is not None:
                message = f"the request is invalid: {command.error}"
                self.send(m.Refused(command.request_id, "ValueError", message))
        elif isinstance(command, m.Abort):
            self.abort(command.request_id)
        elif isinstance(command, m.StopSequence):
            self.stop_sequence(command)
        elif isinstance(command, m.LoRACommand):
            self.lora_command(command)
        else:
            try:
                self.add(command)
            except Exception as e:  # bad input or a full queue: the caller's to report
                self.send(m.Refused(command.request_id, type(e).__name__, str(e)))
            else:
                self.send(m.Accepted(command.request_id))
        return True

    def add(self, command: m.AddRequest, prompt: str | None = None) -> Sequence:
        """Queue a request (prompt: the text its tokens came from, kept on its output); its
        first sequence. Raises what LLMEngine.add_request raises."""
        if command.kv_import is not None:
            self.import_blocks(command)
        head = self.engine.add_request(
            prompt=prompt,
            prompt_token_ids=command.prompt_token_ids,
            params=command.params,
            request_id=command.request_id,
            priority=command.priority,
            cache_salt=command.cache_salt,
            lora=command.lora,
        )
        self.sent[command.request_id] = _Sent(head, export=command.kv_export)
        return head

    def add_request(
        self, prompt_token_ids: list[int], params, prompt: str | None = None, **fields
    ) -> Sequence:
        """add() for a caller in the loop's own thread, under a request id the engine makes
        up; fields: AddRequest's others (priority, cache_salt, lora)."""
        command = m.AddRequest(self.engine.new_request_id(), list(prompt_token_ids), params,
                               **fields)  # fmt: skip
        return self.add(command, prompt)

    def abort(self, request_id: str) -> None:
        """Cancel a request: its sequences finish with reason abort and free their blocks."""
        self.sent.pop(request_id, None)
        self.engine.abort_request(request_id)

    def lora_command(self, command: m.LoRACommand) -> None:
        """Load or unload an adapter between two steps; say whether it was done."""
        try:
            loras = self.engine.lora
            if loras is None:
                raise ValueError("this engine serves no LoRA adapters: start it with "
                                 "--enable-lora or --lora-modules")  # fmt: skip
            if command.action == "load":
                loras.load(command.name, command.path)
            else:
                loras.unload(command.name)
        except Exception as e:
            self.send(m.Refused(command.request_id, type(e).__name__, str(e)))
        else:
            self.send(m.Accepted(command.request_id))

    def import_blocks(self, command: m.AddRequest) -> None:
        """Another engine prefilled the prompt: take its blocks into the prefix cache (the
        request then runs its tail alone). Where they cannot be read, it runs whole."""
        try:
            import_prefix(self.engine, command.kv_import)
        except Exception as e:
            log.warning("%s: the prefilled KV blocks were not taken (%s); running the whole "
                        "prompt", command.request_id, e)  # fmt: skip

    def stop_sequence(self, command: m.StopSequence) -> None:
        """A stop string ended a completion; where that ends its request, its timings go
        out (the client already ended its stream)."""
        head = self.engine.requests.get(command.request_id)
        done = self.engine.stop_sequence(
            command.request_id, command.index, command.stop, command.keep
        )
        sent = self.sent.pop(command.request_id, None) if done else None
        if sent is not None:
            metrics = request_metrics(head, sent.first, time.monotonic())
            self.send(m.Outputs([], gauges_of(self.engine), finished=[metrics]))

    def fail(self, request_ids: list[str], message: str) -> None:
        """End these requests in the engine (finish reason "error") and say so, once."""
        for request_id in request_ids:
            sent = self.sent.pop(request_id, None)
            self.engine.abort_request(request_id)
            for seq in sent.head.group if sent is not None else ():
                if seq.finish_reason in (None, FinishReason.ABORT):  # failed, not cancelled
                    seq.finish(FinishReason.ERROR)
            self.send(m.Failed(request_id, message))

    def step(self) -> list[Sequence]:
        """One step of the engine, its updates sent; the sequences it sampled."""
        engine = self.engine
        try:
            sampled = engine.step()
        except Exception as e:  # LLMEngine aborted the requests the forward pass touched
            log.exception("a step failed; failing the requests it touched")
            touched = [r for r in self.sent if r not in engine.requests]
            if not touched:  # it raised before touching one (scheduling, proposing): rather
                touched = list(self.sent)  # than fail the same way every step, end them all
            self.fail(touched, f"the engine failed while running this request: {e}")
            return []
        for request_id, why in engine.take_failures().items():
            self.fail([request_id], f"the engine failed for this request: {why}")
        try:
            self.send(self.outputs_of(sampled))
        except Exception as e:  # a bug in reporting fails what it reports, not the loop
            log.exception("reporting a step failed")
            self.fail([s.request_id for s in sampled if s.request_id in self.sent], str(e))
        return sampled

    def outputs_of(self, sampled: list[Sequence]) -> m.Outputs:
        now = time.monotonic()
        engine = self.engine
        # (since the last outputs: a pipeline's step may only launch a batch, and log none)
        total = engine.totals["preemptions"]
        out = m.Outputs([], gauges_of(engine), total - self.preemptions)
        self.preemptions = total
        for request_id, seqs in by_request(sampled).items():
            sent = self.sent.get(request_id)
            if sent is None:  # aborted meanwhile
                continue
            head = seqs[0].group[0]
            update = request_update(head, seqs, sent.emitted)
            if sent.first is None:
                sent.first = now
            else:
                out.inter_token_s.append(now - sent.last)
            sent.last = now
            if update.finished:
                if sent.export:
                    update.kv_blocks = export_prefix(engine, head.prompt_ids, head.cache_salt)
                del self.sent[request_id]
                out.finished.append(request_metrics(head, sent.first, now))
            out.updates.append(update)
        return out
