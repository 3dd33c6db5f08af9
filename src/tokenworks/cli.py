"""tokenworks generate | chat | serve | pull | models | env | bench (latency, throughput,
structured, serve, peers, report, compare, pool) | plan (models, hardware, kv, fit, roofline,
quant, queue, spec, cost, batching, paging)"""

from __future__ import annotations

import argparse
import sys

from tokenworks import environment
from tokenworks.config import add_engine_arguments, engine_kwargs
from tokenworks.models.catalogue import DEFAULT_MODEL
from tokenworks.options import add_arguments
from tokenworks.serve.limits import ServerLimits
from tokenworks.serve.serve_config import ServeConfig


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def _params(args):
    from tokenworks import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
    )


def _llm(args):
    from tokenworks import LLM

    return LLM(args.model, **engine_kwargs(args))


def cmd_generate(args) -> int:
    params = _params(args)  # validate before the model loads
    llm = _llm(args)
    prompt = args.prompt
    if args.chat_template:
        prompt = llm.render_chat([{"role": "user", "content": prompt}])
    for piece in llm.stream(prompt, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args) -> int:
    import signal

    # A shell that starts us in the background leaves SIGINT ignored; the chat's Ctrl-C
    # must still reach the prompt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    params = _params(args)
    llm = _llm(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print(
        "chat with the model; Ctrl-C stops an answer, an empty line or Ctrl-D ends the chat, "
        "/reset forgets the conversation"
    )
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\n(an empty line or Ctrl-D ends the chat)")
            continue
        if not line.strip():
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        reply = "".join(_answer(llm, llm.render_chat(messages), params))
        messages.append({"role": "assistant", "content": reply})


def _answer(llm, prompt: str, params):
    """Stream one answer to stdout, yielding its pieces; Ctrl-C stops it between two
    engine steps (the engine is never interrupted mid-step) and keeps what was said."""
    import signal
    import threading

    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        for piece in llm.stream(prompt, params, cancel=stop.is_set):
            sys.stdout.write(piece)
            sys.stdout.flush()
            yield piece
    finally:
        signal.signal(signal.SIGINT, previous)
    print(" [stopped]" if stop.is_set() else "")


def cmd_serve(args) -> int:
    from tokenworks.config import EngineConfig
    from tokenworks.options import from_args
    from tokenworks.serve.limits import ServerLimits
    from tokenworks.serve.serve_config import ServeConfig
    from tokenworks.serve.server import run_server

    try:
        options, limits = from_args(ServeConfig, args), from_args(ServerLimits, args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return run_server(EngineConfig(model=args.model, **engine_kwargs(args)), options, limits)


def cmd_pull(args) -> int:
    from tokenworks.models import catalogue

    path = catalogue.pull(args.name, force=args.force)
    print(path)
    return 0


def cmd_models(args) -> int:
    from tokenworks.models import catalogue

    print(f"cache: {catalogue.home()}")
    for e in catalogue.CATALOGUE.values():
        cached = catalogue.cached_path(e).exists()
        mark = "cached" if cached else "not cached"
        default = " (default)" if e.name == DEFAULT_MODEL else ""
        print(
            f"{e.name}{default}\t{mark}\t{e.size_bytes / 1e6:.0f} MB\t{e.licence}\t{e.description}"
        )
    return 0


def cmd_env(args) -> int:
    from tokenworks.env_report import main

    return main(as_json=args.json)


def cmd_eval_perplexity(args) -> int:
    from tokenworks.bench.perplexity import run

    run(args)
    return 0


def cmd_bench_quant(args) -> int:
    from tokenworks.bench.quant import run_quant

    run_quant(args)
    return 0


def cmd_bench_load(args) -> int:
    from tokenworks.bench.load import run_load

    run_load(args)
    return 0


def cmd_bench_latency(args) -> int:
    from tokenworks.bench.latency import run_latency

    run_latency(args)
    return 0


def cmd_bench_throughput(args) -> int:
    from tokenworks.bench.throughput import run_throughput

    run_throughput(args)
    return 0


def cmd_bench_structured(args) -> int:
    from tokenworks.bench.structured import run_structured

    run_structured(args)
    return 0


def cmd_bench_serve(args) -> int:
    from tokenworks.bench.serving import run_serving

    run_serving(args)
    return 0


def cmd_bench_soak(args) -> int:
    from tokenworks.bench.soak import run_soak

    if args.base_url and args.pid is None:
        raise SystemExit("--base-url needs --pid: the process whose memory and files to watch")
    run_soak(args)
    return 0


def cmd_bench_peers(args) -> int:
    from tokenworks.bench.peer_engines import PEER_NAMES
    from tokenworks.bench.peer_runs import BENCHES, run_peers

    for name in args.only:
        if name not in PEER_NAMES:
            raise ValueError(f"--only {name!r}: known peers are {', '.join(PEER_NAMES)}")
    for name in args.benches:
        if name not in BENCHES:
            raise ValueError(f"--benches {name!r}: choose from {', '.join(BENCHES)}")
    run_peers(args)
    return 0


def cmd_bench_report(args) -> int:
    from tokenworks.bench.report import load_records, render

    records = load_records(args.records)
    if args.peers:
        from pathlib import Path

        from tokenworks.bench.peer_runs import write_peers_report

        Path(args.out).mkdir(parents=True, exist_ok=True)
        print(write_peers_report(records, Path(args.out)))
        return 0
    print(render(records, args.out))
    return 0


def cmd_bench_moe(args) -> int:
    from tokenworks.bench.moe import run_moe_bench

    run_moe_bench(args)
    return 0


def cmd_bench_attention(args) -> int:
    from tokenworks.bench.attention_kinds import run_attention_bench

    run_attention_bench(args)
    return 0


def cmd_bench_long_context(args) -> int:
    from tokenworks.bench.long_context import run_long_context

    run_long_context(args)
    return 0


def cmd_bench_spec(args) -> int:
    from tokenworks.bench.speculative import run_speculative

    run_speculative(args)
    return 0


def cmd_bench_pool(args) -> int:
    from tokenworks.bench.pooled import pool, summary_line, write_report
    from tokenworks.bench.report import load_records

    pooled = pool(load_records(args.records), args.peer, args.goal)
    md = write_report(pooled, args.out)
    print(summary_line(pooled))
    print(f"report: {md}")
    return 0


def cmd_bench_compare(args) -> int:
    from pathlib import Path

    from tokenworks.bench.report import compare_table, load_records

    table = compare_table(load_records(args.records))
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


def _record_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="benchmarks/results", help="directory for the record")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenworks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete a prompt, streaming to stdout")
    p.add_argument("prompt")
    p.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user turn")
    add_engine_arguments(p)
    _sampling_args(p)
    p.set_defaults(fn=cmd_generate, max_num_seqs=1)  # one stream: size the KV pool for it

    p = sub.add_parser("chat", help="an interactive conversation using the model's chat template")
    p.add_argument("--system", default=None, help="a system message")
    add_engine_arguments(p)
    _sampling_args(p)
    p.set_defaults(fn=cmd_chat, max_num_seqs=1)

    p = sub.add_parser("serve", help="an OpenAI- and Anthropic-compatible HTTP server")
    add_engine_arguments(p)
    add_arguments(p, ServeConfig, "server")
    add_arguments(p, ServerLimits)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("pull", help="fetch a catalogue model into the cache")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--force", action="store_true", help="fetch again even if cached")
    p.set_defaults(fn=cmd_pull)

    p = sub.add_parser("models", help="list the catalogue and what is cached")
    p.set_defaults(fn=cmd_models)

    p = sub.add_parser(
        "env", help="versions, CPU features and which kernel paths run here (and why not)"
    )
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p.set_defaults(fn=cmd_env)
    bench = sub.add_parser("bench", help="measurements that write evidence records")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser("latency", help="single-stream prefill and decode speed")
    add_engine_arguments(p)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    _record_args(p)
    p.set_defaults(fn=cmd_bench_latency)

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
    p.add_argument("--out", default="benchmarks/results", help="directory for the record")
    p.set_defaults(fn=cmd_bench_quant)
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
        help="also a random-weight Q4_0 GGUF of a 7B Llama's shapes (3.8 GB, "
        "written once under $TOKENWORKS_HOME/synthetic)",
    )
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument(
        "--peers-dir",
        default="peers",
        help="where benchmarks/peers.sh put llama.cpp (llamacpp/bin)",
    )
    p.add_argument("--out", default="benchmarks/results", help="directory for the record")
    p.set_defaults(fn=cmd_bench_load)
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
    p.set_defaults(fn=cmd_bench_throughput)

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
    p.add_argument("--out", default="benchmarks/results", help="directory for the record")
    p.set_defaults(fn=cmd_bench_structured)

    p = bsub.add_parser(
        "serve", help="a serving benchmark of our server or any OpenAI-compatible one"
    )
    add_engine_arguments(p)
    p.add_argument("--base-url", default=None, help="drive this server instead of ours")
    p.add_argument(
        "--in-process", action="store_true", help="ours without HTTP (the async engine directly)"
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
    p.add_argument("--out", default="benchmarks/results", help="directory for the record")
    p.set_defaults(fn=cmd_bench_serve)

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
    p.add_argument("--out", default="benchmarks/results", help="directory for the record")
    p.set_defaults(fn=cmd_bench_soak)

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
    p.add_argument("--out", default="benchmarks/results", help="directory for the records")
    p.add_argument(
        "--report", default="benchmarks/report/peers", help="directory for peers.md + PNGs"
    )
    p.set_defaults(fn=cmd_bench_peers)

    p = bsub.add_parser("report", help="Markdown tables and PNG plots from evidence records")
    p.add_argument("records", nargs="+", help="record JSON files")
    p.add_argument("--out", default="benchmarks/report", help="directory for report.md + PNGs")
    p.add_argument(
        "--peers",
        action="store_true",
        help="write the engines-side-by-side report (peers.md) of bench peers instead",
    )
    p.set_defaults(fn=cmd_bench_report)

    p = bsub.add_parser("compare", help="several engines' serving runs side by side, as ratios")
    p.add_argument("records", nargs="+", help="serving records of the same workload")
    p.add_argument("--out", default=None, help="also write the table to this file")
    p.set_defaults(fn=cmd_bench_compare)

    p = bsub.add_parser(
        "pool", help="offline-throughput records of one workload, pooled round by round"
    )
    p.add_argument("records", nargs="+", help="throughput records (bench throughput or peers)")
    p.add_argument("--peer", default="vllm", help="the peer to take ratios to (default vllm)")
    p.add_argument("--goal", type=float, default=1.3, help="the ratio to reach (default 1.3)")
    p.add_argument(
        "--out", default="benchmarks/report/pooled", help="directory for pooled-PEER.md + PNG"
    )
    p.set_defaults(fn=cmd_bench_pool)

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
    p.add_argument("--out", default="benchmarks/results", help="directory for the record")
    p.set_defaults(fn=cmd_bench_spec)
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
    p.add_argument("--out", default="benchmarks/results", help="directory for the record")
    p.set_defaults(fn=cmd_bench_moe)
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
    p.add_argument("--out", default="benchmarks/results", help="directory for the record")
    p.set_defaults(fn=cmd_bench_attention)
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
    p.add_argument("--out", default="benchmarks/results", help="directory for the record")
    p.set_defaults(fn=cmd_bench_long_context)
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
    p.add_argument("--out", default="benchmarks/results", help="directory for the record")
    p.set_defaults(fn=cmd_eval_perplexity)
    from tokenworks.plan.commands import add_plan_parser

    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import logging

    # what the engine loads and how it runs, on stderr; other libraries' warnings only
    logging.basicConfig(
        level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("tokenworks").setLevel(logging.INFO)
    from tokenworks.models.catalogue import ChecksumError, ModelNotFoundError
    from tokenworks.models.loaded import ModelLoadError

    try:
        return args.fn(args)
    except (ValueError, ModelNotFoundError, ModelLoadError, ChecksumError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
