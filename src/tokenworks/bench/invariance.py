"""`tokenworks bench invariance`: what batch invariance costs, in one interleaved run.

Per model, two engines on the same weights: the default (batch-invariant where the C
kernels run the model) and `batch_invariant=False`. Each round measures both, in turns
that alternate which goes first: single-stream prefill of a P-token prompt and decode of N
tokens (bench latency's measurement), and offline throughput of R requests of I tokens in,
O out. The record keeps every round's figures, each mode's median and the ratios
(invariant / variant); one record per model. Then, through a real server over each
engine, C identical greedy requests at a concurrency: how many distinct completions come
back, and how many equal the request sent alone.
"""

from __future__ import annotations

import random
import statistics
import time

from tqdm import tqdm

from tokenworks.bench.latency import SHORT_PROMPT_TOKENS, measure_tokenworks
from tokenworks.bench.record import make_record, model_record, write_record
from tokenworks.bench.workload import latency_prompt

MODES = {"invariant": None, "variant": False}  # mode -> EngineConfig.batch_invariant
FIGURES = ("prefill_tok_s", "decode_tok_s", "throughput_output_tok_s")


def measure_round(llm, prompt, short, offline, args) -> dict:
    """One round of one engine: prefill and decode (best of the repeats), then the offline
    requests once."""
    from tokenworks import SamplingParams

    latency = measure_tokenworks(llm, prompt, short, args.decode_tokens, args.repeats)
    llm.engine.blocks.reset_prefix_cache()
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outputs = llm.generate(offline, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "prefill_tok_s": statistics.median(latency["prefill_tok_s"]),
        "decode_tok_s": statistics.median(latency["decode_tok_s"]),
        "throughput_output_tok_s": generated / elapsed,
    }


COPY_PROMPT = (
    "Copy this list exactly, one per line: apple, banana, cherry, damson, elderberry, fig, "
    "grape, honeydew."
)


def distinct_completions(llm, name: str, args) -> dict:
    """args.completions copies of one greedy request through a server on 127.0.0.1 over
    llm's engine, args.concurrency at a time."""
    import asyncio

    import httpx

    from tokenworks.serve.app import build_app
    from tokenworks.serve.server import ServerThread, make_state

    body = {"model": name, "prompt": COPY_PROMPT, "max_tokens": args.completion_tokens,
            "temperature": 0}  # fmt: skip

    async def texts(url: str, n: int, concurrency: int) -> list[str]:
        gate = asyncio.Semaphore(concurrency)
        bar = tqdm(total=n, desc=f"{name} completions", leave=False)

        async def one(http):
            async with gate:
                r = await http.post(url, json=body)
                r.raise_for_status()
                bar.update()
                return r.json()["choices"][0]["text"]

        async with httpx.AsyncClient(timeout=600) as http:
            out = await asyncio.gather(*(one(http) for _ in range(n)))
        bar.close()
        return out

    with ServerThread(build_app(make_state(llm.engine, [name]))) as srv:
        url = srv.url + "/v1/completions"
        alone = asyncio.run(texts(url, 1, 1))[0]
        got = asyncio.run(texts(url, args.completions, args.concurrency))
    return {
        "requests": args.completions,
        "concurrency": args.concurrency,
        "distinct": len(set(got)),
        "equal_to_alone": sum(t == alone for t in got),
    }


def run_model(name: str, args):
    from tokenworks import LLM
    from tokenworks.models import load

    threads = args.threads or 2
    loaded = load(name)
    llms = {
        mode: LLM(
            name,
            loaded=loaded,
            threads=threads,
            batch_invariant=value,
            quantization=args.quantization,
            kv_cache_memory=args.kv_cache_memory,
        )  # fmt: skip
        for mode, value in MODES.items()
    }
    if llms["invariant"].engine.invariance != "kernels":
        raise SystemExit(
            f"{name}: not batch-invariant by default ({llms['invariant'].engine.kernels()})"
        )
    vocab = loaded.spec.vocab_size
    prompt = latency_prompt(args.prompt_tokens, vocab)
    short = latency_prompt(SHORT_PROMPT_TOKENS, vocab, seed=1)
    rng = random.Random(args.seed)
    offline = [
        [rng.randrange(vocab) for _ in range(args.input_tokens)] for _ in range(args.num_prompts)
    ]
    rounds: dict[str, list[dict]] = {mode: [] for mode in MODES}
    order = list(MODES)
    for r in tqdm(range(args.rounds), desc=name):
        for mode in order if r % 2 == 0 else order[::-1]:
            rounds[mode].append(measure_round(llms[mode], prompt, short, offline, args))
    medians = {
        mode: {f: statistics.median(x[f] for x in runs) for f in FIGURES}
        for mode, runs in rounds.items()
    }
    ratios = {f: medians["invariant"][f] / medians["variant"][f] for f in FIGURES}
    results = {
        "rounds": rounds,
        "median": medians,
        "invariant_over_variant": ratios,
        "kernels": {mode: llm.engine.kernels() for mode, llm in llms.items()},
    }
    if args.completions:
        results["completions"] = {
            mode: distinct_completions(llm, name, args) for mode, llm in llms.items()
        }
    workload = {
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "offline": {
            "num_prompts": args.num_prompts,
            "input_tokens": args.input_tokens,
            "output_tokens": args.output_tokens,
            "seed": args.seed,
        },  # fmt: skip
        "rounds": args.rounds,
        "completions": {
            "requests": args.completions,
            "concurrency": args.concurrency,
            "max_tokens": args.completion_tokens,
            "prompt": COPY_PROMPT,
        },  # fmt: skip
        "threads": threads,
        "sampling": "greedy",
        "eos": "ignored",
    }
    record = make_record(
        kind="invariance",
        engine=llms["invariant"].config.to_dict(),
        model=model_record(llms["invariant"]),
        workload=workload,
        results=results,
        seeds=[args.seed],
    )
    path = write_record(record, args.out)
    said = ", ".join(f"{f} x{ratios[f]:.3f}" for f in FIGURES)
    for mode, c in results.get("completions", {}).items():
        said += f"; {mode}: {c['distinct']} distinct of {c['requests']}"
    print(f"{name}: {said} -> {path}")
    return path


def run_invariance(args) -> None:
    for name in args.models:
        run_model(name, args)
