"""`tokenworks bench backends`: what each backend layer costs, in one interleaved run.

The interface: the same offline batch (R requests, I tokens in, O out, greedy) through an
LLMEngine stepped directly (`LLM.generate`) and through an engine front in this process
(the core thread and its client: what the server and --backend talk to), output tokens a
second each. The remote proxy: S streamed requests, one at a time, sent to a server
directly and to a second server that relays them to the first (`--backend
remote:MODEL@URL`): the median time to first token and time per output token each way,
and what the relay adds. All engines read the same weights with the same settings.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import httpx
from tqdm import tqdm

from tokenworks.bench.client import run_in_process, send
from tokenworks.bench.record import make_record, model_record, write_record
from tokenworks.bench.workload import BenchRequest


def _batch(args, vocab: int) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    return [
        BenchRequest(
            [rng.randrange(vocab) for _ in range(args.input_tokens)],
            None,
            args.output_tokens,
            input_len=args.input_tokens,
        )  # fmt: skip
        for _ in range(args.num_prompts)
    ]


def _alone(llm, batch) -> float:
    from tokenworks import SamplingParams

    params = SamplingParams(max_tokens=batch[0].max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_ids for r in batch], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def _through_front(front, batch) -> float:
    results, seconds = asyncio.run(run_in_process(front, batch, progress=False))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    return sum(r.output_tokens for r in results) / seconds


async def _streams(url: str, model: str, requests: list[BenchRequest]) -> dict:
    async with httpx.AsyncClient(timeout=600) as http:
        results = [await send(http, url + "/v1/completions", model, r) for r in requests]
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    return {
        "ttft_ms": statistics.median(r.ttft for r in results) * 1000,
        "tpot_ms": statistics.median(r.tpot for r in results) * 1000,
    }


def run_model(name: str, args):
    from tokenworks import LLM
    from tokenworks.config import EngineConfig
    from tokenworks.engine.engine import LLMEngine
    from tokenworks.models import load
    from tokenworks.serve.app import build_app
    from tokenworks.serve.remote import RemoteBackend
    from tokenworks.serve.server import ServerThread, add_model, make_state

    loaded = load(name)
    kw = dict(threads=args.threads, kv_cache_memory=args.kv_cache_memory)
    llm = LLM(name, loaded=loaded, **kw)
    config = EngineConfig(model=name, **kw)
    served = make_state(LLMEngine(config, loaded), [name])
    upstream = ServerThread(build_app(served)).start()
    relaying = make_state(LLMEngine(config, loaded), [name])
    relay = RemoteBackend("remote", f"{name}@{upstream.url}/v1")
    relay.start()
    add_model(relaying, "remote", relay)
    proxy = ServerThread(build_app(relaying)).start()
    front = served.engine
    batch = _batch(args, loaded.spec.vocab_size)
    streamed = _batch(args, loaded.spec.vocab_size)[: args.streams]
    rounds: dict[str, list] = {"alone": [], "front": [], "direct": [], "proxied": []}
    ways = {
        "alone": lambda: _alone(llm, batch),
        "front": lambda: _through_front(front, batch),
        "direct": lambda: asyncio.run(_streams(upstream.url, name, streamed)),
        "proxied": lambda: asyncio.run(_streams(proxy.url, "remote", streamed)),
    }
    try:
        for r in tqdm(range(args.rounds), desc=name):
            for pair in (("alone", "front"), ("direct", "proxied")):
                for way in pair if r % 2 == 0 else pair[::-1]:
                    rounds[way].append(ways[way]())
    finally:
        proxy.stop()
        upstream.stop()
    alone, through = statistics.median(rounds["alone"]), statistics.median(rounds["front"])
    direct = {k: statistics.median(x[k] for x in rounds["direct"]) for k in ("ttft_ms", "tpot_ms")}
    proxied = {k: statistics.median(x[k] for x in rounds["proxied"]) for k in direct}
    results = {
        "rounds": rounds,
        "interface": {
            "alone_tok_s": alone,
            "front_tok_s": through,
            "front_over_alone": through / alone,
        },  # fmt: skip
        "remote": {
            "direct": direct,
            "proxied": proxied,
            "added_ttft_ms": proxied["ttft_ms"] - direct["ttft_ms"],
            "added_tpot_ms": proxied["tpot_ms"] - direct["tpot_ms"],
        },
    }
    workload = {
        "offline": {
            "num_prompts": args.num_prompts,
            "input_tokens": args.input_tokens,
            "output_tokens": args.output_tokens,
            "seed": args.seed,
        },  # fmt: skip
        "streams": {
            "requests": args.streams,
            "concurrency": 1,
            "endpoint": "/v1/completions",
        },  # fmt: skip
        "rounds": args.rounds,
        "sampling": "greedy",
        "eos": "ignored",
    }
    record = make_record(
        kind="backends", engine=llm.config.to_dict(), model=model_record(llm),
        workload=workload, results=results, seeds=[args.seed],
    )  # fmt: skip
    path = write_record(record, args.out)
    rem = results["remote"]
    print(
        f"{name}: through the front {through:.1f} tok/s against {alone:.1f} alone "
        f"(x{through / alone:.3f}); the relay adds {rem['added_ttft_ms']:.1f} ms to TTFT "
        f"and {rem['added_tpot_ms']:.2f} ms a token -> {path}"
    )
    return path


def run_backends(args) -> None:
    for name in args.models:
        run_model(name, args)
