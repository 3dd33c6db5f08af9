"""Engine configuration: every option that changes numerics, kernels or capacity, named once.

Each field is written into every evidence record, so two measurements can be compared
knowing exactly what differed. The command-line flags of every command that builds an
engine are made from these fields (`add_engine_arguments`): a field's type, default and
help are written here only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import asdict, dataclass, field

from tokenworks.kernels import KERNELS
from tokenworks.models.catalogue import DEFAULT_MODEL
from tokenworks.options import add_arguments, fields_of, option, to_argv

# how the KV cache keeps keys and values (engine/kv_quant.py)
KV_DTYPES = ("auto", "int8", "fp8_e4m3")

QUANTIZATIONS = (None, "gguf", "none", "int8", "int4")  # None: gguf for a GGUF file on the CPU
DRAFT_QUANTIZATIONS = (None, "int8", "int4")
DTYPES = ("float32", "bfloat16", "float16")  # torch's names for them (torch_dtype)
# options that were renamed or moved into the config: old name -> what to use instead
RENAMED = {
    "attention": "kernels (auto, c or torch; 'cpp' is now 'c', 'sdpa' is now 'torch')",
}


DEFAULT_DTYPE = "bfloat16"  # the fast dtype on CPU and CUDA alike (float32 always runs)


MEMORY = "KV memory and scheduling"
SPECULATIVE_METHODS = ("ngram", "draft_model")
DISTRIBUTED = "distributed"
EXECUTOR_BACKENDS = ("mp", "ray")  # where engine cores and worker ranks run


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's shape: --speculative-config '{"method": "ngram",
    "num_speculative_tokens": 4}'. The guesses are checked by the target in one pass and
    the output distribution stays the target's (engine/speculative/)."""

    method: str = "ngram"  # ngram (prompt lookup) or draft_model
    num_speculative_tokens: int = 4  # k: the most tokens proposed per step
    model: str | None = None  # draft_model: the drafter (same tokenizer as the target)
    quantization: str | None = None  # the drafter's weight-only quantisation (int8, int4)
    dtype: str | None = None  # the drafter's dtype (default: the target's)
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up
    prompt_lookup_min: int = 2  # ngram: the shortest suffix that counts as a match
    # stop proposing for a sequence while its measured acceptance and the measured draft
    # and verify costs say a step gains less than plain decoding; try again later
    adaptive: bool = True

    @classmethod
    def parse(cls, value) -> SpeculativeConfig:
        """From a JSON string (the command line), a dict (the Python API) or itself."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}): {value!r}") from e
        if not isinstance(value, dict):
            raise ValueError("speculative_config: expected a JSON object such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}')  # fmt: skip
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}"
            )
        value = dict(value)
        if "method" not in value and value.get("model"):
            value["method"] = "draft_model"  # vLLM infers the method from a model
        return cls(**value)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method {self.method!r}: expected one of "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, not {k!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('the draft_model method needs "model": the drafter to load')
        if self.method == "ngram" and self.model:
            raise ValueError('the ngram method takes no "model"; use "method": "draft_model"')
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"draft quantization {self.quantization!r}: expected int8 or int4")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"draft dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")

    def __str__(self) -> str:
        return json.dumps(asdict(self))


def _speculative_arg(text: str) -> SpeculativeConfig:
    """--speculative-config's parser: a bad value's own reason, not argparse's generic one."""
    try:
        return SpeculativeConfig.parse(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(
        default=DEFAULT_MODEL,
        metadata=option("catalogue name, .gguf, dir or hub id", flag="--model", short="-m"),
    )
    dtype: str = field(
        default="auto",
        metadata=option("auto (fast for the device), float32, bfloat16 or float16"),
    )
    device: str = field(default="cpu", metadata=option("cpu or cuda[:N]"))
    threads: int | None = field(
        default=None, metadata=option("CPU threads for torch and the C kernels (default: torch's)")
    )
    max_model_len: int | None = field(
        default=None, metadata=option("context limit (default: the model's own)", group=MEMORY)
    )
    kernels: str = field(
        default="auto",
        metadata=option(
            "which code runs the forward pass: c (the C kernels of kernels/csrc: small decode "
            "batches as one call, C between torch's products otherwise, paged attention), "
            "torch (the torch modules: gathered K/V + SDPA), or auto: c on the CPU for "
            "bfloat16 and quantised weights where it builds, torch for float32",
            choices=KERNELS,
        ),
    )
    packed_products: bool = field(
        default=True,
        metadata=option(
            "with the C kernels, multiply packed copies of bfloat16 weights where the CPU "
            "has AMX or AVX-512 BF16 (off: oneDNN's and torch's products)"
        ),
    )
    amx_tiles: bool = field(
        default=True,
        metadata=option(
            "run the packed products and prompt attention on AMX tiles where the CPU has "
            "them (off: AVX-512 BF16 dot products)"
        ),
    )
    attention_tile: int | None = field(
        default=None,
        metadata=option(
            "the torch path's attention as exact tiles of N queries x N keys with an online "
            "softmax (ops/tiled_attention.py: scores never held for a whole row; on any "
            "device) instead of SDPA; with --kernels auto the torch path then runs the model",
            metavar="N",
        ),
    )
    compile: bool = field(
        default=False,
        metadata=option(
            "each decoder layer's dense work through torch.compile (Inductor: C++ on the "
            "CPU, Triton on CUDA), attention eager between (models/compiled.py); runs the "
            "torch modules, so a GGUF file needs --quantization none"
        ),
    )
    repack: bool = field(
        default=True,
        metadata=option(
            "with --quantization gguf, repack the block types the C kernels repack (Q4_0, "
            "Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, Q2_K to Q6_K, IQ4_XS) eight rows at a time "
            "at load, into memory the process owns (the file's pages are given back); off: "
            "multiply the blocks as the file lays them out"
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=option(
            "how the weights are stored and multiplied: gguf (a GGUF file's own quantised "
            "blocks, executed as stored; the default for GGUF files on the CPU), none (every "
            "weight dequantised to --dtype), or weight-only int8 per row / int4 in groups of "
            "32 (CPU)",
            choices=["gguf", "none", "int8", "int4"],
        ),
    )
    dense_from_rows: int | None = field(
        default=None,
        metadata=option(
            "with --quantization: keep a dense copy of the dequantised weights for products "
            "of N or more rows (prefill, big batches), where it is faster (e.g. 8)",
            metavar="N",
        ),
    )
    keep_freed_memory: bool = field(
        default=True,
        metadata=option(
            "keep freed heap pages in the process, so each step's buffers reuse the last "
            "step's pages instead of faulting in new ones (engine/host_memory.py)"
        ),
    )
    keep_gguf_index: bool = field(
        default=True,
        metadata=option(
            "keep an index of a GGUF file's spec, tokenizer and tensor offsets under "
            "$TOKENWORKS_HOME/converted, so later loads skip reading its metadata "
            "(models/converted.py); --no-keep-gguf-index reads the file every time"
        ),
    )
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
    max_num_seqs: int = field(
        default=64, metadata=option("sequences running at once", group=MEMORY)
    )
    max_num_batched_tokens: int = field(
        default=2048,
        metadata=option("tokens per forward pass (prompts beyond it are chunked)", group=MEMORY),
    )
    enable_chunked_prefill: bool = field(
        default=True,
        metadata=option(
            "split long prompts across steps beside decodes", "--chunked-prefill", MEMORY
        ),
    )
    max_waiting: int = field(
        default=4096,
        metadata=option(
            "requests that may wait for a running slot once all max-num-seqs are taken; more "
            "are refused (HTTP 429/529); 0 refuses whatever finds no free slot",
            group=MEMORY,
        ),
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata=option(
            "fcfs, or priority: lower SamplingParams.priority first",
            group=MEMORY,
            choices=["fcfs", "priority"],
        ),
    )
    batch_invariant: bool | None = field(
        default=None,
        metadata=option(
            "a request's tokens never depend on what else is in its batch: every batch runs "
            "as rows of the C kernels' whole step (auto: where they run the model; on: "
            "elsewhere too, on torch's fixed tiles, slower; off: each batch size takes its "
            "fastest products)",
            group=MEMORY,
        ),
    )
    moe_strategy: str = field(
        default="auto",
        metadata=option(
            "how an MoE layer runs its experts: auto (by batch shape), loop (each touched "
            "expert on its tokens), grouped (touched experts in one batched product) or "
            "dense (every expert on every token)",
            group="mixture of experts",
            choices=["auto", "loop", "grouped", "dense"],
        ),
    )
    moe_capacity_factor: float | None = field(
        default=None,
        metadata=option(
            "an expert takes at most factor x tokens x top_k / experts tokens a step and the "
            "rest skip it (GShard); makes a token's output depend on its batch (default: off)",
            group="mixture of experts",
        ),
    )
    speculative_config: SpeculativeConfig | None = field(
        default=None,
        metadata=option(
            'speculative decoding as JSON, e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 4}\' or \'{"method": "draft_model", "model": NAME}\' '
            "(keys: method, num_speculative_tokens, model, quantization, dtype, "
            "prompt_lookup_max, prompt_lookup_min, adaptive)",
            group="speculative decoding",
            type=_speculative_arg,
            metavar="JSON",
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=option(
            "split each layer's heads and MLP width (and the vocabulary) over N processes "
            "joined by torch.distributed (gloo on the CPU, NCCL on CUDA), each holding its "
            "shard (models/tensor_parallel.py; runs the torch modules)",
            group=DISTRIBUTED,
            metavar="N",
        ),
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata=option(
            "cut the layers into N stages, one group of processes each (times the tensor-"
            "parallel size), a batch in flight for each stage (see --pipeline-batches; "
            "models/pipeline.py; runs the torch modules)",
            group=DISTRIBUTED,
            metavar="N",
        ),
    )
    pipeline_batches: int | None = field(
        default=None,
        metadata=option(
            "batches a pipeline keeps in flight: the next starts through the first stage "
            "while the later stages finish the last, each taking its share of the running "
            "sequences (default: one per stage; 1: one batch at a time, cut into a micro-"
            "batch for each stage)",
            group=DISTRIBUTED,
            metavar="N",
        ),
    )
    distributed_timeout: float = field(
        default=60.0,
        metadata=option(
            "seconds a collective waits for another rank before the step fails (and with it "
            "the engine: a rank that died or hangs fails its requests, never hangs them)",
            group=DISTRIBUTED,
        ),
    )
    distributed_executor_backend: str = field(
        default="mp",
        metadata=option(
            "where serve's engine cores and the worker ranks run: mp, local processes; ray, "
            "Ray actors placed on the cluster RAY_ADDRESS names (or a local one), each taking "
            "--threads CPUs (needs pip install 'tokenworks[ray]')",
            group=DISTRIBUTED,
            choices=EXECUTOR_BACKENDS,
        ),
    )
    nnodes: int = field(
        default=1,
        metadata=option(
            "machines the ranks span (torchrun's name), each running the same command with "
            "its own --node-rank; node 0 serves, the others run their share of the ranks",
            group=DISTRIBUTED,
            metavar="N",
        ),
    )
    node_rank: int = field(
        default=0,
        metadata=option(
            "this machine's place among --nnodes: 0 runs the engine (and its first ranks), "
            "k > 0 runs ranks k x world/nnodes onwards, taking its steps from node 0",
            group=DISTRIBUTED,
            metavar="K",
        ),
    )
    master_addr: str = field(
        default="127.0.0.1",
        metadata=option(
            "with --nnodes above 1: node 0's address, where every rank meets "
            "(torch.distributed's TCP store on --master-port, the steps on the port after)",
            group=DISTRIBUTED,
            metavar="HOST",
        ),
    )
    master_port: int = field(
        default=29500,
        metadata=option(
            "with --nnodes above 1: node 0's rendezvous port (torchrun's default); the "
            "steps travel on the next port",
            group=DISTRIBUTED,
            metavar="PORT",
        ),
    )
    warmup: bool = field(
        default=True,
        metadata=option(
            "one forward pass at the token budget when the engine starts, so the first big "
            "step of the first requests does not pay for growing the heap and building "
            "torch's kernels (skipped where the C kernels run every batch as whole-step "
            "rows, which build nothing for it)",
            group=MEMORY,
        ),
    )
    detokenize: bool = field(
        default=True,
        metadata=option(
            "the engine turns tokens into text and applies stop strings; off, it sends token "
            "ids alone and its caller does both (the server's engine core process: "
            "engine/detokenizer.py in the API process)",
            group="output",
        ),
    )

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            spec = SpeculativeConfig.parse(self.speculative_config)
            object.__setattr__(self, "speculative_config", spec)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of auto, {', '.join(DTYPES)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device {self.device!r}: expected cpu or cuda[:N]")
        if self.device.startswith("cuda") and not _cuda_available():
            raise ValueError(f"device {self.device!r} requested but torch sees no CUDA device")
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError("float16 runs on CUDA only; on CPU use bfloat16 or float32")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r}: expected {', '.join(QUANTIZATIONS[1:])}"
            )
        if self.quantization in ("int8", "int4", "gguf") and self.device != "cpu":
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
            self.quantization not in ("int8", "int4") or self.dense_from_rows < 1
        ):
            raise ValueError("dense_from_rows needs --quantization int8 or int4 and must be >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory (GiB) must be > 0")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError("kv_cache_fraction must be in (0, 1]")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels {self.kernels!r}: expected one of {', '.join(KERNELS)}")
        if self.attention_tile is not None and self.attention_tile < 1:
            raise ValueError("attention_tile must be >= 1 (or unset: SDPA)")
        if self.attention_tile is not None and self.kernels == "c":
            raise ValueError("attention_tile sets the torch path's attention; drop --kernels c")
        if self.compile and self.kernels == "c":
            raise ValueError("compile compiles the torch modules; drop --kernels c")
        if self.kernels == "c" and self.device != "cpu":
            raise ValueError("kernels='c' runs on the CPU")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy {self.scheduling_policy!r}: expected fcfs or priority"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1")
        if self.sliding_window_kv not in ("free", "mask"):
            raise ValueError(f"sliding_window_kv {self.sliding_window_kv!r}: expected free or mask")
        if self.moe_strategy not in ("auto", "loop", "grouped", "dense"):
            raise ValueError(
                f"moe_strategy {self.moe_strategy!r}: expected auto, loop, grouped or dense"
            )
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            for name, on in (("kernels c", self.kernels == "c"), ("compile", self.compile),
                             ("batch_invariant", self.batch_invariant is True)):  # fmt: skip
                if on:
                    raise ValueError(
                        f"tensor and pipeline parallelism run the torch modules with collectives "
                        f"between ranks; {name} does not go with them: drop one of the two"
                    )
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r}: expected one of {', '.join(KV_DTYPES)}"
            )
        if self.kv_cache_dtype != "auto" and self.compile:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype} is read by the C kernels and the eager "
                "torch attention, which dequantise it; compile does not go with it: drop one "
                "of the two"
            )
        if self.kv_offload_gib < 0:
            raise ValueError("kv_offload_gib must be >= 0 (0: no host tier)")
        if self.kv_offload_gib and not self.enable_prefix_caching:
            raise ValueError(
                "kv_offload_gib keeps the prefix cache's evicted blocks: it needs prefix "
                "caching on (drop --no-prefix-caching, or the host tier)"
            )
        if self.kv_offload_gib and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(
                "kv_offload_gib keeps one process's KV blocks; with tensor or pipeline "
                "parallelism each rank holds part of a block: drop one of the two"
            )
        if self.pipeline_batches is not None and self.pipeline_batches < 1:
            raise ValueError("pipeline_batches must be >= 1 (or unset: one per stage)")
        if self.distributed_timeout <= 0:
            raise ValueError("distributed_timeout (seconds) must be > 0")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend {self.distributed_executor_backend!r}: expected "
                f"one of {', '.join(EXECUTOR_BACKENDS)}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank {self.node_rank} with nnodes {self.nnodes}: give a node rank from "
                f"0 to {self.nnodes - 1} (and nnodes >= 1)"
            )
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.nnodes > 1:
            if world % self.nnodes:
                raise ValueError(
                    f"nnodes {self.nnodes} does not divide the {world} ranks (tensor "
                    f"{self.tensor_parallel_size} x pipeline {self.pipeline_parallel_size}): "
                    "every node runs the same number of them"
                )
            if self.distributed_executor_backend == "ray":
                raise ValueError(
                    "with distributed_executor_backend ray, Ray places the ranks on its "
                    "nodes: leave out nnodes and node_rank"
                )
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ValueError("moe_capacity_factor must be > 0 (or unset: no capacity limit)")

    @classmethod
    def build(cls, **kw) -> EngineConfig:
        """EngineConfig(**kw), with a renamed option's new name in the error."""
        for name in kw:
            if name in RENAMED:
                raise TypeError(f"the engine option {name!r} was renamed: use {RENAMED[name]}")
        return cls(**kw)

    def resolved_quantization(self, gguf_file: bool) -> str | None:
        """What the weights run as for a model read from a GGUF file (gguf_file) or not:
        None (dequantised to the dtype), "gguf" (the file's blocks), "int8" or "int4"."""
        if self.quantization is None:
            return "gguf" if gguf_file and self.device == "cpu" else None
        if self.quantization == "gguf" and not gguf_file:
            raise ValueError("quantization gguf runs a GGUF file's blocks; this model is no GGUF")
        return None if self.quantization == "none" else self.quantization

    @property
    def resolved_dtype(self) -> str:
        return DEFAULT_DTYPE if self.dtype == "auto" else self.dtype

    @property
    def torch_dtype(self):
        """The torch.dtype of resolved_dtype (torch is imported here, not with the config:
        the server's API process reads configs without it)."""
        import torch

        return getattr(torch, self.resolved_dtype)

    def to_dict(self) -> dict:
        return {**asdict(self), "dtype": self.resolved_dtype}


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class _Renamed(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was renamed: use --{RENAMED[self.dest]}")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The command-line flags of every command that builds an engine: one per field."""
    add_arguments(p, EngineConfig)
    p.add_argument("--attention", dest="attention", action=_Renamed, help=argparse.SUPPRESS)


def engine_kwargs(args) -> dict:
    """EngineConfig fields (all but the model) from the flags add_engine_arguments made."""
    return {f.name: getattr(args, f.name) for f, _ in fields_of(EngineConfig) if f.name != "model"}


def engine_argv(args) -> list[str]:
    """The engine flags back as a command line (for a `tokenworks serve` child process):
    every flag whose value differs from its field's default."""
    return to_argv(EngineConfig, args)
