"""The tokenworks command: one subcommand a job (generate, chat, serve, pull, models, inspect,
env, profile, bench, eval, plan); engine and server flags come from their config dataclasses."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, field

from tokenworks import SamplingParams
from tokenworks.bench.parsers import add_bench_parsers
from tokenworks.config import add_engine_arguments, engine_kwargs
from tokenworks.models.catalogue import DEFAULT_MODEL
from tokenworks.options import add_arguments, from_args, option
from tokenworks.serve.limits import ServerLimits
from tokenworks.serve.serve_config import ServeConfig

_DEFAULTS = SamplingParams()


@dataclass(frozen=True)
class SamplingOptions:
    """generate's and chat's sampling flags, with the API's defaults (SamplingParams') but
    one: an answer on the command line runs to 128 tokens, not the API's 16."""

    max_tokens: int = field(default=128, metadata=option("tokens to generate at most"))
    temperature: float = field(
        default=_DEFAULTS.temperature, metadata=option("0: greedy; higher: more varied")
    )
    top_k: int = field(default=_DEFAULTS.top_k, metadata=option("keep the k likeliest (0: off)"))
    top_p: float = field(default=_DEFAULTS.top_p, metadata=option("nucleus sampling (1: off)"))
    min_p: float = field(default=_DEFAULTS.min_p, metadata=option("drop tokens below this share"))
    repetition_penalty: float = field(
        default=_DEFAULTS.repetition_penalty, metadata=option("above 1 discourages repeats")
    )
    seed: int | None = field(default=None, metadata=option("makes sampling reproducible"))
    stop: list[str] = field(default_factory=list, metadata=option("a stop string (repeatable)"))


@dataclass(frozen=True)
class KVIndexOptions:
    """kv-index's flags: the engine's KV events sockets, and how often to say what it holds."""

    endpoint: str = field(metadata=option("the engine's KV events PUB address to subscribe to"))
    replay_endpoint: str | None = field(
        default=None, metadata=option("its replay address, to fill gaps in the numbers")
    )
    topic: str = field(default="", metadata=option("the events' topic"))
    interval: float = field(default=1.0, metadata=option("seconds between two summaries"))
    seconds: float = field(default=0.0, metadata=option("stop after this long (0: never)"))
    json: bool = field(default=False, metadata=option("a JSON object per summary"))


def _params(args) -> SamplingParams:
    return SamplingParams(**asdict(from_args(SamplingOptions, args)))


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
            line = _read_line("> ")
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


def _read_line(prompt: str) -> str:
    """input(prompt), but where stdin is not a terminal, a read that wakes every 0.1 s: a
    Ctrl-C the kernel hands to another thread (torch's workers) only sets a flag, which a
    main thread blocked in read() would never look at."""
    import select

    if sys.stdin.isatty():
        return input(prompt)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    while not select.select([sys.stdin], [], [], 0.1)[0]:
        pass
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


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


def _run_node(args) -> int:
    from tokenworks import run_node
    from tokenworks.config import EngineConfig

    return run_node(EngineConfig(model=args.model, **engine_kwargs(args)))


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


def cmd_profile(args) -> int:
    from tokenworks.bench.profile import run_profile

    return run_profile(args)


def cmd_kv_index(args) -> int:
    from tokenworks.front.kv_index import watch

    return watch(from_args(KVIndexOptions, args))


def cmd_inspect(args) -> int:
    from tokenworks.models.gguf_inspect import run

    return run(args)


def cmd_env(args) -> int:
    from tokenworks.env_report import main

    return main(as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenworks",
        description="An LLM inference engine, an OpenAI- and Anthropic-compatible server and "
        "a measurement lab. Every command below takes --help.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete a prompt, streaming to stdout")
    p.add_argument("prompt")
    p.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user turn")
    add_engine_arguments(p)
    add_arguments(p, SamplingOptions)
    p.set_defaults(fn=cmd_generate, max_num_seqs=1)  # one stream: size the KV pool for it

    p = sub.add_parser("chat", help="an interactive conversation using the model's chat template")
    p.add_argument("--system", default=None, help="a system message")
    add_engine_arguments(p)
    add_arguments(p, SamplingOptions)
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
        "inspect",
        help="what a GGUF file asks for, key by key, and what tokenworks does with each "
        "(read, informational, refused and why); its tensors' block types; exit 2 if refused",
    )
    p.add_argument("file", help="a .gguf file")
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser(
        "kv-index",
        help="which blocks an engine holds, rebuilt from its KV events alone "
        "(serve --kv-events-config), summed up by medium every interval",
    )
    add_arguments(p, KVIndexOptions)
    p.set_defaults(fn=cmd_kv_index)

    p = sub.add_parser(
        "env", help="versions, CPU features and which kernel paths run here (and why not)"
    )
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p.set_defaults(fn=cmd_env)
    p = sub.add_parser(
        "profile",
        help="one prompt pass and one decode step of the torch modules, component by "
        "component: FLOPs, bytes, time, GFLOP/s, GB/s and the roofline's share",
    )
    p.add_argument("--prompt-tokens", type=int, default=512, help="the prompt pass's length")
    p.add_argument("--batch", type=int, default=1, help="sequences in the decode step")
    p.add_argument(
        "--repeats", type=int, default=5, help="steps of each phase (the fastest is kept)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument(
        "--record", metavar="DIR", default=None, help="also write an evidence record there"
    )
    p.add_argument("--hardware", default=None, help="the roofline's device from `plan "
                   "hardware` (default: this CPU measured, or the GPU by its name)")  # fmt: skip
    add_engine_arguments(p)
    p.set_defaults(fn=cmd_profile)
    _add_lab_parsers(sub)
    return parser


def _add_lab_parsers(sub) -> None:
    """bench, plan and template: the commands that measure, predict and show."""
    from tokenworks.plan.commands import add_plan_parser
    from tokenworks.serve.template_command import add_template_parser

    add_bench_parsers(sub)
    add_plan_parser(sub)
    add_template_parser(sub)


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
        if getattr(args, "node_rank", 0) > 0:  # this machine runs its share of the ranks only
            return _run_node(args)
        return args.fn(args)
    except (ValueError, ModelNotFoundError, ModelLoadError, ChecksumError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        from tokenworks.extras import missing_extra

        message = missing_extra(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
