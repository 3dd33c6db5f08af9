"""The bounds on what one client may ask of the server, each a `tokenworks serve` flag.

Without them a single request can make the server work for everyone: 100,000 stop strings
are scanned at every token of every step, a 10**30 max_tokens or a 20 MB body is work or
memory nobody else gets. Each refusal is a 400 (413 for the body) that names the field
and the flag that sets its bound.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from tokenworks.engine.request import MAX_LOGPROBS
from tokenworks.options import option
from tokenworks.serve.errors import bad_request

MiB = 1024 * 1024
LIMITS = "request limits (each refusal is a 400 naming the field)"


@dataclass(frozen=True)
class ServerLimits:
    """Each bound a `tokenworks serve` flag of the same name (--max-body-mb ...)."""

    max_body_mb: float = field(
        default=8.0,
        metadata=option("largest request body, with or without Content-Length (413)",
                        group=LIMITS, metavar="MIB"),
    )  # fmt: skip
    max_stop: int = field(default=64, metadata=option("stop strings a request", group=LIMITS))
    max_stop_chars: int = field(
        default=1024, metadata=option("characters a stop string", group=LIMITS)
    )
    max_n: int = field(default=16, metadata=option("completions per prompt (n)", group=LIMITS))
    max_logprobs: int = field(
        default=MAX_LOGPROBS, metadata=option("top alternatives per token", group=LIMITS)
    )
    max_logit_bias: int = field(
        default=300, metadata=option("tokens a logit_bias may name", group=LIMITS)
    )
    max_messages: int = field(
        default=2048, metadata=option("messages a conversation", group=LIMITS)
    )
    max_tools: int = field(default=128, metadata=option("tools a request", group=LIMITS))
    max_tools_kb: float = field(
        default=256.0,
        metadata=option("the tools' definitions as JSON, KiB in all", group=LIMITS),
    )
    max_prompts: int = field(
        default=256,
        metadata=option(
            "prompts a /v1/completions call, inputs a /v1/embeddings call", group=LIMITS
        ),  # fmt: skip
    )
    max_stored_responses: int = field(
        default=1000,
        metadata=option(
            "responses /v1/responses keeps for previous_response_id (the oldest go first; "
            "0 keeps none)",
            group=LIMITS,
        ),
    )
    stored_response_ttl_s: float = field(
        default=3600.0,
        metadata=option("seconds a stored response is kept", group=LIMITS, metavar="S"),
    )
    # slow readers: output a stream may hold undelivered before its client is dropped
    max_stream_backlog: int = field(
        default=4096,
        metadata=option(
            "output tokens a stream may hold undelivered; a client further behind is "
            "disconnected (its request cancelled, its KV blocks freed)",
            group=LIMITS, metavar="TOKENS",
        ),
    )  # fmt: skip
    max_stream_stall_s: float = field(
        default=120.0,
        metadata=option(
            "seconds a stream may hold undelivered output that its client does not read",
            flag="--max-stream-stall", group=LIMITS, metavar="S",
        ),
    )  # fmt: skip

    max_stream_socket_kb: float = field(
        default=0.0,
        metadata=option(
            "KiB the kernel may hold unsent for one connection (its socket's send buffer, "
            "which the kernel doubles, at most net.core.wmem_max); a slow reader's output "
            "past it waits in the server, where --max-stream-backlog and --max-stream-stall "
            "see it. 0: the kernel's own, grown as it sees fit (to megabytes a connection)",
            group=LIMITS, metavar="KIB",
        ),
    )  # fmt: skip

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            zero_ok = name in ("max_stop", "max_stream_socket_kb")
            if value < 0 or (value == 0 and not zero_ok):
                least = "0 or more" if zero_ok else "more than 0"
                raise ValueError(f"{name} is {value}: give {least}")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * MiB)

    @property
    def max_tools_bytes(self) -> int:
        return int(self.max_tools_kb * 1024)

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

    def check_logit_bias(self, bias: dict[str, float] | None, vocab_size: int) -> None:
        """OpenAI's logit_bias: token ids (as strings) to numbers in [-100, 100]."""
        if not bias:
            return
        if len(bias) > self.max_logit_bias:
            raise bad_request(
                f"logit_bias names {len(bias)} tokens; at most {self.max_logit_bias} here "
                "(--max-logit-bias)",
                "logit_bias",
            )
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit() and int(key) < vocab_size):
                raise bad_request(
                    f"logit_bias key {key!r} is not a token id in [0, {vocab_size})", "logit_bias"
                )
            if not -100 <= value <= 100:
                raise bad_request(
                    f"logit_bias of token {key} is {value}; give a number in [-100, 100]",
                    "logit_bias",
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

    def check_prompts(self, count: int, field: str = "prompt") -> None:
        if count > self.max_prompts:
            raise bad_request(
                f"{field} holds {count} prompts; at most {self.max_prompts} here (--max-prompts)",
                field,
            )
