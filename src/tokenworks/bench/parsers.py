"""The parsers of `tokenworks bench` and `tokenworks eval`: each subcommand's flags, and
the function that runs it ("module:function", imported only when it runs, so building the
parser loads no benchmark)."""

from __future__ import annotations

import argparse
import importlib

from tokenworks import environment
from tokenworks.config import add_engine_arguments

RESULTS = "benchmarks/results"  # where benchmark records go unless --out says otherwise


def _run(target: str):
    """The command of a bench or eval subcommand: "module:function", imported when it
    runs (so the parser loads no benchmark), called with the parsed flags; what it
    returns is the exit status where it is an int, else 0."""

    def run(args) -> int:
        module, _, function = target.partition(":")
        result = getattr(importlib.import_module(module), function)(args)
        return result if isinstance(result, int) else 0

    return run


def _out(p: argparse.ArgumentParser, what: str = "the record") -> None:
    p.add_argument("--out", default=RESULTS, help=f"directory for {what}")


def _record_args(p: argparse.ArgumentParser) -> None:
    _out(p)
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME=PYTHON",
        help="also measure a peer in the same run from its own venv: "
        "llama.cpp=/path/to/venv/bin/python, transformers=..., vllm=... (repeatable)",
    )
    p.add_argument(
        "--hf-dir",
        default=None,
        help="a Hugging Face copy of the model, for the peers that read one (vLLM)",
    )


def _rounds(s: str) -> int:
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: every engine runs at least once; give 1 or more")
    return n


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _ramps(s: str) -> list[tuple[float, float]]:
    out = []
    for part in s.split(","):
        a, sep, b = part.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"ramp {part!r}: expected FROM:TO (req/s)")
        out.append((float(a), float(b)))
    return out


def _sweep_args(p: argparse.ArgumentParser, rates: list, concurrencies: list) -> None:
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--request-rate", type=floats, default=rates, help="req/s, comma-separated")
    p.add_argument("--max-concurrency", type=ints, default=concurrencies, help="comma-separated")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1: Poisson)")
    p.add_argument(
        "--ramp",
        type=_ramps,
        default=[],
        metavar="FROM:TO,...",
        help="sweep points whose rate rises linearly from FROM to TO req/s over the run",
    )
    p.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="send prompts to /v1/completions, or text prompts as chat messages",
    )
    p.add_argument("--slo-ttft", type=float, default=None, help="seconds, for goodput")
    p.add_argument("--slo-tpot", type=float, default=None, help="seconds, for goodput")
    p.add_argument("--slo-e2e", type=float, default=None, help="seconds, for goodput")
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=8,
        help="requests sent at once, untimed, before the sweep (0: none)",
    )


def add_bench_parsers(sub) -> None:
    """`bench ...` and `eval ...` under the top-level subparsers `sub`."""
    bench = sub.add_parser("bench", help="measurements that write evidence records")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser("latency", help="single-stream prefill and decode speed")
    add_engine_arguments(p)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    _record_args(p)
    p.set_defaults(fn=_run("tokenworks.bench.latency:run_latency"))

    p = bsub.add_parser(
        "quant",
        help="the four measurements of quantisation quality, apart, per format and model: "
        "storage, reconstruction error, behaviour (perplexity, greedy agreement), speed "
        "(beside llama-bench on the same file)",
    )
    p.add_argument(
        "--models",
        default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b",
        help="comma-separated catalogue names or .gguf paths",
    )
    p.add_argument(
        "--formats",
        default="float32,bfloat16,int8,int4,gguf",
        help="comma-separated: float32, bfloat16, int8, int4, gguf",
    )
    p.add_argument(
        "--text", default=None, help="held-out text for perplexity (default: music21's Lady Susan)"
    )
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--ppl-context", type=int, default=512, help="window (stride: half of it)")
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--peers-dir",
        default="peers",
        help="where benchmarks/peers.sh put llama.cpp (llamacpp/bin)",
    )
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.quant:run_quant"))
    p = bsub.add_parser(
        "load",
        help="cold-process time to first token and peak RSS while loading, per model, "
        "beside llama.cpp on the same file",
    )
    add_engine_arguments(p)
    p.add_argument(
        "--models",
        default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b",
        help="comma-separated catalogue names or .gguf paths",
    )
    p.add_argument(
        "--synthetic-7b",
        action="store_true",
        help="also a random-weight GGUF of Qwen2-7B's shapes in Q4_K_M (4.4 GB, "
        "written once under $TOKENWORKS_HOME/synthetic)",
    )
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument(
        "--peers-dir",
        default="peers",
        help="where benchmarks/peers.sh put llama.cpp (llamacpp/bin)",
    )
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.load:run_load"))
    p = bsub.add_parser("throughput", help="offline throughput of many requests at once")
    add_engine_arguments(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--manifest", default=None, help="a workload manifest instead of the above")
    p.add_argument("--seed", type=int, default=0, help="of the random prompts")
    p.add_argument(
        "--rounds", type=_rounds, default=1, help="each engine this many times, in turn (medians)"
    )
    _record_args(p)
    p.set_defaults(fn=_run("tokenworks.bench.throughput:run_throughput"))

    p = bsub.add_parser(
        "batches",
        help="prefill and decode tok/s against the sequences running together (1 to 256), "
        "beside llama-batched-bench on the same file, plotted",
    )
    add_engine_arguments(p)
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--prompt-tokens", type=int, default=128, help="a sequence's prompt")
    p.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed")
    p.add_argument("--peers-dir", default="peers", help="where benchmarks/peers.sh put llama.cpp")
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.batches:run_batches"))

    p = bsub.add_parser("structured", help="decode throughput with and without a JSON schema")
    add_engine_arguments(p)
    p.add_argument(
        "--batch-sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 8],
        help="comma-separated sequence counts (default 1,8)",
    )
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=4)
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.structured:run_structured"))

    p = bsub.add_parser(
        "serve", help="a serving benchmark of our server or any OpenAI-compatible one"
    )
    add_engine_arguments(p)
    p.add_argument("--base-url", default=None, help="drive this server instead of ours")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="ours without HTTP (straight into the engine's front)",
    )
    p.add_argument("--served-model", default="default", help="model name it serves")
    p.add_argument(
        "--client",
        choices=["ours", "vllm"],
        default="ours",
        help="with --base-url: the load client, ours or vLLM's `vllm bench serve` (its "
        "random dataset; needs --client-python and --tokenizer)",
    )
    p.add_argument("--client-python", default=None, help="--client vllm: a Python with vLLM")
    p.add_argument(
        "--tokenizer", default=None, help="--client vllm: the model's Hugging Face directory"
    )
    p.add_argument("--label", default=None, help="the engine's name in reports (e.g. vLLM)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--vocab-size", type=int, default=49152, help="for random prompts (remote)")
    p.add_argument("--manifest", default=None, help="a workload manifest (JSON or YAML)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    _sweep_args(p, rates=[], concurrencies=[])
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.serving:run_serving"))

    p = bsub.add_parser(
        "soak", help="many mixed requests (streamed, cancelled, invalid) against a server, "
        "sampling its RSS, open files and KV blocks"
    )  # fmt: skip
    add_engine_arguments(p)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-s", type=float, default=0.5, help="seconds between samples")
    p.add_argument("--base-url", default=None, help="soak this server instead of ours")
    p.add_argument("--pid", type=int, default=None, help="with --base-url: its process id")
    p.add_argument("--served-model", default="default", help="with --base-url: its model name")
    p.add_argument("--api-key", default=None)
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.soak:run_soak"))

    p = bsub.add_parser(
        "peers", help="latency, offline and serving benchmarks on us and every installed peer"
    )
    add_engine_arguments(p)
    p.add_argument(
        "--peers-dir",
        default=environment.get("TOKENWORKS_PEERS", "peers"),
        help="where the peers' venvs live (benchmarks/peers.sh; default $TOKENWORKS_PEERS "
        "or ./peers)",
    )
    p.add_argument("--hf-dir", default=None, help="the HF copy vLLM reads (default PEERS/smol-hf)")
    p.add_argument(
        "--only", type=_names, default=[], help="comma-separated peers (default: all known)"
    )
    p.add_argument(
        "--benches",
        type=_names,
        default=["latency", "offline", "serving"],
        help="comma-separated: latency, offline, serving (default all)",
    )
    p.add_argument("--prompt-tokens", type=int, default=512, help="latency: prefill length")
    p.add_argument("--decode-tokens", type=int, default=128, help="latency: tokens decoded")
    p.add_argument("--repeats", type=int, default=3, help="latency: repeats (median)")
    p.add_argument("--offline-manifest", default=None, help="default 64 x 128 in / 128 out")
    p.add_argument(
        "--offline-rounds", type=_rounds, default=1, help="offline: every engine this many times"
    )
    p.add_argument("--serving-manifest", default=None, help="default 32 x 128 in / 64 out")
    p.add_argument("--vocab-size", type=int, default=49152, help="for random prompts")
    p.add_argument("--seed", type=int, default=0)
    _sweep_args(p, rates=[1.0, 2.0, 4.0], concurrencies=[1, 4, 16])
    _out(p, "the records")
    p.add_argument(
        "--report", default="benchmarks/report/peers", help="directory for peers.md + PNGs"
    )
    p.set_defaults(fn=_run("tokenworks.bench.peer_runs:run_peers"))

    p = bsub.add_parser("report", help="Markdown tables and PNG plots from evidence records")
    p.add_argument("records", nargs="+", help="record JSON files")
    p.add_argument("--out", default="benchmarks/report", help="directory for report.md + PNGs")
    p.add_argument(
        "--peers",
        action="store_true",
        help="write the engines-side-by-side report (peers.md) of bench peers instead",
    )
    p.set_defaults(fn=_run("tokenworks.bench.report_runs:run_report"))

    p = bsub.add_parser("compare", help="several engines' serving runs side by side, as ratios")
    p.add_argument("records", nargs="+", help="serving records of the same workload")
    p.add_argument("--out", default=None, help="also write the table to this file")
    p.set_defaults(fn=_run("tokenworks.bench.report_runs:run_compare"))

    p = bsub.add_parser(
        "pool", help="offline-throughput records of one workload, pooled round by round"
    )
    p.add_argument("records", nargs="+", help="throughput records (bench throughput or peers)")
    p.add_argument("--peer", default="vllm", help="the peer to take ratios to (default vllm)")
    p.add_argument("--goal", type=float, default=1.3, help="the ratio to reach (default 1.3)")
    p.add_argument(
        "--out", default="benchmarks/report/pooled", help="directory for pooled-PEER.md + PNG"
    )
    p.set_defaults(fn=_run("tokenworks.bench.report_runs:run_pool"))

    p = bsub.add_parser(
        "spec",
        help="speculative decoding: speed-up, acceptance and plan spec's prediction per "
        "method and k, copy-heavy and free text, batch 1 and a concurrency",
    )
    add_engine_arguments(p)
    p.add_argument("--methods", default="ngram", help="comma-separated: ngram, draft_model")
    p.add_argument("--k", default="2,4,8", help="comma-separated num_speculative_tokens")
    p.add_argument("--draft-model", default=None, help="the drafter for draft_model")
    p.add_argument("--workloads", default="copy,free", help="comma-separated: copy, free")
    p.add_argument("--concurrency", default="1,16", help="comma-separated; 1 is one at a time")
    p.add_argument("--requests", type=int, default=4, help="prompts per batch-1 cell")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="runs of each cell (median kept)")
    p.add_argument(
        "--llamacpp-python", default=None, metavar="PYTHON",
        help="llama-cpp-python's venv python: its n-gram lookup at batch 1 as the peer",
    )  # fmt: skip
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.speculative:run_speculative"))
    p = bsub.add_parser(
        "moe",
        help="one MoE layer: experts a batch touches against the plan, and each way of "
        "running it timed across batch sizes, with a random and a skewed router",
    )
    p.add_argument("--shape", default="qwen3-30b-a3b", help="qwen3-30b-a3b, mixtral-8x7b or "
                   "qwen1.5-moe-a2.7b (one layer of it, random weights)")  # fmt: skip
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--skew", type=float, default=1.0, help="the skewed router's Zipf exponent")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.moe:run_moe_bench"))
    p = bsub.add_parser(
        "attention",
        help="decode attention for MHA, GQA, MQA and MLA at one hidden size: cache bytes "
        "per token and time per layer, beside the plan's figures",
    )
    p.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    p.add_argument("--contexts", default="1024,4096", help="comma-separated context lengths")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.attention_kinds:run_attention_bench"))
    p = bsub.add_parser(
        "compiled",
        help="eager, --compile and C-kernel step times: a prompt pass and decode steps at "
        "several batch sizes, with the compile time",
    )
    p.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,"
                   "qwen2.5-coder-1.5b", help="comma-separated catalogue names")  # fmt: skip
    p.add_argument("--modes", default="eager,compiled,c")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--context", type=int, default=128, help="each decoding sequence's length")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.compiled:run_compiled_bench"))
    p = bsub.add_parser(
        "parallel",
        help="tensor and pipeline parallelism over processes of this machine against one "
        "process with the same cores: decode, offline throughput, and the messages a step "
        "sends beside plan parallel's prediction",
    )
    p.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b",
                   help="comma-separated catalogue names")  # fmt: skip
    p.add_argument("--modes", default="one,tp,pp,pp-serial")
    p.add_argument("--degree", type=int, default=2, help="ranks of the split modes")
    p.add_argument("--threads", type=int, default=2, help="threads in all (shared by ranks)")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--decode", type=int, default=32, help="decode steps timed / generated")
    p.add_argument("--requests", type=int, default=16, help="offline prompts")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.parallel:run_parallel_bench"))
    p = bsub.add_parser(
        "disaggregation",
        help="prefill / decode disaggregation against colocation on two engine cores: the "
        "decode streams' inter-token latency while long prompts arrive, the long prompts' "
        "time to first token, and each KV handoff's bytes and seconds",
    )
    p.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b",
                   help="comma-separated catalogue names")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="threads of each engine core")
    p.add_argument("--streams", type=int, default=4, help="decode streams running throughout")
    p.add_argument("--stream-prompt", type=int, default=64, help="each stream's prompt tokens")
    p.add_argument("--long", type=int, default=3, help="long prompts arriving meanwhile")
    p.add_argument("--prompt", type=int, default=2048, help="each long prompt's tokens")
    p.add_argument("--long-tokens", type=int, default=16, help="tokens each long one generates")
    p.add_argument("--interval", type=float, default=4.0, help="seconds between long prompts")
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.disaggregation:run_disaggregation_bench"))
    p = bsub.add_parser(
        "tiled-attention",
        help="naive, SDPA and tiled prompt attention (time, peak memory) and the decode "
        "paths (torch, tiled, C rows, C online softmax) by context",
    )
    p.add_argument("--contexts", default="512,1024,2048,4096,8192,16384,32768")
    p.add_argument("--max-prompt", type=int, default=32768, help="longest prompt timed")
    p.add_argument("--tile", type=int, default=128, help="tile size of the tiled paths")
    p.add_argument("--batch", type=int, default=16, help="decode sequences")
    p.add_argument("--naive-gib", type=float, default=4.0,
                   help="the naive prompt form runs where its scores fit this")  # fmt: skip
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt-repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.tiled_attention:run_tiled_attention_bench"))
    p = bsub.add_parser(
        "invariance",
        help="what batch invariance costs: prefill, decode and offline throughput with it "
        "(the default) and without, interleaved, per model",
    )
    p.add_argument("--models", type=_names, default=["smollm2-135m", "gemma3-270m"],
                   help="comma-separated catalogue models")  # fmt: skip
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="latency repeats a round")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=_rounds, default=3)
    p.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB of KV pool")
    p.add_argument(
        "--quantization", choices=["gguf", "none"], default=None,
        help="the weights as the file stores them (the default) or dequantised to bfloat16",
    )  # fmt: skip
    p.add_argument(
        "--completions", type=int, default=1000,
        help="identical greedy requests through a server, per mode (0: none)",
    )  # fmt: skip
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--completion-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.invariance:run_invariance"))
    p = bsub.add_parser(
        "backends",
        help="what each backend layer costs: an offline batch through the engine front "
        "against the engine alone, and streamed requests through a remote relay against "
        "the server directly",
    )
    p.add_argument("--models", type=_names, default=["smollm2-135m", "gemma3-270m"],
                   help="comma-separated catalogue models")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=8, help="streamed requests a way, a round")
    p.add_argument("--rounds", type=_rounds, default=3)
    p.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB of KV pool each")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.backends:run_backends"))
    p = bsub.add_parser(
        "lmeval",
        help="lm-evaluation-harness on a local multiple-choice task, in process and through "
        "a server on the same engine: time and agreement",
    )
    p.add_argument("--models", type=_names, default=["smollm2-135m"],
                   help="comma-separated catalogue models")  # fmt: skip
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--quantization", choices=["gguf", "none"], default=None)
    p.add_argument("--rounds", type=_rounds, default=3)
    p.add_argument("--concurrency", type=int, default=1, help="lm-eval's num_concurrent")
    p.add_argument("--threads", type=int, default=None)
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.lmeval:run_lmeval"))
    p = bsub.add_parser(
        "long-context",
        help="the five claims of a context length: accepts, behaves (perplexity by "
        "position), fits (KV bytes against the plan), answers in time, uses what it is "
        "given (needle in a haystack)",
    )
    add_engine_arguments(p)
    p.add_argument("--lengths", default="1024,2048,4096",
                   help="comma-separated haystack lengths (tokens)")  # fmt: skip
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1",
                   help="comma-separated needle depths (0: the start, 1: the end)")  # fmt: skip
    p.add_argument("--ppl-tokens", type=int, default=None,
                   help="tokens of the text scored by position (default: the context)")  # fmt: skip
    p.add_argument("--text", default=None, help="a long text file (default: music21's Lady Susan)")
    p.add_argument("--window-model", default=None,
                   help="also measure a windowed model's KV with windows freeing and masking "
                   "(e.g. gemma3-270m)")  # fmt: skip
    p.add_argument("--window-max", type=int, default=8192,
                   help="the longest length run on the windowed model")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.long_context:run_long_context"))
    ev = sub.add_parser("eval", help="what a model computes: perplexity on a text")
    esub = ev.add_subparsers(dest="eval_command", required=True)
    p = esub.add_parser(
        "perplexity",
        help="perplexity on a text file with a sliding window (the method transformers "
        "documents), written as an evidence record",
    )
    p.add_argument("file", help="a UTF-8 text file")
    add_engine_arguments(p)
    p.add_argument("--context", type=int, default=None,
                   help="the window, in tokens (default: the model's context)")  # fmt: skip
    p.add_argument("--stride", type=int, default=None,
                   help="tokens between window starts (default: the window)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=None,
                   help="score only the text's first N tokens")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _out(p)
    p.set_defaults(fn=_run("tokenworks.bench.perplexity:run"))
