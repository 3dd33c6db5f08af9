"""CoreClient: the one front of an engine core (engine/core.py), wherever the core runs.

start() binds two ZeroMQ sockets and starts the core: `python -m tokenworks.engine.core` in
a process of its own (backend "mp", on private ipc paths), a Ray actor (backend "ray", over
TCP: engine/ray_cores.py), or a thread of this process over in-process sockets (backend
"thread", on an engine already built or built here). It waits for the core's Ready; `engine`
then holds what the API process needs of the model (EngineView: tokenizer, context,
admission; the LLMEngine itself in a thread). submit() sends a request and returns its
stream once the core accepted it (or raises what the core's add_request raised); abort()
cancels one.

A thread reads the core's outputs, turns their token ids into text and finds stop strings
(engine/detokenizer.py: one place for every backend), and hands each update to its
stream's event loop; it also watches the core: if it dies, every request in flight fails
with RequestFailedError within a poll (100 ms) and is_running turns False.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time

import msgspec
import zmq

from tokenworks.config import EngineConfig
from tokenworks.engine import core_messages as m
from tokenworks.engine.detokenizer import RequestText
from tokenworks.engine.messages import (
    EngineCoreDiedError,
    EngineNotRunningError,
    RequestFailedError,
)
from tokenworks.front.engine_view import REFUSALS, EngineView
from tokenworks.front.interface import EngineFront, Submission
from tokenworks.front.streams import (
    RequestStream,
    Stream,
    backlog_verdict,
    once_accepted,
    too_slow,
)

log = logging.getLogger("tokenworks.engine")

POLL_MS = 100  # how often the reader looks at the core between outputs
SEND_TIMEOUT_MS = 2000  # a command the core does not take in this long: the core is gone
# where cores run: a thread of this process, local processes, or Ray actors
BACKENDS = ("thread", "mp", "ray")
_threads = itertools.count()  # names of in-process socket pairs


class CoreClient(EngineFront):
    def __init__(
        self,
        config: EngineConfig | None = None,
        startup_timeout_s: float = 600.0,
        observer=None,  # serve/metrics.py's, called in the reader thread
        max_backlog: int | None = None,  # how far a stream's reader may fall behind
        max_stall_s: float | None = None,
        restart: bool = False,  # start a new core when one dies
        on_death=None,  # called (in the reader thread) with why, when a core died for good
        backend: str = "mp",  # thread, mp (a child process) or ray (engine/ray_cores.py)
        engine=None,  # an LLMEngine already built, to run in a thread (backend "thread")
        # "module:function" the core calls before it builds its engine, in its own process
        # (a plugin, or a test's injected faults); a thread core runs in this process, so
        # it is called here
        init: str | None = None,
    ):
        if engine is not None:
            backend, config = "thread", engine.config
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
        if config is None:
            raise ValueError("give the EngineConfig of the core to start, or its engine")
        if restart and backend == "thread":
            raise ValueError("restart needs a core of its own (backend mp or ray)")
        self.backend = backend
        self.config = config
        self.startup_timeout_s = startup_timeout_s
        self.observer = observer
        self.max_backlog, self.max_stall_s = max_backlog, max_stall_s
        self.restart, self.on_death = restart, on_death
        self.restarts = 0
        self.init = init
        self.gauges = None  # the core's EngineGauges as of its last step
        self.ready: m.Ready | None = None
        self.engine = engine  # after start(): an EngineView, or the LLMEngine in a thread
        self.process = None  # a subprocess.Popen, a ray_cores.RayCore or a core.CoreThread
        self.died: str | None = None  # why the core is gone, once it is
        self._streams: dict[str, Stream] = {}
        # requests a stop string ended here: their finish reasons and tokens, until the
        # core's timings for them arrive (engine/detokenizer.py's RequestText.outcome)
        self._outcomes: dict[str, tuple[list[str], int]] = {}
        self._lock = threading.Lock()  # the commands socket and _streams
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._dir: tempfile.TemporaryDirectory | None = None  # the ipc sockets' (backend mp)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self.process is not None:
            return
        self._stopping = False
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self._outputs = self._context.socket(zmq.PULL)
        self._dir = None
        if self.backend == "ray":  # over TCP: the actor may run on another node
            from tokenworks.engine import ray_cores

            host = ray_cores.connect()
            self._commands.bind(f"tcp://{host}:*")
            self._outputs.bind(f"tcp://{host}:*")
        elif self.backend == "thread":
            name = f"inproc://tokenworks-core-{os.getpid()}-{next(_threads)}"
            self._commands.bind(f"{name}-commands")
            self._outputs.bind(f"{name}-outputs")
        else:  # on private ipc paths
            self._dir = tempfile.TemporaryDirectory(prefix="tokenworks-core-")
            self._commands.bind(f"ipc://{self._dir.name}/commands")
            self._outputs.bind(f"ipc://{self._dir.name}/outputs")
        commands = self._commands.getsockopt_string(zmq.LAST_ENDPOINT)
        outputs = self._outputs.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.backend == "ray":
            entry = "tokenworks.engine.core:serve_core_json"  # (named: the core needs torch)
            self.process = ray_cores.RayCore(entry, self.config, commands, outputs, self.init)
        elif self.backend == "thread":
            from tokenworks.engine.core import CoreThread, run_init
            from tokenworks.engine.engine import LLMEngine

            run_init(self.init)
            if self.engine is None:
                self.engine = LLMEngine(self.config)
            self.process = CoreThread(self.engine, self._context, commands, outputs)
        else:
            config = msgspec.json.encode(self.config).decode()
            argv = [sys.executable, "-m", "tokenworks.engine.core", "--commands", commands,
                    "--outputs", outputs, "--config", config,
                    "--parent", str(os.getpid())]  # fmt: skip
            argv += ["--init", self.init] if self.init else []
            # it imports what this process can (the init hook's module too)
            env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            # a group of its own: a signal to the server's group reaches the server, which
            # then stops its core itself once its requests are done
            self.process = subprocess.Popen(argv, start_new_session=True, env=env)
        self.ready = self._wait_ready()
        log.info("engine core %d: %s", self.ready.pid, self.ready.describe)
        if self.engine is None:  # (a restarted core serves the same model)
            self.engine = EngineView.build(self.config, self.ready)
        self.died = None
        self._reader = threading.Thread(target=self._read, name="core-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> m.Ready:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._outputs.poll(POLL_MS):
                message = m.decode_from_core(self._outputs.recv())
                if isinstance(message, m.Ready):
                    return message
            code = self.process.poll()
            if code is not None:
                self._close()
                raise EngineCoreDiedError(
                    f"the engine core exited with code {code} before it was ready (its log "
                    "above says why)"
                )
        self.process.kill()
        self._close()
        raise EngineCoreDiedError(f"the engine core was not ready in {self.startup_timeout_s} s")

    def shutdown(self) -> None:
        """Stop the core (it finishes the step in progress); requests still in flight fail
        with EngineNotRunningError. Never waits on a core that is gone."""
        if self.process is None:
            return
        self._stopping = True
        self._send(m.Shutdown())
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.error("the engine core did not stop in 30 s; killing it")
            self.process.kill()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self._reader is not None:
            self._reader.join(timeout=5)
        self.fail_all("the server is shutting down")
        self._close()
        self.process = None

    def kill(self) -> None:
        """Stop the core now, without waiting for anything (a second signal)."""
        if self.process is not None:
            self.process.kill()
        if self._dir is not None:
            self._dir.cleanup()

    def _close(self) -> None:
        if self._context.closed:
            return
        self._commands.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        if self._dir is not None:
            self._dir.cleanup()

    @property
    def is_running(self) -> bool:
        return self.process is not None and self.died is None and self.process.poll() is None

    # ------------------------------------------------------------------ the async side

    def configure(self, observer=None, max_backlog=None, max_stall_s=None) -> None:
        self.observer, self.max_backlog, self.max_stall_s = observer, max_backlog, max_stall_s

    def holds(self, request_id: str) -> bool:
        """Is this request in flight here?"""
        return request_id in self._streams

    def in_flight(self) -> int:
        return len(self._streams)

    def _send(self, message) -> None:
        """Send a command; one the core does not take (it is gone) is dropped: the reader
        finds the core dead and fails its requests."""
        with self._lock:
            if self.died is not None or self._context.closed:
                return
            try:
                self._commands.send(m.encode(message))
            except zmq.Again:
                log.error("the engine core took no command for %d ms", SEND_TIMEOUT_MS)

    def _check_running(self) -> None:
        if not self.is_running or self._stopping:
            raise EngineNotRunningError(
                f"the engine core is not running ({self.died or 'not started or stopping'})"
            )

    async def submit(self, job: Submission) -> RequestStream:
        """EngineFront.submit, kv_export and kv_import included."""
        self._check_running()
        request_id = job.request_id or self.new_request_id()
        text = RequestText(job.params, self.engine.tokenizer, job.prompt_token_ids)
        stream = Stream(request_id, asyncio.get_running_loop(), asyncio.Queue(), text)
        with self._lock:
            self._streams[request_id] = stream
        self._send(m.AddRequest(
            request_id=request_id, prompt_token_ids=list(job.prompt_token_ids), params=job.params,
            priority=job.priority, cache_salt=job.cache_salt, kv_export=job.kv_export,
            kv_import=job.kv_import, lora=job.lora,
        ))  # fmt: skip
        return await once_accepted(stream, self.abort, job.deadline)

    async def lora(self, action: str, name: str, path: str | None = None) -> None:
        """EngineFront.lora: the command sent to the core, its answer awaited."""
        self._check_running()
        request_id = self.new_request_id("lora")
        stream = Stream(request_id, asyncio.get_running_loop(), asyncio.Queue(), None)
        with self._lock:
            self._streams[request_id] = stream
        self._send(m.LoRACommand(request_id, action, name, path))
        try:
            answer = await stream.queue.get()
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
        if isinstance(answer, BaseException):
            raise answer

    def abort(self, request_id: str) -> None:
        with self._lock:
            gone = self._streams.pop(request_id, None) is None
        if not gone:
            self._send(m.Abort(request_id))

    # ------------------------------------------------------------------ the reader thread

    def _read(self) -> None:
        while not self._stopping:
            if not self._outputs.poll(POLL_MS):
                code = self.process.poll()
                if code is not None and not self._stopping:
                    self._died(f"the engine core exited with code {code}")
                    return
                continue
            try:
                message = m.decode_from_core(self._outputs.recv())
            except msgspec.DecodeError as e:
                log.error("an output the API process cannot read was dropped: %s", e)
                continue
            try:
                self._deliver(message)
            except Exception:  # a bug in delivering must not stop the reader
                log.exception("delivering the core's outputs failed")

    def _died(self, why: str) -> None:
        """Fail every request in flight, then start a new core or report the death."""
        self.died = why
        log.error("%s; failing every request in flight", why)
        self._fail(why, RequestFailedError)
        if self.restart and not self._stopping:
            self.restarts += 1
            log.warning("starting a new engine core (restart %d)", self.restarts)
            self._close()
            self.process = None
            try:
                self.start()  # a new reader thread takes over from this one
                return
            except EngineCoreDiedError as e:
                why = f"{why}, and a new core did not start: {e}"
                self.died = why
        if self.on_death is not None:
            self.on_death(why)

    def _deliver(self, message) -> None:
        if isinstance(message, m.Outputs):
            self._deliver_outputs(message)
            return
        with self._lock:
            keep = isinstance(message, m.Accepted)
            pop = self._streams.get if keep else self._streams.pop
            stream = pop(message.request_id, None)
        if stream is None:
            return
        if isinstance(message, m.Accepted):
            stream.push(None)
        elif isinstance(message, m.Refused):
            stream.push(REFUSALS.get(message.error, ValueError)(message.message))
        elif isinstance(message, m.Failed):
            stream.push(RequestFailedError(message.message))

    def _deliver_outputs(self, message: m.Outputs) -> None:
        self.gauges = message.gauges
        ready = []
        for tokens in message.updates:
            with self._lock:
                stream = self._streams.get(tokens.request_id)
            if stream is None:
                continue
            update, stops = stream.text.apply(tokens)
            for stop in stops:
                self._send(m.StopSequence(tokens.request_id, stop.index, stop.stop, stop.keep))
            if update is None:
                continue
            if update.finished:
                with self._lock:
                    self._streams.pop(update.request_id, None)
                if stream.text.stopped:
                    self._outcomes[update.request_id] = stream.text.outcome()
            ready.append((stream, update))
        self._observe(message)  # counted before a reader can see its request end
        now = time.monotonic()
        for stream, update in ready:
            stream.pushed += sum(len(d.token_ids) for d in update.deltas)
            if not stream.push(update):
                self.abort(update.request_id)  # its reader's loop is gone
            elif not update.finished:
                why = backlog_verdict(stream, now, self.max_backlog, self.max_stall_s)
                if why is not None:
                    self.abort(update.request_id)
                    stream.push(too_slow(stream, why))

    def _observe(self, out: m.Outputs) -> None:
        for finished in out.finished:  # the text's outcome, where the text ended it here
            outcome = self._outcomes.pop(finished.request_id, None)
            if outcome is not None:
                finished.finish_reasons, finished.generation_tokens = outcome
        if self.observer is None:
            return
        try:
            for seconds in out.inter_token_s:
                self.observer.on_inter_token(seconds)
            for finished in out.finished:
                self.observer.on_request_finished(finished)
            self.observer.on_step(out.preemptions, out.gauges)
        except Exception:  # a bug in reporting must not stop the outputs
            log.exception("reporting a step failed")

    def fail_all(self, why: str) -> None:
        """End every request in flight with EngineNotRunningError(why) (a shutdown)."""
        self._fail(why, EngineNotRunningError)

    def _fail(self, why: str, error: type[Exception]) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        self._outcomes.clear()
        for stream in streams:
            if not self._stopping and self.died is None:
                self._send(m.Abort(stream.request_id))
            stream.push(error(why))
