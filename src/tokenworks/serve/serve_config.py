"""The server's own options (where it listens, who may use it, where its engine cores run,
how it stops), each a `tokenworks serve` flag made from the field; the engine's are
EngineConfig's, the request limits ServerLimits'."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tokenworks.front.replicas import POLICIES
from tokenworks.options import option
from tokenworks.serve.reasoning import REASONING_PARSERS
from tokenworks.serve.tool_formats import TOOL_CALL_PARSERS

BACKEND_KINDS = ("native", "transformers", "remote")  # what --backend serves a model with


@dataclass(frozen=True)
class ServeConfig:
    host: str = field(default="127.0.0.1", metadata=option("address to bind (default: local only)"))
    port: int = field(default=8000, metadata=option("port to listen on"))
    api_key: list[str] = field(
        default_factory=list,
        metadata=option(
            "require this key (Authorization: Bearer KEY or x-api-key: KEY) on every "
            "endpoint but /health and /metrics; repeatable, one key per tenant: each key's "
            "requests get their own prefix-cache salt, so tenants never share cached blocks",
            metavar="KEY",
        ),
    )
    metrics_require_key: bool = field(
        default=False, metadata=option("guard /metrics with the key too")
    )
    embedding_pooling: str = field(
        default="mean",
        metadata=option(
            "how /v1/embeddings pools a text's final hidden states: the mean over every "
            "position, or the last position's (then scaled to unit length)",
            choices=["mean", "last"],
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=option(
            "render chats with this Jinja template (a file, or the template itself) instead "
            "of the model's own",
            metavar="TEMPLATE",
        ),
    )
    reasoning_parser: str = field(
        default="auto",
        metadata=option(
            "the model's think markers, whose text comes back as reasoning_content and "
            "Anthropic thinking blocks: auto (Qwen3's <think> </think> where the chat "
            "template writes them), none, qwen3, or deepseek_r1 (the answer is thinking "
            "until </think>, opened or not)",
            choices=REASONING_PARSERS,
        ),
    )
    tool_call_parser: str = field(
        default="auto",
        metadata=option(
            "how the model writes tool calls: auto (read from the chat template), hermes "
            "(<tool_call> JSON, Qwen and SmolLM), llama3_json, mistral ([TOOL_CALLS]), "
            "qwen3_coder (<function=...> XML)",
            choices=TOOL_CALL_PARSERS,
        ),
    )
    reasoning_budget: int | None = field(
        default=None,
        metadata=option(
            "think at most N tokens where a request does not say (then the end marker is "
            "forced and the answer follows); default: no bound",
            metavar="N",
        ),
    )
    metrics_prefix: str = field(
        default="tokenworks",
        metadata=option(
            "the prefix of the /metrics series (vllm: vLLM's own names, for dashboards "
            "built for vLLM)",
            metavar="NAME",
        ),
    )
    shared_prefix_cache: bool = field(
        default=False,
        metadata=option(
            "with several --api-key: let tenants share cached prompt blocks (faster for "
            "common prefixes, but one tenant can then time another's prompts)"
        ),
    )
    engine_process: bool = field(
        default=True,
        metadata=option(
            "run the engine core in a process of its own (engine/core.py), the server "
            "process keeping HTTP, templates, tokenising and detokenising; if the core dies, "
            "the server exits with status 1, unless --restart-engine. --no-engine-process "
            "runs the same core in a thread of the server process"
        ),
    )
    data_parallel_size: int = field(
        default=1,
        metadata=option(
            "N engine cores, each in its own process with its own KV pool and --threads, "
            "behind this one server",
            metavar="N",
        ),
    )
    router: str = field(
        default="prefix",
        metadata=option(
            "with --data-parallel-size: which replica takes a request: prefix (the one that "
            "last took a prompt with the same leading blocks), kv_events (the one whose "
            "prefix cache holds most of them, from its --kv-events-config events), "
            "least_loaded (the fewest outstanding tokens) or round_robin (each in turn)",
            choices=POLICIES,
        ),
    )
    disaggregate: str | None = field(
        default=None,
        metadata=option(
            "prefill=P,decode=D: P engine cores that only prefill prompts and D that decode, "
            "each request's prompt KV blocks moving from the one to the least-loaded other "
            "through shared memory (front/disaggregated.py); instead of "
            "--data-parallel-size",
            metavar="prefill=P,decode=D",
        ),
    )
    restart_engine: bool = field(
        default=False,
        metadata=option(
            "start a new engine core when one dies (the requests in flight fail; later "
            "ones are served)"
        ),
    )
    backend: list[str] = field(
        default_factory=list,
        metadata=option(
            "serve another model beside --model, requests naming NAME going to it: "
            "native:MODEL (an engine core of its own, with this server's engine options), "
            "transformers:MODEL (transformers' generate, for an architecture the engine "
            "lacks; no batching, logprobs or grammars), or remote:MODEL@URL (an "
            "OpenAI-compatible server at URL, its API base; http://KEY@host/v1 sends KEY); "
            "repeatable",
            metavar="NAME=KIND:MODEL",
        ),
    )
    allow_runtime_lora_updating: bool = field(
        default=False,
        metadata=option(
            "take POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora)"
        ),
    )
    served_model_name: list[str] = field(
        default_factory=list,
        metadata=option("another name clients may use for the model (repeatable)"),
    )
    records_dir: str = field(
        default="benchmarks/results",
        metadata=option(
            "the evidence records the /lab page shows (and `bench report`'s output there)",
            metavar="DIR",
        ),
    )
    request_timeout: float = field(
        default=600.0,
        metadata=option(
            "cancel a request that has not finished after S seconds (504)", metavar="S"
        ),
    )
    shutdown_timeout: float = field(
        default=30.0,
        metadata=option(
            "on SIGTERM or SIGINT: refuse new requests (503), give those in flight up to S "
            "seconds to finish, end the rest with an error, stop and exit 0 (a second "
            "signal exits at once)",
            metavar="S",
        ),
    )
    log_level: str = field(
        default="info",
        metadata=option("uvicorn's log level", choices=("critical", "error", "warning",
                                                        "info", "debug", "trace")),
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size {self.data_parallel_size}: give 1 or more")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout {self.shutdown_timeout}: give 0 or more")
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.metrics_prefix):
            raise ValueError(
                f"--metrics-prefix {self.metrics_prefix!r}: give a name of letters, digits and _"
            )
        if self.reasoning_budget is not None and self.reasoning_budget < 0:
            raise ValueError(f"--reasoning-budget {self.reasoning_budget}: give 0 or more")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser {self.reasoning_parser!r}: expected one of "
                f"{', '.join(REASONING_PARSERS)}"
            )
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"--tool-call-parser {self.tool_call_parser!r}: expected one of "
                f"{', '.join(TOOL_CALL_PARSERS)}"
            )
        self.backends  # noqa: B018 (each --backend checked here)
        self.disaggregation  # noqa: B018 (checked here)
        if self.router not in POLICIES:
            raise ValueError(f"--router {self.router!r}: expected one of {', '.join(POLICIES)}")
        own_cores = self.restart_engine or self.data_parallel_size > 1 or self.disaggregate
        if not self.engine_process and own_cores:
            raise ValueError(
                "--restart-engine, --data-parallel-size and --disaggregate run engine cores "
                "of their own: leave out --no-engine-process"
            )
        if self.disaggregate and self.data_parallel_size > 1:
            raise ValueError(
                "--disaggregate sets how many engine cores prefill and how many decode: "
                "leave out --data-parallel-size"
            )

    @property
    def backends(self) -> dict[str, str]:
        """--backend NAME=KIND:MODEL, as {name: "kind:model"}."""
        out: dict[str, str] = {}
        for item in self.backend:
            name, _, spec = item.partition("=")
            kind, _, model = spec.partition(":")
            remote_ok = kind != "remote" or re.fullmatch(r"[^@]+@https?://\S+", model)
            if not name or kind not in BACKEND_KINDS or not model or not remote_ok:
                raise ValueError(
                    f"--backend {item!r}: give NAME=KIND:MODEL, KIND one of "
                    f"{', '.join(BACKEND_KINDS)}, as smol=transformers:smollm2-135m or "
                    "up=remote:MODEL@http://127.0.0.1:8001/v1"
                )
            if name in out:
                raise ValueError(f"--backend {item!r}: {name} is named twice")
            out[name] = spec
        return out

    @property
    def disaggregation(self) -> tuple[int, int] | None:
        """--disaggregate prefill=P,decode=D as (P, D); None without it."""
        if self.disaggregate is None:
            return None
        m = re.fullmatch(r"prefill=(\d+),decode=(\d+)", self.disaggregate.replace(" ", ""))
        if m is None or min(int(m[1]), int(m[2])) < 1:
            raise ValueError(
                f"--disaggregate {self.disaggregate!r}: give prefill=P,decode=D with P and D "
                "at least 1, as prefill=1,decode=1"
            )
        return int(m[1]), int(m[2])

    def core_backend(self, config) -> str:
        """CoreClient's backend for the engine cores of EngineConfig `config`."""
        if not self.engine_process:
            if config.distributed_executor_backend != "mp":
                raise ValueError(
                    "--distributed-executor-backend ray runs engine cores as Ray actors: "
                    "leave out --no-engine-process"
                )
            return "thread"
        return config.distributed_executor_backend
