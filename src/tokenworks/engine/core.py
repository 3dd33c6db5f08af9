"""The engine core: the one loop (engine/loop.py) driving an LLMEngine behind sockets.

It says Ready on its outputs socket, then runs the loop on the commands that socket brings,
sending the outputs back; idle, it waits on the commands socket. Its client
(front/core_client.py) owns both sockets; the core runs where the client put it:

- in a process of its own (`python -m tokenworks.engine.core --config JSON --commands ADDR
  --outputs ADDR`, the server's default), exiting when its parent is gone: the event loop,
  JSON, SSE and detokenisation no longer take turns with the step (vLLM's EngineCore has
  the same shape);
- in a Ray actor (engine/ray_cores.py), over TCP;
- in a thread of the client's process (CoreThread), over in-process sockets, on an engine
  the caller already built (tests, benchmarks, notebooks).
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
from collections.abc import Callable

import msgspec
import zmq

from tokenworks.config import EngineConfig
from tokenworks.engine import core_messages as m
from tokenworks.engine.engine import LLMEngine
from tokenworks.engine.loop import EngineLoop, Unreadable

log = logging.getLogger("tokenworks.engine")


class SocketInbox:
    """The loop's commands from the client's PUSH socket, decoded."""

    def __init__(self, commands: zmq.Socket):
        self.commands = commands

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.commands.poll(timeout_ms))

    def take(self):
        while True:
            try:
                data = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                yield m.decode_to_core(data)
            except msgspec.DecodeError as e:
                yield Unreadable(m.request_id_of(data), str(e))


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
        self.loop = EngineLoop(engine, self.send)

    def ready(self) -> m.Ready:
        e, adm = self.engine, self.engine.admission
        return m.Ready(
            pid=os.getpid(), model_id=e.loaded.model_id, describe=e.describe(),
            vocab_size=adm.vocab_size, max_model_len=adm.context, context_source=adm.context_source,
            num_blocks=adm.num_blocks, block_size=adm.block_size,
            kv_groups=[(list(g.layers), g.window) for g in adm.layout.groups],
            kv_group_size=adm.layout.size, prompt_pass=adm.chunk,
        )  # fmt: skip

    def send(self, message) -> None:
        self.outputs.send(m.encode(message))

    def run(self) -> None:
        self.send(self.ready())
        for _ in self.loop.turns(SocketInbox(self.commands), self.keep_running):
            pass


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
