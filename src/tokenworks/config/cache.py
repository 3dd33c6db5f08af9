"""The KV cache: its blocks, how much memory they take and in what dtype, the prefix cache
and its host tier, and what windowed layers keep."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenworks.config.kv_events import KVEventsConfig, kv_events_arg
from tokenworks.config.model import MEMORY
from tokenworks.options import option

KV_DTYPES = ("auto", "int8", "fp8_e4m3")  # how the KV cache keeps keys and values


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata=option("tokens per KV block", group=MEMORY))
    kv_cache_memory: float | None = field(
        default=None,
        metadata=option(
            "GiB for the KV block pool (default: what max-num-seqs full contexts need, at "
            "most --kv-cache-fraction of free memory)",
            group=MEMORY,
            metavar="GIB",
        ),
    )
    kv_cache_fraction: float = field(
        default=0.2,
        metadata=option(
            "without --kv-cache-memory: at most this much of free memory", group=MEMORY
        ),
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=option(
            "reuse the KV blocks of shared prompt prefixes", "--prefix-caching", MEMORY
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=option(
            "how the KV cache keeps keys and values: auto (the model's dtype), int8 or "
            "fp8_e4m3 (one byte an element and a float32 scale per token and head: about "
            "twice the tokens in the same memory; engine/kv_quant.py; the C kernels and "
            "torch's attention both read it)",
            group=MEMORY,
            choices=KV_DTYPES,
        ),
    )
    kv_offload_gib: float = field(
        default=0.0,
        metadata=option(
            "GiB of host memory for full prefix-cache blocks evicted from the KV pool: kept "
            "(least recently used out first) and copied back on a later hit instead of "
            "computed again (engine/kv_offload.py; 0: off)",
            group=MEMORY,
            metavar="GIB",
        ),
    )
    sliding_window_kv: str = field(
        default="free",
        metadata=option(
            "free: windowed layers give back the KV blocks wholly behind their window (one "
            "block table per layer group); mask: they keep every block and the window only "
            "masks",
            group=MEMORY,
            choices=["free", "mask"],
        ),
    )
    kv_events_config: KVEventsConfig | None = field(
        default=None,
        metadata=option(
            "publish every block the prefix cache stores or removes, in vLLM's format, as "
            'JSON, e.g. \'{"enable_kv_cache_events": true, "endpoint": '
            '"tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}\' (keys: '
            "enable_kv_cache_events, publisher, endpoint, replay_endpoint, buffer_steps, hwm, "
            "max_queue_size, topic; engine/kv_events.py)",
            group=MEMORY,
            type=kv_events_arg,
            metavar="JSON",
        ),
    )

    def __post_init__(self) -> None:
        self.check_cache()

    def check_cache(self) -> None:
        if self.kv_events_config is not None:
            events = KVEventsConfig.parse(self.kv_events_config)
            object.__setattr__(self, "kv_events_config", events)
            if events.publishes and not self.enable_prefix_caching:
                raise ValueError(
                    "kv_events_config publishes the prefix cache's blocks: it needs prefix "
                    "caching (drop --no-prefix-caching)"
                )
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory (GiB) must be > 0")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError("kv_cache_fraction must be in (0, 1]")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r}: expected one of {', '.join(KV_DTYPES)}"
            )
        if self.kv_offload_gib < 0:
            raise ValueError("kv_offload_gib must be >= 0 (0: no host tier)")
        if self.kv_offload_gib and not self.enable_prefix_caching:
            raise ValueError(
                "kv_offload_gib keeps the prefix cache's evicted blocks: it needs prefix "
                "caching on (drop --no-prefix-caching, or the host tier)"
            )
        if self.sliding_window_kv not in ("free", "mask"):
            raise ValueError(f"sliding_window_kv {self.sliding_window_kv!r}: expected free or mask")
