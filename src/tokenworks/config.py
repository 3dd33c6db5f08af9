"""Engine configuration: every option that changes numerics or capacity, named once.

Each field here is written into every evidence record, so two measurements can be
compared knowing exactly what differed.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import torch

from tokenworks.models.catalogue import DEFAULT_MODEL

QUANTIZATIONS = (None, "int8", "int4")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_dtype(device: str) -> str:
    """The fast dtype for the device: bfloat16 on CPU and CUDA (float32 is always available)."""
    return "bfloat16"


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"
    device: str = "cpu"
    threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's default
    max_model_len: int | None = None  # context limit; None: the model's own
    # kernels: "sdpa" (the torch modules; decode attention gathers K/V, then SDPA),
    # "cpp" (the C kernels of ops/csrc, built on first use: a small decode batch runs as
    # one call, other batches run torch's products with C between them, and decode
    # attention reads through the block tables with no copy), "auto" (cpp on the CPU for
    # bfloat16 and quantised weights where it builds; float32 keeps torch, the path the
    # exactness tests pin down)
    attention: str = "auto"
    quantization: str | None = None  # None (the file's weights, dequantised), "int8", "int4"
    # with quantization: also keep a dense copy of the dequantised weights and use it for
    # products of at least this many rows (prefill, big batches); None: quantised only
    dense_from_rows: int | None = None
    # KV memory (engine/kv_cache.py)
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: float | None = None  # GiB for the block pool; None: see kv_budget_bytes
    kv_cache_fraction: float = 0.2  # with kv_cache_memory None: at most this much of free RAM
    enable_prefix_caching: bool = True
    # scheduling (engine/scheduler.py)
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 2048  # tokens per forward pass (the per-step budget)
    enable_chunked_prefill: bool = True  # split long prompts across steps beside decodes
    # requests waiting for a running slot (all max_num_seqs taken) beyond this are refused
    max_waiting: int = 4096
    scheduling_policy: str = "fcfs"  # or "priority": lower SamplingParams.priority first
    batch_invariant: bool = False  # a sequence's numerics never depend on its batch
    # one forward pass at the token budget when the engine starts (LLMEngine.warm_up)
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of auto, {', '.join(DTYPES)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device {self.device!r}: expected cpu or cuda[:N]")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but torch sees no CUDA device")
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError("float16 runs on CUDA only; on CPU use bfloat16 or float32")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r}: expected none, {', '.join(QUANTIZATIONS[1:])}"
            )
        if self.quantization is not None and self.device != "cpu":
            raise ValueError(
                f"{self.quantization} weight-only quantization uses torch's CPU kernels; "
                "on CUDA run without --quantization"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0 (0: refuse whatever finds no free slot)")
        if self.dense_from_rows is not None and (
            self.quantization is None or self.dense_from_rows < 1
        ):
            raise ValueError("dense_from_rows needs a quantization and must be >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory (GiB) must be > 0")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError("kv_cache_fraction must be in (0, 1]")
        if self.attention not in ("auto", "cpp", "sdpa"):
            raise ValueError(f"attention {self.attention!r}: expected auto, cpp or sdpa")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy {self.scheduling_policy!r}: expected fcfs or priority"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1")

    @property
    def resolved_dtype(self) -> str:
        return default_dtype(self.device) if self.dtype == "auto" else self.dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.resolved_dtype]

    def to_dict(self) -> dict:
        return {**asdict(self), "dtype": self.resolved_dtype}


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The command-line flags of every command that builds an engine."""
    p.add_argument(
        "--model", "-m", default=DEFAULT_MODEL, help="catalogue name, .gguf, dir or hub id"
    )
    p.add_argument(
        "--dtype", default="auto", help="auto (fast for the device), float32, bfloat16, float16"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4"],
        help="weight-only quantisation (CPU): int8 per row, int4 in groups of 32",
    )
    p.add_argument(
        "--dense-from-rows",
        type=int,
        default=None,
        metavar="N",
        help="with --quantization: keep a dense copy of the dequantised weights for products "
        "of N or more rows (prefill, big batches), where it is faster (e.g. 8)",
    )
    p.add_argument(
        "--attention",
        default="auto",
        choices=["sdpa", "cpp", "auto"],
        help="kernels: torch modules (gathered K/V + SDPA), the C kernels of ops/csrc (whole "
        "small decode steps in one call, C between torch's products otherwise, paged "
        "attention), or auto: C for bfloat16 and quantised weights on the CPU, torch for "
        "float32 (default: auto)",
    )
    g = p.add_argument_group("KV memory and scheduling")
    g.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="GiB for the KV block pool (default: what max-num-seqs full contexts "
        "need, at most 20%% of free memory)",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens per forward pass (prompts beyond it are chunked)",
    )
    g.add_argument("--max-model-len", type=int, default=None, help="context limit")
    g.add_argument(
        "--max-waiting",
        type=int,
        default=4096,
        help="requests that may wait for a running slot once all max-num-seqs are taken; "
        "more are refused (HTTP 429/529); 0 refuses whatever finds no free slot",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument(
        "--batch-invariant",
        action="store_true",
        help="numerics that never depend on the batch (slower)",
    )
    g.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the forward pass at the token budget that readies a new engine "
        "(the first big step then pays for it)",
    )


def engine_kwargs(args) -> dict:
    """EngineConfig fields from the common engine flags."""
    return dict(
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        quantization=args.quantization,
        attention=args.attention,
        dense_from_rows=args.dense_from_rows,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_waiting=args.max_waiting,
        enable_prefix_caching=not args.no_prefix_caching,
        batch_invariant=args.batch_invariant,
        warmup=not args.no_warmup,
    )


def engine_argv(args) -> list[str]:
    """The common engine flags back as a command line (for a `tokenworks serve` child
    process): every flag whose value differs from its default."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    argv = []
    for action in parser._actions:
        value = getattr(args, action.dest, action.default)
        if value == action.default or value is None:
            continue
        flag = next(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv
