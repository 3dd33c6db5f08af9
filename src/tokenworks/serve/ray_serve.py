"""tokenworks as a Ray Serve application: `serve run tokenworks.serve.ray_serve:application
model=smollm2-135m max_replicas=4` (Ray Serve LLM's shape).

Two deployments. The engine's replicas (front/ray_serve.py's EngineReplica), each an
engine core in its own Ray actor with its own KV pool, which Ray Serve starts, scales
between min_replicas and max_replicas by the requests each has in flight, and
health-checks. In front of them one API replica: the same FastAPI app as `tokenworks
serve` (both protocols, limits, keys, templates, tools, /metrics), its engine front the
engine deployment's handle, through which front/ray_router.py's router sends a prompt to
the replica whose prefix cache holds most of it, as the replicas' KV events say.

Every key=value after the application is one of `tokenworks serve`'s flags (engine,
server and limits, e.g. max_num_seqs=16 api_key=KEY) or one of RayServeOptions' below;
the flags that place engines or sockets themselves are Ray Serve's to decide here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import msgspec

from tokenworks.config import EngineConfig, add_engine_arguments, engine_kwargs
from tokenworks.options import add_arguments, default_of, fields_of, from_args, option
from tokenworks.serve.limits import ServerLimits
from tokenworks.serve.serve_config import ServeConfig

ROUTERS = ("kv_events", "power_of_two")
API_CONCURRENCY = 1024  # requests the API replica holds at once (streams mostly wait)


@dataclass(frozen=True)
class RayServeOptions:
    """How Ray Serve places and scales the engine's replicas."""

    min_replicas: int = field(default=1, metadata=option("engine replicas at least"))
    max_replicas: int = field(
        default=1, metadata=option("engine replicas at most (above min_replicas: autoscaled)")
    )
    target_ongoing_requests: float = field(
        default=8.0,
        metadata=option("requests in flight per replica the autoscaler aims at"),
    )
    max_ongoing_requests: int | None = field(
        default=None,
        metadata=option(
            "requests one replica takes at once, the rest waiting in Ray Serve's queue "
            "(default: twice --max-num-seqs)"
        ),
    )
    request_router: str = field(
        default="kv_events",
        metadata=option(
            "which replica takes a request: kv_events (the one whose prefix cache holds "
            "most of the prompt, from its KV events) or power_of_two (Ray Serve's own: "
            "the shorter queue of two at random)",
            choices=ROUTERS,
        ),
    )
    replica_cpus: float | None = field(
        default=None, metadata=option("CPUs Ray reserves for a replica (default: --threads, or 1)")
    )

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"min_replicas={self.min_replicas} max_replicas={self.max_replicas}: give "
                "1 <= min_replicas <= max_replicas"
            )
        if self.request_router not in ROUTERS:
            raise ValueError(
                f"request_router={self.request_router}: expected one of {', '.join(ROUTERS)}"
            )
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests={self.max_ongoing_requests}: give 1 or more")


# server options whose job Ray Serve does here, and what takes their place
RAY_DOES = {
    "host": "Ray Serve's HTTP proxy listens (serve start --http-host, or a config file)",
    "port": "Ray Serve's HTTP proxy listens (serve start --http-port, or a config file)",
    "engine_process": "each engine replica runs in a Ray actor of its own",
    "data_parallel_size": "give min_replicas and max_replicas",
    "router": "give request_router",
    "disaggregate": "Ray Serve runs one kind of engine replica",
    "restart_engine": "Ray Serve replaces a replica that fails its health check",
    "backend": "deploy another application for another model",
    "allow_runtime_lora_updating": "give the adapters with lora_modules",
    "shutdown_timeout": "Ray Serve drains a replica (graceful_shutdown_timeout_s)",
    "log_level": "Ray Serve logs the requests",
    "distributed_executor_backend": "the replicas are Ray actors already",
    "tensor_parallel_size": "one engine a replica: scale with max_replicas",
    "pipeline_parallel_size": "one engine a replica: scale with max_replicas",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve run tokenworks.serve.ray_serve:application",
                                add_help=False, exit_on_error=False)  # fmt: skip
    add_engine_arguments(p)
    add_arguments(p, ServeConfig, "server")
    add_arguments(p, ServerLimits)
    add_arguments(p, RayServeOptions, "Ray Serve")
    return p


def _argv(args: dict) -> list[str]:
    """key=value pairs as the flags they name (true/false for a switch; a list repeats)."""
    flags = {a.dest: a for a in parser()._actions}
    argv = []
    for key, value in args.items():
        action = flags.get(key.replace("-", "_"))
        if action is None:
            raise ValueError(f"{key}={value}: not an option of tokenworks serve or Ray Serve")
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            on = str(value).lower()
            if on not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"{key}={value}: give true or false")
            argv.append(flag if on in ("true", "1", "yes") else "--no-" + flag[2:])
        else:
            for item in value if isinstance(value, list) else [value]:
                argv += [flag, str(item)]
    return argv


def options_of(args: dict) -> tuple[EngineConfig, ServeConfig, ServerLimits, RayServeOptions]:
    """The application's options from `serve run`'s key=value pairs (or a dict)."""
    try:
        parsed = parser().parse_args(_argv(args))
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from None
    config = EngineConfig(model=parsed.model, **engine_kwargs(parsed))
    options, limits = from_args(ServeConfig, parsed), from_args(ServerLimits, parsed)
    ray = from_args(RayServeOptions, parsed)
    for cls, values in ((ServeConfig, options), (EngineConfig, config)):
        for f, _ in fields_of(cls):
            if f.name in RAY_DOES and getattr(values, f.name) != default_of(f):
                raise ValueError(f"{f.name}: not taken under Ray Serve ({RAY_DOES[f.name]})")
    if ray.request_router == "kv_events" and not config.enable_prefix_caching:
        raise ValueError(
            "request_router=kv_events follows the prefix cache: leave enable_prefix_caching "
            "on, or give request_router=power_of_two"
        )
    return config, options, limits, ray


def engine_options(config: EngineConfig, options: ServeConfig, ray: RayServeOptions) -> dict:
    """The engine deployment's Ray Serve options: its replicas (fixed, or autoscaled
    between the bounds), what one takes at once, its CPUs and its router."""
    out = {
        "max_ongoing_requests": ray.max_ongoing_requests or 2 * config.max_num_seqs,
        "ray_actor_options": {"num_cpus": ray.replica_cpus or config.threads or 1},
        "graceful_shutdown_timeout_s": options.request_timeout,
    }
    if ray.max_replicas > ray.min_replicas:
        out["autoscaling_config"] = {
            "min_replicas": ray.min_replicas, "max_replicas": ray.max_replicas,
            "target_ongoing_requests": ray.target_ongoing_requests,
        }  # fmt: skip
    else:
        out["num_replicas"] = ray.min_replicas
    if ray.request_router == "kv_events":
        from ray.serve.config import RequestRouterConfig

        from tokenworks.front.ray_router import KVEventsRouter

        out["request_router_config"] = RequestRouterConfig(request_router_class=KVEventsRouter)
    return out


def application(args: dict):
    """The Ray Serve application (`serve run` calls it with the key=value pairs given)."""
    from ray import serve

    from tokenworks.front.ray_serve import EngineReplica

    config, options, limits, ray = options_of(args)
    engine = serve.deployment(EngineReplica, name="TokenworksEngine").options(
        **engine_options(config, options, ray)
    )
    api = serve.deployment(serve.ingress()(APIReplica), name="TokenworksAPI").options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=API_CONCURRENCY
    )
    encode = msgspec.json.encode
    return api.bind(
        engine.bind(encode(config).decode(), ray.request_router == "kv_events"),
        encode(config).decode(), encode(options).decode(), encode(limits).decode(),
    )  # fmt: skip


class APIReplica:
    """The API replica: `tokenworks serve`'s app over the engine deployment's handle."""

    async def __init__(self, engine, config_json: str, options_json: str, limits_json: str):
        from tokenworks.front.ray_serve import RayServeFront
        from tokenworks.serve.server import serving_state

        config = msgspec.json.decode(config_json, type=EngineConfig)
        options = msgspec.json.decode(options_json, type=ServeConfig)
        limits = msgspec.json.decode(limits_json, type=ServerLimits)
        front = RayServeFront(engine, config)
        await front.connect()
        self.state = serving_state(front, config, options, limits)

    def __serve_build_asgi_app__(self):
        from tokenworks.serve.app import build_app

        return build_app(self.state)
