"""The engine core: the one loop that drives an LLMEngine, stepping back to back.

It says Ready on its outputs socket, then loops: take every command waiting (add, abort,
stop, shutdown), run one step, send every request's update of that step in one message.
Idle, it waits on the commands socket. Its client (front/core_client.py) owns both
sockets; the core runs where the client put it:

- in a process of its own (`python -m tokenworks.engine.core --config JSON --commands ADDR
  --outputs ADDR`, the server's default), exiting when its parent is gone: the event loop,
  JSON, SSE and detokenisation no longer take turns with the step (vLLM's EngineCore has
  the same shape);
- in a Ray actor (engine/ray_cores.py), over TCP;
- in a thread of the client's process (CoreThread), over in-process sockets, on an engine
  the caller already built (tests, benchmarks, notebooks).

Whatever raises in a step fails the requests it touched, once, and the loop goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from tokenworks.config import EngineConfig
from tokenworks.engine import core_messages as m
from tokenworks.engine.engine import LLMEngine
from tokenworks.engine.kv_transfer import export_prefix, import_prefix
from tokenworks.engine.messages import CompletionDelta, EngineGauges, RequestMetrics, RequestUpdate
from tokenworks.engine.sequence import Sequence

log = logging.getLogger("tokenworks.engine")

IDLE_POLL_MS = 500  # how often an idle core looks whether it should still run


def gauges_of(engine: LLMEngine) -> EngineGauges:
    """The engine's gauges as /metrics shows them."""
    prefix, spec, host = engine.blocks.prefix, engine.speculator, engine.blocks.host
    return EngineGauges(
        len(engine.scheduler.running),
        len(engine.scheduler.waiting),
        engine.blocks.usage,
        prefix.queried_tokens if prefix is not None else None,
        prefix.hit_tokens if prefix is not None else None,
        spec.metrics if spec is not None else None,
        engine.totals["generation_tokens"],
        host.offloaded if host is not None else None,
        host.restored if host is not None else None,
        host.nbytes if host is not None else None,
        host.dropped if host is not None else None,
    )


def request_metrics(head: Sequence, t_first: float | None, now: float) -> RequestMetrics:
    """A finished request's timings, from its first sequence."""
    t_submit = head.arrival_time
    return RequestMetrics(
        head.request_id,
        [str(s.finish_reason) for s in head.group],
        len(head.prompt_ids),
        sum(len(s.output_ids) for s in head.group),
        head.scheduled_time - t_submit if head.scheduled_time is not None else None,
        t_first - t_submit if t_first is not None else None,
        now - t_submit,
        head.num_cached_prompt_tokens,
        head.prefix_miss,
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
                s.index,
                "",
                s.output_ids[k:],
                logprobs,
                s.finish_reason,
                s.stop_reason,
                s.reasoning_tokens,
            )  # fmt: skip
        )
    return RequestUpdate(
        head.request_id,
        deltas,
        head.group_finished,
        len(head.prompt_ids),
        head.num_cached_prompt_tokens,
        head.prompt_logprobs if first else None,
        head.embedding if head.group_finished else None,
    )


@dataclass
class _Sent:
    """What the core has sent of one request in flight."""

    emitted: dict[int, int] = field(default_factory=dict)  # tokens, per completion index
    export: bool = False  # write the prompt's KV blocks out when it ends (kv_transfer.py)
    first: float | None = None  # when its first and latest updates went out
    last: float | None = None


class EngineCore:
    def __init__(
        self,
        engine: LLMEngine,
        commands: zmq.Socket,
        outputs: zmq.Socket,
        keep_running: Callable[[], bool],
    ):
        """keep_running: False once nobody reads the outputs (the client's process is gone)."""
        self.engine, self.commands, self.outputs = engine, commands, outputs
        self.keep_running = keep_running
        self.sent: dict[str, _Sent] = {}  # the requests in flight
        self.preemptions = engine.totals["preemptions"]  # when the last outputs went out

    def ready(self) -> m.Ready:
        e, adm = self.engine, self.engine.admission
        return m.Ready(
            os.getpid(), e.loaded.model_id, e.describe(), adm.vocab_size, adm.context,
            adm.context_source, adm.num_blocks, adm.block_size,
            [(list(g.layers), g.window) for g in adm.layout.groups], adm.layout.size,
            adm.chunk,
        )  # fmt: skip

    def send(self, message) -> None:
        self.outputs.send(m.encode(message))

    def run(self) -> None:
        self.send(self.ready())
        while True:
            busy = self.engine.has_unfinished()
            if self.commands.poll(0 if busy else IDLE_POLL_MS):
                if not self.apply_commands():
                    return
                if not self.engine.has_unfinished():  # e.g. an abort freed blocks while idle
                    self.send(m.Outputs([], gauges_of(self.engine)))
            if not self.keep_running():
                return
            if self.engine.has_unfinished():
                self.step()
            if self.engine.broken:  # no step can run again: end what is in flight, and stop
                log.error("the engine cannot run: %s", self.engine.broken)
                self.fail(list(self.sent), f"the engine stopped: {self.engine.broken}")
                return

    def apply_commands(self) -> bool:
        """Every command waiting; False on shutdown."""
        while True:
            try:
                data = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                command = m.decode_to_core(data)
            except msgspec.DecodeError as e:  # refuse it by id where it has one
                request_id = m.request_id_of(data)
                log.error("a command the core cannot read was dropped (%s): %s", request_id, e)
                if request_id is not None:
                    self.send(m.Refused(request_id, "ValueError", f"the request is invalid: {e}"))
                continue
            if isinstance(command, m.Shutdown):
                return False
            if isinstance(command, m.Abort):
                self.sent.pop(command.request_id, None)
                self.engine.abort_request(command.request_id)
                continue
            if isinstance(command, m.StopSequence):
                self.stop_sequence(command)
                continue
            if command.kv_import is not None:
                self.import_blocks(command)
            try:
                self.engine.add_request(
                    prompt_token_ids=command.prompt_token_ids,
                    params=command.params,
                    request_id=command.request_id,
                    priority=command.priority,
                    cache_salt=command.cache_salt,
                )
            except Exception as e:  # bad input or a full queue: the caller's to report
                self.send(m.Refused(command.request_id, type(e).__name__, str(e)))
                continue
            self.sent[command.request_id] = _Sent(export=command.kv_export)
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
        """End these requests in the engine and tell the client, once."""
        for request_id in request_ids:
            self.sent.pop(request_id, None)
            self.engine.abort_request(request_id)
            self.send(m.Failed(request_id, message))

    def step(self) -> None:
        engine = self.engine
        try:
            sampled = engine.step()
        except Exception as e:  # LLMEngine aborted the requests the forward pass touched
            log.exception("a step failed; failing the requests it touched")
            touched = [r for r in self.sent if r not in engine.requests]
            if not touched:  # it raised before touching one (scheduling, proposing): rather
                touched = list(self.sent)  # than fail the same way every step, end them all
            self.fail(touched, f"the engine failed while running this request: {e}")
            return
        for request_id, why in engine.take_failures().items():
            self.fail([request_id], f"the engine failed for this request: {why}")
        try:
            self.send(self.outputs_of(sampled))
        except Exception as e:  # a bug in reporting fails what it reports, not the loop
            log.exception("reporting a step failed")
            self.fail([s.request_id for s in sampled if s.request_id in self.sent], str(e))

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


def _connect(context: zmq.Context, commands_address: str, outputs_address: str):
    commands = context.socket(zmq.PULL)
    commands.connect(commands_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(outputs_address)
    return commands, outputs


def _close(commands: zmq.Socket, outputs: zmq.Socket) -> None:
    outputs.close(linger=1000)
    commands.close(linger=0)


def run_init(init: str | None) -> None:
    """Call the core's init hook, "module:function" (CoreClient's init), if it has one."""
    if init:
        module, _, function = init.partition(":")
        if not function:
            raise ValueError(f"init {init!r}: expected module:function")
        getattr(importlib.import_module(module), function)()


def serve_core(
    config: EngineConfig,
    commands_address: str,
    outputs_address: str,
    init: str | None = None,
    parent: int | None = None,
) -> None:
    """Load the engine, connect to the client's two sockets and run until shut down (or
    until the client's process, `parent`, is gone: a client that died while this core
    started is seen too). A core process's main, and a Ray actor's run."""
    run_init(init)
    # the client detokenises (engine/detokenizer.py): the core only steps
    config = dataclasses.replace(config, detokenize=False)
    parent = os.getppid() if parent is None else parent
    context = zmq.Context()
    commands, outputs = _connect(context, commands_address, outputs_address)
    try:
        EngineCore(LLMEngine(config), commands, outputs, lambda: os.getppid() == parent).run()
    finally:
        _close(commands, outputs)
        context.term()


def serve_core_json(config_json: str, commands: str, outputs: str, init: str | None) -> None:
    """serve_core with the config as JSON: a Ray actor's entry (engine/ray_cores.py), since
    Ray would pickle a config object."""
    serve_core(msgspec.json.decode(config_json, type=EngineConfig), commands, outputs, init)


class CoreThread:
    """An engine core in a thread of the client's process, on an engine already built,
    with a process's face (poll, wait, kill) for the client."""

    def __init__(self, engine: LLMEngine, context: zmq.Context, commands: str, outputs: str):
        self.engine, self.context = engine, context
        self.addresses = commands, outputs
        self.code: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        engine = self.engine
        detokenize = engine.config.detokenize  # the client holds the text, as over a process
        engine.config = dataclasses.replace(engine.config, detokenize=False)
        commands, outputs = _connect(self.context, *self.addresses)
        engine.core_thread = True
        try:
            EngineCore(engine, commands, outputs, lambda: not self._stop.is_set()).run()
            self.code = 0
        except BaseException:
            log.exception("the engine core thread failed")
            self.code = 1
        finally:
            engine.core_thread = False
            engine.config = dataclasses.replace(engine.config, detokenize=detokenize)
            _close(commands, outputs)

    @property
    def pid(self) -> int:
        return os.getpid()

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else (self.code if self.code is not None else 1)

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired("engine core thread", timeout)
        return self.poll()

    def kill(self) -> None:
        """Stop after the step in progress (a thread cannot be stopped mid-step)."""
        self._stop.set()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="an engine core process (started by the server)")
    p.add_argument("--config", required=True, help="the EngineConfig as JSON")
    p.add_argument("--commands", required=True, help="ZeroMQ address to take commands from")
    p.add_argument("--outputs", required=True, help="ZeroMQ address to send outputs to")
    p.add_argument("--init", help="module:function to call before the engine is built")
    p.add_argument("--parent", type=int, help="the client's pid: stop once it is gone")
    args = p.parse_args(argv)
    # the client starts this process in a process group of its own, so a signal to the
    # server's group reaches the server alone and it stops the core when it is done; a
    # stray Ctrl-C from a terminal that still reaches it is left to the server too
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s[core]: %(message)s")
    config = msgspec.json.decode(args.config, type=EngineConfig)
    serve_core(config, args.commands, args.outputs, args.init, args.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
