"""Each benchmark's options, a dataclass apiece (bench/shared_options.py holds the shared ones):
their fields make the flags of `tokenworks bench NAME` and `tokenworks eval NAME`, and the
runner gets the dataclass. bench/parsers.py maps each name to its config and runner."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from tokenworks.bench import shared_options as o
from tokenworks.bench.shared_options import BenchConfig, EngineBench, Peers, Sweep
from tokenworks.config import EngineConfig
from tokenworks.options import option


@dataclass(frozen=True)
class LatencyConfig(Peers, EngineBench):
    prompt_tokens: int = o.count(512, "prompt tokens (prefill)")
    decode_tokens: int = o.count(128, "tokens decoded")
    repeats: int = o.count(3, "runs (the median is kept)")


@dataclass(frozen=True)
class QuantConfig(BenchConfig):
    models: tuple[str, ...] = o.models(help="catalogue names or .gguf paths")
    formats: tuple[str, ...] = o.comma_list(
        ("float32", "bfloat16", "int8", "int4", "gguf"), "float32, bfloat16, int8, int4, gguf"
    )
    text: str | None = field(
        default=None, metadata=option("held-out text for perplexity (default: Lady Susan)")
    )
    ppl_tokens: int = o.count(2048, "tokens scored for perplexity")
    ppl_context: int = o.count(512, "perplexity's window (stride: half of it)")
    greedy_tokens: int = o.count(32, "greedy tokens compared with the reference")
    prompt_tokens: int = o.count(512, "prompt tokens (prefill)")
    decode_tokens: int = o.count(128, "tokens decoded")
    repeats: int = o.count(2, "runs (the median is kept)")
    threads: int | None = o.threads()
    peers_dir: str = o.peers_dir()


@dataclass(frozen=True)
class LoadConfig(EngineBench):
    models: tuple[str, ...] = o.models(help="catalogue names or .gguf paths")
    synthetic_7b: bool = field(
        default=False,
        metadata=option(
            "also a random-weight GGUF of Qwen2-7B's shapes in Q4_K_M (4.4 GB, written once "
            "under $TOKENWORKS_HOME/synthetic)"
        ),
    )
    decode_tokens: int = o.count(32, "tokens decoded")
    peers_dir: str = o.peers_dir()


@dataclass(frozen=True)
class ThroughputConfig(Peers, EngineBench):
    num_prompts: int = o.count(64, "requests, all at once")
    input_tokens: int = o.count(128, "each prompt's tokens")
    output_tokens: int = o.count(128, "tokens each request generates")
    manifest: str | None = field(
        default=None, metadata=option("a workload manifest instead of the above")
    )
    seed: int = o.seed()
    rounds: int = o.rounds()


@dataclass(frozen=True)
class BatchesConfig(EngineBench):
    batches: tuple[int, ...] = o.comma_list(
        (1, 2, 4, 8, 16, 32, 64, 128, 256), "sequences running together", o.ints
    )
    prompt_tokens: int = o.count(128, "a sequence's prompt")
    decode_tokens: int = o.count(32, "decode steps timed")
    peers_dir: str = o.peers_dir()


@dataclass(frozen=True)
class LoRABenchConfig(EngineBench):
    mixes: tuple[int, ...] = o.comma_list((1, 4, 16), "adapters mixed in one batch", o.ints)
    batch: int = o.count(16, "sequences running together")
    rank: int = o.count(8, "each adapter's rank")
    prompt_tokens: int = o.count(64, "a sequence's prompt")
    decode_tokens: int = o.count(16, "decode steps timed")
    repeats: int = o.count(3, "rounds of the base and each mix in turn (the best is kept)")


@dataclass(frozen=True)
class WorldConfig(BenchConfig):
    """(llama.cpp's sources are fetched once into $TOKENWORKS_HOME)"""


@dataclass(frozen=True)
class PageConfig(EngineBench):
    requests: int = o.count(20, "requests, each sent from the page and to the API in turn")
    max_tokens: int = o.count(16, "tokens each answer generates")
    records_dir: str = field(
        default="benchmarks/results",
        metadata=option("the records the /lab page shows", metavar="DIR"),
    )


@dataclass(frozen=True)
class RoutingBenchConfig(EngineBench):
    policies: tuple[str, ...] = o.comma_list(
        ("round_robin", "prefix", "kv_events"), "the router policies compared"
    )
    replicas: int = o.count(2, "engine cores behind the router")
    conversations: int = o.count(8, "conversations, each with its own system prompt")
    turns: int = o.count(4, "turns of each conversation")
    system_tokens: int = o.count(256, "a conversation's system prompt")
    question_tokens: int = o.count(16, "each turn's new question")
    answer_tokens: int = o.count(16, "each turn's answer")


@dataclass(frozen=True)
class StructuredConfig(EngineBench):
    batch_sizes: tuple[int, ...] = o.comma_list((1, 8), "sequence counts", o.ints)
    output_tokens: int = o.count(128, "tokens each sequence generates")
    repeats: int = o.count(4, "runs (the median is kept)")


@dataclass(frozen=True)
class RemoteServer:
    """A server other than ours: where, under what name, with what key."""

    base_url: str | None = field(
        default=None, metadata=option("measure this server instead of ours")
    )
    served_model: str = field(default="default", metadata=option("the model name it serves"))
    api_key: str | None = field(default=None, metadata=option("its API key"))


@dataclass(frozen=True)
class ServeBenchConfig(Sweep, RemoteServer, EngineBench):
    in_process: bool = field(
        default=False, metadata=option("ours without HTTP (straight into the engine's front)")
    )
    client: str = field(
        default="ours",
        metadata=option(
            "with --base-url: the load client, ours or vLLM's `vllm bench serve` (its random "
            "dataset; needs --client-python and --tokenizer)",
            choices=["ours", "vllm"],
        ),
    )
    client_python: str | None = field(
        default=None, metadata=option("--client vllm: a Python with vLLM")
    )
    tokenizer: str | None = field(
        default=None, metadata=option("--client vllm: the model's Hugging Face directory")
    )
    label: str | None = field(
        default=None, metadata=option("the engine's name in reports (e.g. vLLM)")
    )
    vocab_size: int = o.count(49152, "for random prompts (remote)")
    manifest: str | None = field(
        default=None, metadata=option("a workload manifest (JSON or YAML)")
    )
    num_prompts: int = o.count(32, "requests a sweep point")
    input_tokens: int = o.count(128, "each prompt's tokens")
    output_tokens: int = o.count(64, "tokens each request generates")
    seed: int = o.seed()


@dataclass(frozen=True)
class SoakConfig(RemoteServer, EngineBench):
    requests: int = o.count(10_000, "requests in all")
    concurrency: int = o.count(8, "requests in flight")
    seed: int = o.seed()
    sample_s: float = field(default=0.5, metadata=option("seconds between samples"))
    pid: int | None = field(default=None, metadata=option("with --base-url: its process id"))


@dataclass(frozen=True)
class PeersConfig(Sweep, EngineBench):
    peers_dir: str = o.peers_dir()
    hf_dir: str | None = field(
        default=None, metadata=option("the HF copy vLLM reads (default PEERS/smol-hf)")
    )
    only: tuple[str, ...] = o.comma_list((), "peers (default: all known)")
    benches: tuple[str, ...] = o.comma_list(
        ("latency", "offline", "serving"), "latency, offline, serving"
    )
    prompt_tokens: int = o.count(512, "latency: prefill length")
    decode_tokens: int = o.count(128, "latency: tokens decoded")
    repeats: int = o.count(3, "latency: repeats (median)")
    offline_manifest: str | None = field(
        default=None, metadata=option("default 64 x 128 in / 128 out")
    )
    offline_rounds: int = o.rounds(help="offline: every engine this many times")
    serving_manifest: str | None = field(
        default=None, metadata=option("default 32 x 128 in / 64 out")
    )
    vocab_size: int = o.count(49152, "for random prompts")
    seed: int = o.seed()
    request_rate: tuple[float, ...] = o.request_rates((1.0, 2.0, 4.0))
    max_concurrency: tuple[int, ...] = o.concurrencies((1, 4, 16))
    report: str = field(
        default="benchmarks/report/peers", metadata=option("directory for peers.md + PNGs")
    )


@dataclass(frozen=True)
class Records:
    records: tuple[str, ...] = field(
        default=(), metadata=option("record JSON files", flag="records", nargs="+", type=str)
    )


@dataclass(frozen=True)
class ReportConfig(Records):
    out: str = field(default="benchmarks/report", metadata=option("directory for report.md + PNGs"))
    peers: bool = field(
        default=False,
        metadata=option("write the engines-side-by-side report (peers.md) of bench peers"),
    )


@dataclass(frozen=True)
class CompareConfig(Records):
    out: str | None = field(default=None, metadata=option("also write the table to this file"))


@dataclass(frozen=True)
class PoolConfig(Records):
    peer: str = field(default="vllm", metadata=option("the peer to take ratios to"))
    goal: float = field(default=1.3, metadata=option("the ratio to reach"))
    out: str = field(
        default="benchmarks/report/pooled", metadata=option("directory for pooled-PEER.md + PNG")
    )


@dataclass(frozen=True)
class SpecConfig(EngineBench):
    methods: tuple[str, ...] = o.comma_list(("ngram",), "ngram, draft_model")
    k: tuple[int, ...] = o.comma_list((2, 4, 8), "num_speculative_tokens", o.ints)
    draft_model: str | None = field(default=None, metadata=option("the drafter for draft_model"))
    workloads: tuple[str, ...] = o.comma_list(("copy", "free"), "copy, free")
    concurrency: tuple[int, ...] = o.comma_list((1, 16), "1 is one at a time", o.ints)
    requests: int = o.count(4, "prompts per batch-1 cell")
    max_tokens: int = o.count(128, "tokens each request generates")
    rounds: int = o.rounds(help="runs of each cell (median kept)")
    llamacpp_python: str | None = field(
        default=None,
        metadata=option(
            "llama-cpp-python's venv python: its n-gram lookup at batch 1 as the peer",
            metavar="PYTHON",
        ),
    )


@dataclass(frozen=True)
class PerplexityConfig(EngineBench):
    file: str = field(default="", metadata=option("a UTF-8 text file", flag="file"))
    context: int | None = field(
        default=None, metadata=option("the window, in tokens (default: the model's context)")
    )
    stride: int | None = field(
        default=None, metadata=option("tokens between window starts (default: the window)")
    )
    max_tokens: int | None = field(
        default=None, metadata=option("score only the text's first N tokens")
    )
    json: bool = field(default=False, metadata=option("print one JSON object"))


@dataclass(frozen=True)
class MoeConfig(BenchConfig):
    shape: str = field(
        default="qwen3-30b-a3b",
        metadata=option(
            "qwen3-30b-a3b, mixtral-8x7b or qwen1.5-moe-a2.7b (one layer of it, random weights)"
        ),
    )
    batches: tuple[int, ...] = o.comma_list(
        (1, 2, 4, 8, 16, 32, 64, 128, 256), "tokens a step", o.ints
    )
    dtype: str = o.dtype()
    skew: float = field(default=1.0, metadata=option("the skewed router's Zipf exponent"))
    repeats: int = o.count(5, "runs (the median is kept)")
    threads: int | None = o.threads()


@dataclass(frozen=True)
class AttentionKindsConfig(BenchConfig):
    batch: int = o.count(8, "sequences decoding together")
    contexts: tuple[int, ...] = o.comma_list((1024, 4096), "context lengths", o.ints)
    dtype: str = o.dtype()
    repeats: int = o.count(5, "runs (the median is kept)")
    threads: int | None = o.threads()


@dataclass(frozen=True)
class CompiledConfig(BenchConfig):
    models: tuple[str, ...] = o.models()
    modes: tuple[str, ...] = o.comma_list(("eager", "compiled", "c"), "eager, compiled, c")
    batches: tuple[int, ...] = o.comma_list((1, 16, 64), "decoding sequences", o.ints)
    prompt: int = o.count(512, "the prompt pass's tokens")
    context: int = o.count(128, "each decoding sequence's length")
    dtype: str = o.dtype("float32", ("float32", "bfloat16", "float16"))
    device: str = field(default="cpu", metadata=option("cpu or cuda[:N]"))
    repeats: int = o.count(5, "runs (the median is kept)")
    threads: int | None = o.threads()


@dataclass(frozen=True)
class ParallelBenchConfig(BenchConfig):
    models: tuple[str, ...] = o.models(o.CATALOGUE_MODELS[:3])
    modes: tuple[str, ...] = o.comma_list(
        ("one", "tp", "pp", "pp-serial"), "one, tp, pp, pp-serial"
    )
    degree: int = o.count(2, "ranks of the split modes")
    threads: int | None = o.threads(2, "threads in all (shared by ranks)")
    prompt: int = o.count(64, "prompt tokens")
    decode: int = o.count(32, "decode steps timed / generated")
    requests: int = o.count(16, "offline prompts")
    dtype: str = o.dtype("float32")


@dataclass(frozen=True)
class DisaggregationConfig(BenchConfig):
    models: tuple[str, ...] = o.models(o.CATALOGUE_MODELS[:3])
    threads: int | None = o.threads(1, "threads of each engine core")
    streams: int = o.count(4, "decode streams running throughout")
    stream_prompt: int = o.count(64, "each stream's prompt tokens")
    long: int = o.count(3, "long prompts arriving meanwhile")
    prompt: int = o.count(2048, "each long prompt's tokens")
    long_tokens: int = o.count(16, "tokens each long one generates")
    interval: float = field(default=4.0, metadata=option("seconds between long prompts"))


@dataclass(frozen=True)
class TiledAttentionConfig(BenchConfig):
    contexts: tuple[int, ...] = o.comma_list(
        (512, 1024, 2048, 4096, 8192, 16384, 32768), "context lengths", o.ints
    )
    max_prompt: int = o.count(32768, "longest prompt timed")
    tile: int = o.count(128, "tile size of the tiled paths")
    batch: int = o.count(16, "decode sequences")
    naive_gib: float = field(
        default=4.0, metadata=option("the naive prompt form runs where its scores fit this")
    )
    repeats: int = o.count(5, "runs (the median is kept)")
    prompt_repeats: int = o.count(1, "runs of each prompt form")
    threads: int | None = o.threads()


def _engine_option(name: str, default):
    """An engine option a benchmark sets on the engines it builds, with the engine's own
    flag and help and a default of the benchmark's."""
    f = next(f for f in fields(EngineConfig) if f.name == name)
    return field(default=default, metadata=f.metadata)


@dataclass(frozen=True)
class InvarianceConfig(BenchConfig):
    models: tuple[str, ...] = o.models(o.CATALOGUE_MODELS[:2])
    prompt_tokens: int = o.count(512, "prompt tokens (prefill)")
    decode_tokens: int = o.count(128, "tokens decoded")
    repeats: int = o.count(2, "latency repeats a round")
    num_prompts: int = o.count(64, "offline requests")
    input_tokens: int = o.count(128, "each prompt's tokens")
    output_tokens: int = o.count(128, "tokens each request generates")
    rounds: int = o.rounds(3)
    kv_cache_memory: float | None = _engine_option("kv_cache_memory", 1.0)
    quantization: str | None = _engine_option("quantization", None)
    completions: int = o.count(
        1000, "identical greedy requests through a server, per mode (0: none)"
    )
    concurrency: int = o.count(16, "requests in flight")
    completion_tokens: int = o.count(32, "tokens each completion generates")
    threads: int | None = o.threads()
    seed: int = o.seed()


@dataclass(frozen=True)
class BackendsConfig(BenchConfig):
    models: tuple[str, ...] = o.models(o.CATALOGUE_MODELS[:2])
    num_prompts: int = o.count(16, "offline requests")
    input_tokens: int = o.count(64, "each prompt's tokens")
    output_tokens: int = o.count(64, "tokens each request generates")
    streams: int = o.count(8, "streamed requests a way, a round")
    rounds: int = o.rounds(3)
    kv_cache_memory: float | None = _engine_option("kv_cache_memory", 0.5)
    threads: int | None = o.threads()
    seed: int = o.seed()


@dataclass(frozen=True)
class LmevalConfig(BenchConfig):
    models: tuple[str, ...] = o.models(o.CATALOGUE_MODELS[:1])
    dtype: str = o.dtype("auto", ("auto", "bfloat16", "float32"))
    quantization: str | None = _engine_option("quantization", None)
    rounds: int = o.rounds(3)
    concurrency: int = o.count(1, "lm-eval's num_concurrent")
    threads: int | None = o.threads()


@dataclass(frozen=True)
class LongContextConfig(EngineBench):
    lengths: tuple[int, ...] = o.comma_list((1024, 2048, 4096), "haystack lengths", o.ints)
    depths: tuple[float, ...] = o.comma_list(
        (0.0, 0.25, 0.5, 0.75, 1.0), "needle depths (0: the start, 1: the end)", o.floats
    )
    ppl_tokens: int | None = field(
        default=None,
        metadata=option("tokens of the text scored by position (default: the context)"),
    )
    text: str | None = field(
        default=None, metadata=option("a long text file (default: Lady Susan)")
    )
    window_model: str | None = field(
        default=None,
        metadata=option(
            "also measure a windowed model's KV with windows freeing and masking (e.g. gemma3-270m)"
        ),
    )
    window_max: int = o.count(8192, "the longest length run on the windowed model")
    seed: int = o.seed()
