"""What every benchmark takes, and the options several share, written once: BenchConfig
(where the record goes), the benchmark-with-an-engine base, and the field makers for the
shared options (threads, models, dtype, rounds, repeats, seeds, peers, sweeps) that each
config in bench/configs.py uses with its own default where it needs one.

A benchmark's options are a frozen dataclass whose fields make its flags
(tokenworks/options.py), as the engine's are made from EngineConfig; its runner gets the
dataclass itself.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from tokenworks import environment
from tokenworks.config import EngineConfig
from tokenworks.options import option

RESULTS = "benchmarks/results"  # where benchmark records go unless --out says otherwise
CATALOGUE_MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


def names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in names(text))


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in names(text))


def at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: every engine runs at least once; give 1 or more")
    return n


def ramps(text: str) -> tuple[tuple[float, float], ...]:
    out = []
    for part in text.split(","):
        a, sep, b = part.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"ramp {part!r}: expected FROM:TO (req/s)")
        out.append((float(a), float(b)))
    return tuple(out)


def threads(default: int | None = None, help: str = "CPU threads (default: torch's)"):
    return field(default=default, metadata=option(help))


def models(default: tuple[str, ...] = CATALOGUE_MODELS, help: str = "catalogue names"):
    return field(default=default, metadata=option(f"comma-separated {help}", type=names))


def comma_list(default: tuple, help: str, parse=names, **kw):
    return field(default=default, metadata=option(f"{help}, comma-separated", type=parse, **kw))


def dtype(default: str = "bfloat16", choices=("bfloat16", "float32")):
    return field(default=default, metadata=option("the weights' dtype", choices=list(choices)))


def rounds(default: int = 1, help: str = "each engine this many times, in turn (medians)"):
    return field(default=default, metadata=option(help, type=at_least_one))


def count(default: int, help: str = "", **kw):
    """An integer option (tokens, requests, repeats ...)."""
    return field(default=default, metadata=option(help or "how many", **kw))


def seed(default: int = 0, help: str = "of the random prompts"):
    return field(default=default, metadata=option(help))


def peers_dir():
    return field(
        default=environment.get("TOKENWORKS_PEERS", "peers"),
        metadata=option(
            "where benchmarks/peers.sh put the peers (llama.cpp: llamacpp/bin; default "
            "$TOKENWORKS_PEERS or ./peers)"
        ),
    )


@dataclass(frozen=True)
class BenchConfig:
    """What every benchmark takes: where its record goes."""

    out: str = field(default=RESULTS, metadata=option("directory for the record"))


@dataclass(frozen=True)
class EngineBench(BenchConfig, EngineConfig):
    """A benchmark of one engine: every engine option, as `tokenworks serve` takes them."""


@dataclass(frozen=True)
class Peers:
    """Peers measured in the same run from their own venvs."""

    peer: list[str] = field(
        default_factory=list,
        metadata=option(
            "also measure a peer in the same run from its own venv: "
            "llama.cpp=/path/to/venv/bin/python, transformers=..., vllm=... (repeatable)",
            metavar="NAME=PYTHON",
        ),
    )
    hf_dir: str | None = field(
        default=None,
        metadata=option("a Hugging Face copy of the model, for the peers that read one (vLLM)"),
    )


def request_rates(default: tuple[float, ...] = ()):
    return comma_list(default, "req/s", floats)


def concurrencies(default: tuple[int, ...] = ()):
    return comma_list(default, "requests in flight at most", ints)


@dataclass(frozen=True)
class Sweep:
    """The points of a serving sweep and the goodput's objectives."""

    request_rate: tuple[float, ...] = request_rates()
    max_concurrency: tuple[int, ...] = concurrencies()
    burstiness: float = field(default=1.0, metadata=option("gamma shape (1: Poisson)"))
    ramp: tuple[tuple[float, float], ...] = field(
        default=(),
        metadata=option(
            "sweep points whose rate rises linearly from FROM to TO req/s over the run",
            type=ramps,
            metavar="FROM:TO,...",
        ),
    )
    endpoint: str = field(
        default="completions",
        metadata=option(
            "send prompts to /v1/completions, or text prompts as chat messages",
            choices=["completions", "chat"],
        ),
    )
    slo_ttft: float | None = field(default=None, metadata=option("seconds, for goodput"))
    slo_tpot: float | None = field(default=None, metadata=option("seconds, for goodput"))
    slo_e2e: float | None = field(default=None, metadata=option("seconds, for goodput"))
    warmup_requests: int = count(8, "requests sent at once, untimed, before the sweep (0: none)")
