"""The engine core: an LLMEngine in a process of its own, stepping back to back.

`python -m tokenworks.engine.core --config JSON --commands ADDR --outputs ADDR` loads the
model, says Ready on the outputs socket, then loops: take every command waiting (add,
abort, shutdown), run one step, send every request's update of that step in one message.
Idle, it waits on the commands socket. The API process (engine/core_client.py) owns both
sockets; the core connects to them and exits when its parent is gone.

Keeping the forward pass out of the API process gives it an interpreter of its own: the
event loop, JSON, SSE and detokenisation no longer take turns with the step (vLLM's
EngineCore has the same shape).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from tokenworks.config import EngineConfig
from tokenworks.engine import core_messages as m
from tokenworks.engine.async_engine import (
    EngineGauges,
    by_request,
    request_metrics,
    request_update,
)
from tokenworks.engine.engine import LLMEngine

log = logging.getLogger("tokenworks.engine")

IDLE_POLL_MS = 500  # how often an idle core looks for its parent


@dataclass
class _Sent:
    """What the core has sent of one request in flight."""

    emitted: dict[int, int] = field(default_factory=dict)  # tokens, per completion index
    first: float | None = None  # when its first and latest updates went out
    last: float | None = None


class EngineCore:
    def __init__(self, engine: LLMEngine, commands: zmq.Socket, outputs: zmq.Socket):
        self.engine, self.commands, self.outputs = engine, commands, outputs
        self.sent: dict[str, _Sent] = {}  # the requests in flight
        self.parent = os.getppid()

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
                    self.send(m.Outputs([], EngineGauges.of(self.engine)))
            if os.getppid() != self.parent:  # the API process is gone: nobody reads us
                return
            if self.engine.has_unfinished():
                self.step()

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
            self.sent[command.request_id] = _Sent()
            self.send(m.Accepted(command.request_id))

    def stop_sequence(self, command: m.StopSequence) -> None:
        """A stop string ended a completion; where that ends its request, its timings go
        out (the API process already ended its stream)."""
        head = self.engine.requests.get(command.request_id)
        done = self.engine.stop_sequence(
            command.request_id, command.index, command.stop, command.keep
        )
        sent = self.sent.pop(command.request_id, None) if done else None
        if sent is not None:
            metrics = request_metrics(head, head.arrival_time, sent.first, time.monotonic())
            self.send(m.Outputs([], EngineGauges.of(self.engine), finished=[metrics]))

    def step(self) -> None:
        engine = self.engine
        try:
            sampled = engine.step()
        except Exception as e:  # the engine aborted the requests this step touched
            log.exception("a forward pass failed; failing the requests it touched")
            for request_id in [r for r in self.sent if r not in engine.requests]:
                del self.sent[request_id]
                self.send(m.Failed(request_id, f"the engine failed while running it: {e}"))
            return
        for request_id, why in engine.take_failures().items():
            self.sent.pop(request_id, None)
            self.send(m.Failed(request_id, f"the engine failed for this request: {why}"))
        now = time.monotonic()
        out = m.Outputs([], EngineGauges.of(engine), engine.stats[-1].preemptions)
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
                del self.sent[request_id]
                out.finished.append(request_metrics(head, head.arrival_time, sent.first, now))
            out.updates.append(update)
        self.send(out)


def serve_core(config: EngineConfig, commands_address: str, outputs_address: str) -> None:
    """Load the engine, connect to the API process's two sockets and run until shut down
    (or until that process is gone). A core process's main, and a Ray actor's run."""
    # the API process detokenises (engine/detokenizer.py): this process only steps
    config = dataclasses.replace(config, detokenize=False)
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(commands_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(outputs_address)
    try:
        EngineCore(LLMEngine(config), commands, outputs).run()
    finally:
        outputs.close(linger=1000)
        commands.close(linger=0)
        context.term()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="an engine core process (started by the server)")
    p.add_argument("--config", required=True, help="the EngineConfig as JSON")
    p.add_argument("--commands", required=True, help="ZeroMQ address to take commands from")
    p.add_argument("--outputs", required=True, help="ZeroMQ address to send outputs to")
    args = p.parse_args(argv)
    # Ctrl-C reaches the terminal's whole process group: the server stops this core itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s[core]: %(message)s")
    serve_core(msgspec.json.decode(args.config, type=EngineConfig), args.commands, args.outputs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
