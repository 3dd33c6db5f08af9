"""`tokenworks serve`: start the engine (a core process, several behind a router, or a thread
of this process), serve HTTP with uvicorn."""

from __future__ import annotations

import logging
import socket
import threading
import time

from tokenworks.config import EngineConfig
from tokenworks.engine.async_engine import AsyncEngine
from tokenworks.engine.engine import LLMEngine
from tokenworks.serve.app import build_app
from tokenworks.serve.common import ServerState
from tokenworks.serve.limits import ServerLimits, limits_from_args
from tokenworks.serve.metrics import ServerMetrics


def make_state(
    engine,  # an LLMEngine (run in a thread of this process) or a started CoreClient
    names: list[str],
    request_timeout: float | None = None,
    limits: ServerLimits | None = None,
    api_keys: tuple[str, ...] | list[str] = (),
    metrics_require_key: bool = False,
    tenant_salts: bool = True,
) -> ServerState:
    metrics = ServerMetrics(names[0])
    limits = limits or ServerLimits()
    if isinstance(engine, LLMEngine):
        front = AsyncEngine(
            engine,
            observer=metrics,
            max_backlog=limits.max_stream_backlog,
            max_stall_s=limits.max_stream_stall_s,
        )
    else:  # engine cores in their own processes (engine/core_client.py, replicas.py)
        front = engine
        front.configure(metrics, limits.max_stream_backlog, limits.max_stream_stall_s)
    return ServerState(
        front,
        names,
        metrics,
        request_timeout=request_timeout,
        limits=limits,
        api_keys=tuple(api_keys),
        metrics_require_key=metrics_require_key,
        tenant_salts=tenant_salts,
    )


def run_server(args, engine_kwargs: dict) -> int:
    """Serve until stopped; the exit status: 1 when the engine core died for good."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig(model=args.model, **engine_kwargs)
    replicas = args.data_parallel_size
    if replicas < 1:
        raise SystemExit(f"--data-parallel-size {replicas}: give 1 or more")
    in_process = not args.engine_process
    backend = args.distributed_executor_backend
    if in_process and (args.restart_engine or replicas > 1 or backend != "mp"):
        raise SystemExit(
            "--restart-engine, --data-parallel-size and --distributed-executor-backend run "
            "engine cores of their own: leave out --no-engine-process"
        )
    server: uvicorn.Server | None = None
    if in_process:
        engine = LLMEngine(config)
    else:
        from tokenworks.engine.core_client import CoreClient
        from tokenworks.engine.replicas import ReplicaRouter

        def stop(why: str) -> None:  # a core is gone: stop serving, exit non-zero
            logging.getLogger("tokenworks.serve").error("stopping the server: %s", why)
            if server is not None:
                server.should_exit = True

        from tokenworks.engine.ray_cores import RayNotInstalledError

        cores = [CoreClient(config, restart=args.restart_engine, on_death=stop, backend=backend)
                 for _ in range(replicas)]  # fmt: skip
        engine = cores[0] if replicas == 1 else ReplicaRouter(cores, args.router)
        try:
            engine.start()
        except RayNotInstalledError as e:
            raise SystemExit(str(e)) from None
    names = [args.model, *args.served_model_name]
    state = make_state(
        engine,
        names,
        args.request_timeout,
        limits_from_args(args),
        api_keys=args.api_key or (),
        metrics_require_key=args.metrics_require_key,
        tenant_salts=not args.shared_prefix_cache,
    )
    app = build_app(state)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logging.getLogger("tokenworks.serve").warning(
            "serving on %s without --api-key: anyone who can reach it can use it", args.host
        )
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    )
    if not _died(engine):  # (a core that died before now stops us here)
        server.run()
    return 1 if _died(engine) else 0


def _died(front) -> bool:
    """Has an engine core of this front died for good?"""
    cores = getattr(front, "replicas", [front])
    return any(getattr(c, "died", None) for c in cores)


class ServerThread:
    """Serve an app on 127.0.0.1 from a background thread (tests, notebooks, benchmarks):

    >>> with ServerThread(app) as srv:
    ...     client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None):
        import uvicorn

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
