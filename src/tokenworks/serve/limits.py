"""The bounds on what one client may ask of the server, each a `tokenworks serve` flag.

Without them a single request can make the server work for everyone: 100,000 stop strings
are scanned at every token of every step, a 10**30 max_tokens or a 20 MB body is work or
memory nobody else gets. Each refusal is a 400 (413 for the body) that names the field
and the flag that sets its bound.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from tokenworks.engine.request import MAX_LOGPROBS
from tokenworks.serve.errors import bad_request

MiB = 1024 * 1024


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 8 * MiB  # --max-body-mb: the request body, with or without a length
    max_stop: int = 64  # --max-stop: stop strings in one request
    max_stop_chars: int = 1024  # --max-stop-chars: characters in one stop string
    max_n: int = 16  # --max-n: completions of one prompt (n)
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs: top alternatives per token
    max_messages: int = 2048  # --max-messages: messages in one conversation
    max_tools: int = 128  # --max-tools: tools offered in one request
    max_tools_bytes: int = 256 * 1024  # --max-tools-kb: their definitions as JSON, together
    max_prompts: int = 256  # --max-prompts: prompts in one /v1/completions request
    # slow readers: output a stream may hold undelivered before its client is dropped
    max_stream_backlog: int = 4096  # --max-stream-backlog: tokens
    max_stream_stall_s: float = 120.0  # --max-stream-stall: seconds without taking any

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < (0 if name == "max_stop" else 1):
                raise ValueError(f"{name} must be >= {0 if name == 'max_stop' else 1}")

    # ------------------------------------------------------------------ checks

    def check_stop(self, stop: list[str], field: str = "stop") -> None:
        if len(stop) > self.max_stop:
            raise bad_request(
                f"{field} holds {len(stop)} strings; at most {self.max_stop} are allowed "
                "here (the server's --max-stop)",
                field,
            )
        for i, s in enumerate(stop):
            if isinstance(s, str) and len(s) > self.max_stop_chars:
                raise bad_request(
                    f"{field}[{i}] is {len(s)} characters long; at most {self.max_stop_chars} "
                    "(the server's --max-stop-chars)",
                    field,
                )

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise bad_request(f"n is {n}; at most {self.max_n} here (--max-n)", "n")

    def check_logprobs(self, logprobs: int | None, field: str) -> None:
        if logprobs is not None and logprobs > self.max_logprobs:
            raise bad_request(
                f"{field} is {logprobs}; at most {self.max_logprobs} here (--max-logprobs)", field
            )

    def check_messages(self, messages: list) -> None:
        if len(messages) > self.max_messages:
            raise bad_request(
                f"messages holds {len(messages)} messages; at most {self.max_messages} here "
                "(--max-messages)",
                "messages",
            )

    def check_tools(self, tools: list | None) -> None:
        if not tools:
            return
        if len(tools) > self.max_tools:
            raise bad_request(
                f"tools holds {len(tools)} tools; at most {self.max_tools} here (--max-tools)",
                "tools",
            )
        size = len(json.dumps(tools, separators=(",", ":")))
        if size > self.max_tools_bytes:
            raise bad_request(
                f"the tools' definitions are {size} bytes of JSON; at most "
                f"{self.max_tools_bytes} here (--max-tools-kb)",
                "tools",
            )

    def check_prompts(self, count: int) -> None:
        if count > self.max_prompts:
            raise bad_request(
                f"prompt holds {count} prompts; at most {self.max_prompts} here (--max-prompts)",
                "prompt",
            )


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    d = ServerLimits()
    g = p.add_argument_group("request limits (each refusal is a 400 naming the field)")
    g.add_argument(
        "--max-body-mb", type=float, default=d.max_body_bytes / MiB,
        help="largest request body in MiB, with or without Content-Length (413)",
    )  # fmt: skip
    g.add_argument("--max-stop", type=int, default=d.max_stop, help="stop strings a request")
    g.add_argument(
        "--max-stop-chars", type=int, default=d.max_stop_chars, help="characters a stop string"
    )
    g.add_argument("--max-n", type=int, default=d.max_n, help="completions per prompt (n)")
    g.add_argument(
        "--max-logprobs", type=int, default=d.max_logprobs, help="top alternatives per token"
    )
    g.add_argument(
        "--max-messages", type=int, default=d.max_messages, help="messages a conversation"
    )
    g.add_argument("--max-tools", type=int, default=d.max_tools, help="tools a request")
    g.add_argument(
        "--max-tools-kb", type=float, default=d.max_tools_bytes / 1024,
        help="the tools' definitions as JSON, KiB in all",
    )  # fmt: skip
    g.add_argument(
        "--max-prompts", type=int, default=d.max_prompts, help="prompts a /v1/completions call"
    )
    g.add_argument(
        "--max-stream-backlog", type=int, default=d.max_stream_backlog, metavar="TOKENS",
        help="output tokens a stream may hold undelivered; a client further behind is "
        "disconnected (its request cancelled, its KV blocks freed)",
    )  # fmt: skip
    g.add_argument(
        "--max-stream-stall", type=float, default=d.max_stream_stall_s, metavar="S",
        help="seconds a stream may hold undelivered output that its client does not read",
    )  # fmt: skip


def limits_from_args(args) -> ServerLimits:
    return ServerLimits(
        max_body_bytes=int(args.max_body_mb * MiB),
        max_stop=args.max_stop,
        max_stop_chars=args.max_stop_chars,
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
        max_messages=args.max_messages,
        max_tools=args.max_tools,
        max_tools_bytes=int(args.max_tools_kb * 1024),
        max_prompts=args.max_prompts,
        max_stream_backlog=args.max_stream_backlog,
        max_stream_stall_s=args.max_stream_stall,
    )
