"""`tokenworks serve`: start the engine cores (a process of its own, several behind a router,
or a thread of this process), serve HTTP with uvicorn, stop cleanly on a signal."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

import uvicorn

from tokenworks.config import EngineConfig
from tokenworks.front.core_client import CoreClient
from tokenworks.front.disaggregated import DisaggregatedRouter
from tokenworks.front.replicas import ReplicaRouter
from tokenworks.serve import reasoning, tool_formats
from tokenworks.serve.app import build_app
from tokenworks.serve.common import ServerState
from tokenworks.serve.lab_records import RecordsFolder
from tokenworks.serve.limits import ServerLimits
from tokenworks.serve.metrics import ServerMetrics
from tokenworks.serve.remote import RemoteBackend
from tokenworks.serve.serve_config import ServeConfig
from tokenworks.tokenizer.chat import ChatTemplate

log = logging.getLogger("tokenworks.serve")


def make_state(
    engine,  # a front (CoreClient, ReplicaRouter), or an LLMEngine to run in a thread here
    names: list[str],
    request_timeout: float | None = None,
    limits: ServerLimits | None = None,
    api_keys: tuple[str, ...] | list[str] = (),
    metrics_require_key: bool = False,
    tenant_salts: bool = True,
    metrics_prefix: str = "tokenworks",
    embedding_pooling: str = "mean",
    chat_template: str | None = None,
    reasoning_parser: str = "auto",
    reasoning_budget: int | None = None,
    tool_call_parser: str = "auto",
) -> ServerState:
    metrics = ServerMetrics(names[0], metrics_prefix)
    limits = limits or ServerLimits()
    # a front (a core client, a router, front/hf_front.py's HFFront) as it is; an
    # LLMEngine runs in a core thread here
    front = engine if hasattr(engine, "submit") else CoreClient(engine=engine)
    front.configure(metrics, limits.max_stream_backlog, limits.max_stream_stall_s)
    tokenizer = front.engine.tokenizer
    chat = ChatTemplate(template_text(chat_template), tokenizer) if chat_template else None
    source = (chat or tokenizer.chat).source if (chat or tokenizer.chat) else None
    return ServerState(
        front,
        names,
        metrics,
        request_timeout=request_timeout,
        limits=limits,
        api_keys=tuple(api_keys),
        metrics_require_key=metrics_require_key,
        tenant_salts=tenant_salts,
        embedding_pooling=embedding_pooling,
        reasoning=reasoning.resolve(reasoning_parser, source, reasoning_budget),
        chat_template=chat,
        tool_format=tool_formats.resolve(tool_call_parser, source, tokenizer),
    )


def serving_state(
    front, config: EngineConfig, options: ServeConfig, limits: ServerLimits
) -> ServerState:
    """The state `tokenworks serve` (and serve/ray_serve.py's API replica) serves its
    engine front with, as its options ask."""
    state = make_state(
        front,
        [config.model, *options.served_model_name],
        options.request_timeout,
        limits,
        api_keys=options.api_key,
        metrics_require_key=options.metrics_require_key,
        tenant_salts=not options.shared_prefix_cache,
        metrics_prefix=options.metrics_prefix,
        embedding_pooling=options.embedding_pooling,
        chat_template=options.chat_template,
        reasoning_parser=options.reasoning_parser,
        reasoning_budget=options.reasoning_budget,
        tool_call_parser=options.tool_call_parser,
    )
    state.runtime_lora = options.allow_runtime_lora_updating
    state.records = RecordsFolder(options.records_dir)
    for item in config.lora_modules:  # loaded by the engine as it started
        name, _, path = item.partition("=")
        state.add_adapter(name, path)
    return state


def add_model(
    state: ServerState,
    name: str,
    front,
    reasoning_parser: str = "auto",
    reasoning_budget: int | None = None,
    tool_call_parser: str = "auto",
) -> ServerState:
    """Serve another model, behind its own engine front (a started core client,
    front/hf_front.py's HFFront, or serve/remote.py's RemoteBackend), beside state's:
    requests naming it go there, under the same limits, keys, deadlines and response
    store; its metrics carry its name."""
    if name in state.served_names:
        raise ValueError(f"--backend {name}: the server already serves a model of that name")
    limits = state.limits
    front.configure(
        state.metrics.for_engine(0, name), limits.max_stream_backlog, limits.max_stream_stall_s
    )
    if isinstance(front, RemoteBackend):  # the upstream templates, parses and counts
        state.others[name] = dataclasses.replace(
            state, engine=front, model_names=[name], others={}, chat_template=None,
            reasoning=None, remote=front,
        )  # fmt: skip
        return state.others[name]
    tokenizer = front.engine.tokenizer
    source = tokenizer.chat.source if tokenizer.chat else None
    state.others[name] = dataclasses.replace(
        state,
        engine=front,
        model_names=[name],
        others={},
        chat_template=None,
        reasoning=reasoning.resolve(reasoning_parser, source, reasoning_budget),
        tool_format=tool_formats.resolve(tool_call_parser, source, tokenizer),
    )
    return state.others[name]


def backend_front(name: str, config: EngineConfig, spec: str, options: ServeConfig, on_death=None):
    """The engine front of --backend NAME=SPEC (KIND:MODEL), not yet started: a native
    core with the server's engine options, transformers' generate, or an upstream."""
    kind, _, model = spec.partition(":")
    if kind == "remote":
        return RemoteBackend(name, model)
    if kind == "transformers":
        from tokenworks.front.hf_front import HFFront

        return HFFront(model)
    config = dataclasses.replace(config, model=model)
    return CoreClient(config, on_death=on_death, backend=options.core_backend(config))


def template_text(value: str) -> str:
    """--chat-template: a file's contents, or the template itself (as vLLM reads it)."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template too long to be a file name
        pass
    if "{" not in value:
        raise SystemExit(f"--chat-template {value!r}: no such file, and not a Jinja template")
    return value


def run_server(config: EngineConfig, options: ServeConfig, limits: ServerLimits) -> int:
    """Serve until stopped; the exit status: 1 when the engine core died for good."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    server: GracefulServer | None = None

    def stop(why: str) -> None:  # a core is gone: stop serving, exit non-zero
        log.error("stopping the server: %s", why)
        if server is not None:
            server.should_exit = True

    from tokenworks.engine.messages import RayNotInstalledError

    try:
        backend = options.core_backend(config)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    split = options.disaggregation
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    if split is not None and (not config.enable_prefix_caching or ranks > 1):
        raise SystemExit(
            "--disaggregate moves prompts' blocks through the prefix cache of one process "
            "per engine: leave out --no-enable-prefix-caching, --tensor-parallel-size and "
            "--pipeline-parallel-size"
        )
    cores = [
        CoreClient(
            replica_config(config, i),
            restart=options.restart_engine,
            on_death=stop,
            backend=backend,
        )  # fmt: skip
        for i in range(sum(split) if split else options.data_parallel_size)
    ]
    if split is not None:
        engine = DisaggregatedRouter(cores[: split[0]], cores[split[0] :])
    else:
        engine = cores[0] if len(cores) == 1 else ReplicaRouter(cores, options.router)
    try:
        engine.start()
    except RayNotInstalledError as e:
        raise SystemExit(str(e)) from None
    state = serving_state(engine, config, options, limits)
    for name, spec in options.backends.items():
        front = backend_front(name, config, spec, options, stop)
        front.start()
        add_model(state, name, front, options.reasoning_parser, options.reasoning_budget,
                  options.tool_call_parser)  # fmt: skip
    app = build_app(state)
    if options.host not in ("127.0.0.1", "localhost", "::1") and not options.api_key:
        log.warning("serving on %s without --api-key: anyone who can reach it can use it",
                    options.host)  # fmt: skip
    server = GracefulServer(
        uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                       timeout_graceful_shutdown=ENDING_S),
        state, options.shutdown_timeout,
    )  # fmt: skip
    if not _died(engine):  # (a core that died before now stops us here)
        sock = server.config.bind_socket()
        if limits.max_stream_socket_kb:  # accepted connections inherit it
            sndbuf = int(limits.max_stream_socket_kb * 1024)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        server.run(sockets=[sock])
    for front in state.fronts:  # (the app's lifespan did, unless a second signal cut it short)
        front.shutdown()
    return 1 if _died(engine) and not server.signalled else 0


def replica_config(config: EngineConfig, i: int) -> EngineConfig:
    """Replica i's engine config: its KV events on addresses of its own."""
    if config.kv_events_config is None or i == 0:
        return config
    return dataclasses.replace(config, kv_events_config=config.kv_events_config.for_replica(i))


def _died(front) -> bool:
    """Has an engine core of this front died for good?"""
    cores = getattr(front, "replicas", [front])
    return any(c.died for c in cores)


ENDING_S = 5.0  # after the drain, how long the streams it ended get to send their last event


class GracefulServer(uvicorn.Server):
    """uvicorn's server, stopping as a supervisor expects on SIGTERM or SIGINT (to its pid
    or its whole process group): refuse new requests with 503 (and /health), let those in
    flight finish for up to `shutdown_timeout` seconds, end the rest with an error event,
    stop the engine cores, exit 0. A second signal exits at once."""

    def __init__(self, config, state: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self.state, self.shutdown_timeout = state, shutdown_timeout
        self.signalled = False
        self._drain_until: float | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        # as uvicorn's, without raising the signal again afterwards: the server has shut
        # down as asked, and says so with status 0 rather than dying by the signal
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        name = signal.Signals(sig).name
        if self.signalled:
            log.warning("%s again: exiting now", name)
            for front in self.state.fronts:
                for core in getattr(front, "replicas", [front]):
                    if hasattr(core, "kill"):
                        core.kill()
            os._exit(0)
        self.signalled = True
        self.state.draining = True
        self._drain_until = time.monotonic() + self.shutdown_timeout
        log.info(
            "%s: refusing new requests; %d in flight get up to %g s to finish (%s again "
            "exits at once)", name, self.state.active, self.shutdown_timeout, name,
        )  # fmt: skip

    async def on_tick(self, counter: int) -> bool:
        if self._drain_until is not None and not self.should_exit:
            if self.state.active == 0:
                self.should_exit = True
            elif time.monotonic() >= self._drain_until:
                log.warning(
                    "%d requests still in flight after %g s: ending them",
                    self.state.active, self.shutdown_timeout,
                )  # fmt: skip
                for front in self.state.fronts:
                    front.fail_all(
                        f"the server is shutting down: the request did not finish within "
                        f"--shutdown-timeout {self.shutdown_timeout:g} s"
                    )
                self.should_exit = True
        return await super().on_tick(counter)


class ServerThread:
    """Serve an app on 127.0.0.1 from a background thread (tests, notebooks, benchmarks):

    >>> with ServerThread(app) as srv:
    ...     client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None):
        self.host = host
        self.port = port or _free_port(host)
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
