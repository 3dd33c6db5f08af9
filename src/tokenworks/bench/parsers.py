"""The parsers of `tokenworks bench` and `tokenworks eval`, made from a registry: each
name maps to its options' dataclass (bench/configs.py, whose fields make the flags) and its
runner ("module:function", imported only when it runs, so building the parser loads no
benchmark), which is called with the dataclass."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from tokenworks.bench import configs as c
from tokenworks.options import add_arguments, from_args


@dataclass(frozen=True)
class Bench:
    config: type
    runner: str  # "module:function"
    help: str


BENCHES = {
    "latency": Bench(c.LatencyConfig, "latency:run_latency",
                     "single-stream prefill and decode speed"),
    "quant": Bench(c.QuantConfig, "quant:run_quant",
                   "the four measurements of quantisation quality, apart, per format and "
                   "model: storage, reconstruction error, behaviour (perplexity, greedy "
                   "agreement), speed (beside llama-bench on the same file)"),
    "load": Bench(c.LoadConfig, "load:run_load",
                  "cold-process time to first token and peak RSS while loading, per model, "
                  "beside llama.cpp on the same file"),
    "throughput": Bench(c.ThroughputConfig, "throughput:run_throughput",
                        "offline throughput of many requests at once"),
    "batches": Bench(c.BatchesConfig, "batches:run_batches",
                     "prefill and decode tok/s against the sequences running together (1 to "
                     "256), beside llama-batched-bench on the same file, plotted"),
    "lora": Bench(c.LoRABenchConfig, "lora:run_lora",
                  "throughput of one batch mixing 1, 4 and 16 LoRA adapters against the base "
                  "model alone, on the same engine"),
    "routing": Bench(c.RoutingBenchConfig, "routing:run_routing",
                     "prefix hit rate of multi-turn conversations across replicas, by router "
                     "policy (round robin, the last prompt's replica, KV events)"),
    "world": Bench(c.WorldConfig, "world:run_world",
                   "tokenworks against llama.cpp's own test material: its vocabularies' test "
                   "vectors, its real chat templates beside transformers, and test-chat.cpp's "
                   "model outputs parsed to their messages"),
    "page": Bench(c.PageConfig, "page:run_page",
                  "the web page: time to the first token shown against the API's, the "
                  "page's weight in bytes, and a screenshot of each page (headless Chromium)"),
    "structured": Bench(c.StructuredConfig, "structured:run_structured",
                        "decode throughput with and without a JSON schema"),
    "serve": Bench(c.ServeBenchConfig, "serving:run_serving",
                   "a serving benchmark of our server or any OpenAI-compatible one"),
    "soak": Bench(c.SoakConfig, "soak:run_soak",
                  "many mixed requests (streamed, cancelled, invalid) against a server, "
                  "sampling its RSS, open files and KV blocks"),
    "peers": Bench(c.PeersConfig, "peer_runs:run_peers",
                   "latency, offline and serving benchmarks on us and every installed peer"),
    "report": Bench(c.ReportConfig, "report_runs:run_report",
                    "Markdown tables and PNG plots from evidence records"),
    "compare": Bench(c.CompareConfig, "report_runs:run_compare",
                     "several engines' serving runs side by side, as ratios"),
    "pool": Bench(c.PoolConfig, "report_runs:run_pool",
                  "offline-throughput records of one workload, pooled round by round"),
    "spec": Bench(c.SpecConfig, "speculative:run_speculative",
                  "speculative decoding: speed-up, acceptance and plan spec's prediction per "
                  "method and k, copy-heavy and free text, batch 1 and a concurrency"),
    "moe": Bench(c.MoeConfig, "moe:run_moe_bench",
                 "one MoE layer: experts a batch touches against the plan, and each way of "
                 "running it timed across batch sizes, with a random and a skewed router"),
    "attention": Bench(c.AttentionKindsConfig, "attention_kinds:run_attention_bench",
                       "decode attention for MHA, GQA, MQA and MLA at one hidden size: cache "
                       "bytes per token and time per layer, beside the plan's figures"),
    "compiled": Bench(c.CompiledConfig, "compiled:run_compiled_bench",
                      "eager, --compile and C-kernel step times: a prompt pass and decode "
                      "steps at several batch sizes, with the compile time"),
    "parallel": Bench(c.ParallelBenchConfig, "parallel:run_parallel_bench",
                      "tensor and pipeline parallelism over processes of this machine against "
                      "one process with the same cores: decode, offline throughput, and the "
                      "messages a step sends beside plan parallel's prediction"),
    "disaggregation": Bench(c.DisaggregationConfig, "disaggregation:run_disaggregation_bench",
                            "prefill / decode disaggregation against colocation on two engine "
                            "cores: the decode streams' inter-token latency while long prompts "
                            "arrive, the long prompts' time to first token, and each KV "
                            "handoff's bytes and seconds"),
    "tiled-attention": Bench(c.TiledAttentionConfig,
                             "tiled_attention:run_tiled_attention_bench",
                             "naive, SDPA and tiled prompt attention (time, peak memory) and "
                             "the decode paths (torch, tiled, C rows, C online softmax) by "
                             "context"),
    "invariance": Bench(c.InvarianceConfig, "invariance:run_invariance",
                        "what batch invariance costs: prefill, decode and offline throughput "
                        "with it (the default) and without, interleaved, per model"),
    "backends": Bench(c.BackendsConfig, "backends:run_backends",
                      "what each backend layer costs: an offline batch through the engine "
                      "front against the engine alone, and streamed requests through a remote "
                      "relay against the server directly"),
    "lmeval": Bench(c.LmevalConfig, "lmeval:run_lmeval",
                    "lm-evaluation-harness on a local multiple-choice task, in process and "
                    "through a server on the same engine: time and agreement"),
    "long-context": Bench(c.LongContextConfig, "long_context:run_long_context",
                          "the five claims of a context length: accepts, behaves (perplexity "
                          "by position), fits (KV bytes against the plan), answers in time, "
                          "uses what it is given (needle in a haystack)"),
}  # fmt: skip
EVALS = {
    "perplexity": Bench(c.PerplexityConfig, "perplexity:run",
                        "perplexity on a text file with a sliding window (the method "
                        "transformers documents), written as an evidence record"),
}  # fmt: skip


def _run(bench: Bench):
    """The command of a subcommand: its config made from the parsed flags, handed to its
    runner (imported now); what the runner returns is the exit status where it is an int,
    else 0."""

    def run(args) -> int:
        module, _, function = bench.runner.partition(":")
        runner = getattr(importlib.import_module(f"tokenworks.bench.{module}"), function)
        result = runner(from_args(bench.config, args))
        return result if isinstance(result, int) else 0

    return run


def _add(sub, registry: dict[str, Bench]) -> None:
    for name, bench in registry.items():
        p = sub.add_parser(name, help=bench.help)
        add_arguments(p, bench.config)
        p.set_defaults(fn=_run(bench))


def add_bench_parsers(sub) -> None:
    """`bench ...` and `eval ...` under the top-level subparsers `sub`."""
    bench = sub.add_parser("bench", help="measurements that write evidence records")
    _add(bench.add_subparsers(dest="bench_command", required=True), BENCHES)
    evals = sub.add_parser("eval", help="what a model computes: perplexity on a text")
    _add(evals.add_subparsers(dest="eval_command", required=True), EVALS)
